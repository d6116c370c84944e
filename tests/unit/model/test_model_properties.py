"""Consequences of the spec that hold for any weights (spec §4.1, §4.2, §4.6)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from megabeta.model import build_model
from megabeta.model.beta12 import Beta12Transformer
from megabeta.model.history import BufferedHistory
from support.model_helpers import ATTENTION, VOCAB, tiny_config, tiny_model, tokens
from support.reference_attention import block_attention

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
    """`model(x, y)` (computed block by block) equals cross-entropy of `model(x)`; -100 is ignored.
    With `chunk`, the loss is taken in chunks of that many tokens, which cross sequences."""
    if chunk is not None:
        monkeypatch.setattr("megabeta.model.transformer.LOSS_CHUNK", chunk)
    model = tiny_model(arch=arch, block_size=4)
    x, y = tokens(length=T), tokens(length=T, seed=3)
    y[0, 2] = -100
    expected = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
    torch.testing.assert_close(model(x, y), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("arch,attention", [("beta12", a) for a in ATTENTION]
                         + [("standard", "auto"), ("looped", "auto")])
def test_block_checkpointing_keeps_loss_and_gradients(arch: str, attention: str) -> None:
    """Recomputing each block in backward reads the same history (spec §4.6)."""
    x, y = tokens(length=T), tokens(length=T, seed=2)
    runs = []
    for mode in ("none", "block"):
        model = tiny_model(arch=arch, block_size=4, attention=attention,
                           activation_checkpoint=mode)
        loss = model(x, y)
        loss.backward()
        runs.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                     if p.grad is not None}))
    (loss_a, grads_a), (loss_b, grads_b) = runs
    assert loss_a == loss_b
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 0
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=0, atol=1e-12, msg=name)


def test_checkpointing_recomputes_blocks_in_backward() -> None:
    """With block checkpointing, backward runs every block's layers again (T/c more calls)."""
    calls = {"n": 0}
    model = tiny_model(block_size=5, activation_checkpoint="block")
    branches = model.branches

    def counted(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls["n"] += 1
        return branches(*args, **kwargs)

    model.branches = counted
    loss = model(tokens(length=T), tokens(length=T, seed=2))
    forward_calls = calls["n"]
    loss.backward()
    assert forward_calls == 4 * len(model.layers)  # ceil(19 / 5) blocks, every layer
    assert calls["n"] == 2 * forward_calls


def test_finished_kvs_skipped_for_a_single_block() -> None:
    """With one block (c >= T) nobody reads finished KVs, so none are computed: e_K gets no grad."""
    model = tiny_model(block_size=T)
    model(tokens(length=T), tokens(length=T, seed=2)).backward()
    assert all(layer.attention.e_k.grad is None for layer in model.layers)
    model = tiny_model(block_size=4)
    model(tokens(length=T), tokens(length=T, seed=2)).backward()
    assert all(layer.attention.e_k.grad.abs().sum() > 0 for layer in model.layers)


@pytest.mark.parametrize("schedule", ["block", "wavefront"])
def test_the_last_blocks_finished_kvs_are_not_computed_on_the_block_schedule(
        schedule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nobody reads the last block's finished KVs: the block schedule's last block projects
    plainly (`Wave.finished`), so `last_finished` runs once per earlier block; the wavefront
    batches the last block's cells with earlier blocks' and computes them (unpublished)."""
    from megabeta.model.beta12 import PassWeights

    build, calls = PassWeights.__init__, []

    def counting(self, *args, **kwargs):
        build(self, *args, **kwargs)
        project = self.last_finished
        if project is not None:
            def last_finished(*parts):
                calls.append(parts[0].shape)
                return project(*parts)
            self.last_finished = last_finished

    monkeypatch.setattr(PassWeights, "__init__", counting)
    model = tiny_model(block_size=4, schedule=schedule)  # ceil(19 / 4) = 5 blocks
    model(tokens(length=T), tokens(length=T, seed=2)).backward()
    assert len(calls) == (4 if schedule == "block" else 5)
    assert all(layer.attention.e_k.grad.abs().sum() > 0 for layer in model.layers)


def test_sequence_longer_than_max_seq_len_is_refused() -> None:
    model = build_model(tiny_config(max_seq_len=8))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(tokens(length=9))


@pytest.mark.parametrize("checkpoint,schedule", [("none", "block"), ("block", "block"),
                                                 ("none", "wavefront"), ("wave", "wavefront")])
def test_a_training_step_frees_its_history(checkpoint: str, schedule: str, monkeypatch) -> None:
    """After backward the step's finished-KV buffers are back in the model's pool (held by
    nothing else, and lent to the next step again, so memory does not grow per step), and
    without checkpointing the whole history (graph included) is freed by reference counting
    once the loss is dropped, with no cycle left for the garbage collector: a cycle kept every
    step's buffers alive and grew memory by ~1 GB a step at the benchmark shape. (torch's
    non-reentrant checkpoint keeps its inputs in a cycle of its own, hence the buffers are
    handed back explicitly.)"""
    histories = []
    make = Beta12Transformer._history

    def recorded(self, length, **kwargs):
        history = make(self, length, **kwargs)
        histories.append(weakref.ref(history))
        return history

    monkeypatch.setattr(Beta12Transformer, "_history", recorded)
    model = tiny_model(activation_checkpoint=checkpoint, schedule=schedule)
    x = tokens(length=T + 1)
    gc.disable()
    try:
        loss = model(x[:, :-1], x[:, 1:])
        history = histories[0]()
        assert isinstance(history, BufferedHistory) and history.keys is not None
        # The buffers themselves: attention nodes hold views of them until their backward.
        buffers = [weakref.ref(history.keys), weakref.ref(history.values)]
        del history
        loss.backward()
        history = histories[0]()
        if history is not None:
            assert history.keys is None and history.values is None and history.grad_keys is None
        del history, loss
        pooled = model.history_pool._free

        def in_pool() -> bool:
            return {id(b()) for b in buffers} <= {id(t) for t in pooled.values()}

        assert in_pool()
        if checkpoint == "none":
            assert histories[0]() is None
        # The next step borrows the same buffers and gives them back; nothing else holds them.
        model(x[:, :-1], x[:, 1:]).backward()
        assert in_pool()
        pooled.clear()
        assert all(buffer() is None for buffer in buffers)
    finally:
        gc.enable()


@pytest.mark.parametrize("schedule,checkpoint", [("block", "block"), ("wavefront", "none")])
def test_a_pass_between_a_forward_and_its_backward_does_not_touch_its_history(
        schedule: str, checkpoint: str) -> None:
    """The pooled history buffers are lent to one pass at a time: an evaluation forward and
    a second training forward on other tokens, while the first step's backward is pending,
    leave its gradients as they are without them."""
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


def test_merged_attention_refuses_key_groups_it_cannot_differentiate() -> None:
    """Groups handed to the CPU merge without a gradient buffer (decoding's pieces) would get no
    gradient: under autograd that is an error, not a silently missing gradient."""
    from megabeta.model.attention import AttentionBias, GroupBatch
    from megabeta.model.attention.merged import CPU_FUSED, merged_attention

    q, k, v = (torch.randn(1, 2, 3, 4, dtype=torch.float64) for _ in range(3))
    group = torch.randn(1, 1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
    batch = GroupBatch(group, group, [1])
    bias = AttentionBias(self_bias=torch.zeros(1, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="gradient buffer"):
        merged_attention(q, k, v, [batch], bias, 0.5, kernels=CPU_FUSED)
    with torch.no_grad():
        out = merged_attention(q, k, v, [batch], bias, 0.5, kernels=CPU_FUSED)
    # Without autograd the same call is fine and exact: query i sees the group and keys 0 … i.
    want, _ = block_attention(q, k, v, group, group, torch.zeros(1, 2, dtype=torch.float64), None,
                              sources=[0], layer=0, start=5, window=0, scale=0.5)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
