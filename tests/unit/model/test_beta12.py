"""Consequences of the spec that hold for any weights (spec §4.1, §4.2, §4.6), and what a
beta12 pass keeps and frees (model/beta12.py)."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from megabeta.model import build_model
from megabeta.model.history import History
from support.model_helpers import ATTENTION, VOCAB, tiny_config, tiny_model, tokens

T = 19


def standard_twin(model: torch.nn.Module) -> torch.nn.Module:
    """The standard arm with the beta model's shared weights (its extras have no home there)."""
    twin = build_model(model.config.replace(arch="standard")).double()
    missing, unexpected = twin.load_state_dict(model.state_dict(), strict=False)
    assert not missing
    assert all(k.endswith(("e_k", "e_v", "f_q", "depth_bias", "self_bias")) for k in unexpected)
    return twin


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_one_block_is_the_standard_transformer(attention: str, qk_norm: bool) -> None:
    """c >= T, b_σ = 0 and f = 0: the logits equal the standard arm's (spec §4.1), whatever e_K,
    e_V and θ are (no finished KV is read)."""
    model = tiny_model(block_size=T, attention=attention, qk_norm=qk_norm)
    with torch.no_grad():
        for layer in model.layers:
            layer.attention.self_bias.zero_()
            layer.attention.f_q.zero_()
    x = tokens(length=T)
    torch.testing.assert_close(model(x), standard_twin(model)(x), rtol=0, atol=1e-12)


def test_smaller_blocks_change_the_function() -> None:
    """c < T reads finished KVs: the same weights give different logits after the first block,
    identical ones inside it."""
    model = tiny_model(block_size=T)
    x = tokens(length=T)
    one_block = model(x)
    model.config.block_size = 4
    blocked = model(x)
    torch.testing.assert_close(blocked[:, :4], one_block[:, :4], rtol=0, atol=1e-12)
    assert (blocked[:, 4:] - one_block[:, 4:]).abs().max() > 1e-3


@pytest.mark.parametrize("arch,block", [("beta12", 1), ("beta12", 4), ("standard", 4),
                                        ("looped", 4)])
def test_causality(arch: str, block: int) -> None:
    """Changing token t changes no logit before t."""
    model = tiny_model(arch=arch, block_size=block, deep_token_window=3)
    x = tokens(length=T)
    base = model(x)
    for t in (0, 5, 11, T - 1):
        y = x.clone()
        y[:, t] = (y[:, t] + 1) % VOCAB
        changed = model(y)
        torch.testing.assert_close(changed[:, :t], base[:, :t], rtol=0, atol=0)
        assert (changed[:, t:] - base[:, t:]).abs().max() > 0


@pytest.mark.parametrize("chunk", [None, 5])
@pytest.mark.parametrize("arch", ["beta12", "standard", "looped"])
def test_loss_is_mean_next_token_cross_entropy(arch: str, chunk: int | None,
                                               monkeypatch) -> None:
    """`model(x, y)` equals cross-entropy of `model(x)`; -100 is ignored. With `chunk`, the
    loss is taken in chunks of that many tokens, which cross sequences."""
    if chunk is not None:
        monkeypatch.setattr("megabeta.model.transformer.LOSS_CHUNK", chunk)
    model = tiny_model(arch=arch, block_size=4)
    x, y = tokens(length=T), tokens(length=T, seed=3)
    y[0, 2] = -100
    expected = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
    torch.testing.assert_close(model(x, y), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("schedule,checkpoint", [("block", "block"), ("wavefront", "wave")])
def test_recomputation_runs_every_unit_again_in_backward(schedule: str, checkpoint: str) -> None:
    """With activation checkpointing, backward runs every cell's layer body again: the residual
    branches of every (block, layer) cell twice; without, once."""
    for mode, factor in ((checkpoint, 2), ("none", 1)):
        calls = []
        model = tiny_model(block_size=5, schedule=schedule, activation_checkpoint=mode)
        branches = model.body.branches

        def counted(x, *args, **kwargs):
            calls.append(x.shape[0])  # the wave's cells
            return branches(x, *args, **kwargs)

        model.body = dataclasses.replace(model.body, branches=counted)
        loss = model(tokens(length=T), tokens(length=T, seed=2))
        cells = sum(calls)
        loss.backward()
        assert cells == 4 * len(model.layers)  # ceil(19 / 5) blocks, every layer
        assert sum(calls) == factor * cells


def test_finished_kvs_skipped_for_a_single_block() -> None:
    """With one block (c >= T) nobody reads finished KVs, so none are computed: e_K gets no grad."""
    model = tiny_model(block_size=T)
    model(tokens(length=T), tokens(length=T, seed=2)).backward()
    assert all(layer.attention.e_k.grad is None for layer in model.layers)
    model = tiny_model(block_size=4)
    model(tokens(length=T), tokens(length=T, seed=2)).backward()
    assert all(layer.attention.e_k.grad.abs().sum() > 0 for layer in model.layers)


def test_sequence_longer_than_max_seq_len_is_refused() -> None:
    model = build_model(tiny_config(max_seq_len=8))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(tokens(length=9))


@pytest.mark.parametrize("checkpoint,schedule", [("none", "block"), ("block", "block"),
                                                 ("none", "wavefront"), ("wave", "wavefront")])
def test_a_training_step_frees_its_history(checkpoint: str, schedule: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """After backward nothing holds the step's history (its buffers, the units' graphs): freed
    by reference counting once the loss is dropped, with no cycle left for the garbage collector
    (a cycle would keep every step's buffers alive until a collection)."""
    histories = []
    make = History.__init__

    def recorded(self, *args, **kwargs):
        make(self, *args, **kwargs)
        histories.append(weakref.ref(self))

    monkeypatch.setattr(History, "__init__", recorded)
    model = tiny_model(activation_checkpoint=checkpoint, schedule=schedule)
    x = tokens(length=T + 1)
    gc.disable()
    try:
        loss = model(x[:, :-1], x[:, 1:])
        assert len(histories) == 1 and histories[0]() is not None
        loss.backward()
        del loss
        assert histories[0]() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("schedule,checkpoint", [("block", "block"), ("wavefront", "none")])
def test_a_pass_between_a_forward_and_its_backward_does_not_touch_its_history(
        schedule: str, checkpoint: str) -> None:
    """Each pass has its own history: an evaluation forward and a second training forward on
    other tokens, while the first step's backward is pending, leave its gradients as they are
    without them."""
    model = tiny_model(schedule=schedule, activation_checkpoint=checkpoint)
    x, y, other = tokens(length=T), tokens(length=T, seed=2), tokens(length=T, seed=3)
    model(x, y).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss = model(x, y)
    with torch.no_grad():
        model(other)
    unused = model(other, y)
    loss.backward()
    del unused
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, want[n]), n


@pytest.mark.parametrize("schedule, checkpoint", [("block", "block"), ("block", "none"),
                                                  ("wavefront", "wave")])
def test_training_steps_leave_nothing_behind(schedule: str, checkpoint: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step's graph is freed with it: the history buffers each pass makes are gone once
    its step is over, and the weight stacks hold no rows between steps (a stack's kept rows
    tied to their graph once made each step's graph a cycle Python's collector could not free,
    the history's buffers in it)."""
    made: list[weakref.ref] = []
    empty = History.empty

    def recorded(*args, **kwargs) -> History:
        history = empty(*args, **kwargs)
        made.append(weakref.ref(history.keys))
        return history

    monkeypatch.setattr(History, "empty", staticmethod(recorded))
    model = tiny_model(torch.float32, attention="cpu", schedule=schedule,
                       activation_checkpoint=checkpoint, block_size=3)
    x, y = tokens(length=14), tokens(length=14, seed=2)
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        model(x, y).backward()
    gc.collect()
    assert len(made) == 3 and all(ref() is None for ref in made)
