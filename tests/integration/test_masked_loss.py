"""The training step's loss over masked targets: the mean over every scored target of every
micro-batch of every rank, with that mean's gradients, whatever the world size and the
accumulation; against a hand computation in float64. Evaluation weighs by scored targets too,
and the trainer runs on masked, document-aligned data."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.corpus import tokenize, train_tiny_tokenizer
from support.masked_batches import (
    ATTENTION,
    SCORED,
    flat_gradients,
    global_samples,
    micro_batches,
    model_config,
)
from support.segments import segmented_documents, write_plain_jsonl, write_segments_jsonl
from support.dist_helpers import free_port, launcher_free_environ, read_reports
from megabeta.config import config_from_flat, load_config
from megabeta.data import GlobalSampler, build_train_val
from megabeta.engine.torch_engine import TorchEngine
from megabeta.infer.evaluate import evaluate
from megabeta.model import ConfigError
from megabeta.model.loss import IGNORE_INDEX
from megabeta.train.loop import Trainer, accumulate_step
from support.model_helpers import tiny_model
from support.train_helpers import TINY_CONFIG, TINY_OVERRIDES, train_records
from support import REPO

CPU = torch.device("cpu")
WORKER = REPO / "tests" / "support" / "masked_step_worker.py"


def hand_loss_and_gradients() -> tuple[float, torch.Tensor, float]:
    """(global mean over the scored targets of the four samples, its gradients, the mean of
    the two 2-sample micro-batch means a per-micro-batch average would give), by a log-softmax
    over the full float64 logits of each sample alone with its documents, the scored targets
    picked by hand from the masks."""
    model = tiny_model(attention=ATTENTION)
    terms = []
    for sample in global_samples():
        tokens = torch.from_numpy(sample.tokens)
        documents = torch.from_numpy(sample.documents)[None]
        logp = torch.log_softmax(model(tokens[None, :-1], documents=documents)[0], dim=-1)
        terms.append([-logp[t - 1, int(tokens[t])] for t in range(1, len(tokens))
                      if sample.mask[t]])
    every = [term for sample_terms in terms for term in sample_terms]
    assert len(every) == sum(SCORED)
    loss = torch.stack(every).sum() / len(every)
    loss.backward()
    loss = loss.detach()
    halves = [terms[0] + terms[1], terms[2] + terms[3]]
    per_micro = sum(float(torch.stack(h).detach().mean()) for h in halves) / 2
    return float(loss), flat_gradients(model), per_micro


@pytest.fixture(scope="module")
def hand():
    return hand_loss_and_gradients()


def step(groups: list[list[int]]) -> tuple[float, torch.Tensor]:
    """One single-process step over micro-batches of the given samples: (loss, gradients)."""
    engine = TorchEngine(tiny_model(attention=ATTENTION), config_from_flat(model_config()), CPU)
    loss = accumulate_step(engine, micro_batches(groups), CPU, 1)
    return loss, flat_gradients(engine.model)


def test_step_loss_and_gradients_equal_the_hand_computed_global_mean(hand):
    want_loss, want_grads, per_micro = hand
    loss, grads = step([[0, 1], [2, 3]])
    assert loss == pytest.approx(want_loss, rel=1e-12)
    torch.testing.assert_close(grads, want_grads, rtol=1e-10, atol=1e-12)
    # The check can fail: averaging the micro-batch means weighs the targets differently, by
    # far more than the tolerance.
    assert abs(per_micro - want_loss) > 1e-3


@pytest.mark.parametrize("groups", [[[0, 1, 2, 3]], [[0], [1], [2], [3]], [[2], [0, 3], [1]]])
def test_accumulation_changes_neither_loss_nor_gradients(groups, hand):
    want_loss, want_grads, _ = hand
    loss, grads = step(groups)
    assert loss == pytest.approx(want_loss, rel=1e-12)
    torch.testing.assert_close(grads, want_grads, rtol=1e-10, atol=1e-12)


def test_an_all_masked_micro_batch_counts_nothing_and_poisons_nothing(hand):
    """Sample 2 scores no target: alone in a micro-batch its mean is 0 (not 0/0) and the step is
    still the global mean."""
    assert SCORED[2] == 0
    want_loss, want_grads, _ = hand
    loss, grads = step([[2], [0, 1, 3]])
    assert math.isfinite(loss) and loss == pytest.approx(want_loss, rel=1e-12)
    torch.testing.assert_close(grads, want_grads, rtol=1e-10, atol=1e-12)


def test_world_size_changes_neither_loss_nor_gradients(hand, tmp_path):
    """2 ranks on gloo, one sample per micro-batch (each rank accumulates two), DDP and FSDP2:
    the loss and the reduced gradients are the single process's hand-computed ones."""
    want_loss, want_grads, _ = hand
    port = free_port()
    tests = str(REPO / "tests")
    procs = []
    for rank in range(2):
        env = launcher_free_environ(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                    MASTER_PORT=str(port))
        env["PYTHONPATH"] = f"{tests}:{env['PYTHONPATH']}"
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(tmp_path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    for proc in procs:
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, out[-3000:]
    reports = read_reports(tmp_path)
    assert [r["rank"] for r in reports] == [0, 1]
    for backend, rtol in (("ddp", 1e-10), ("fsdp", 1e-5)):  # FSDP computes in float32 here
        for report in reports:
            assert report[backend]["loss"] == pytest.approx(want_loss, rel=rtol)
            torch.testing.assert_close(torch.tensor(report[backend]["grads"],
                                                    dtype=torch.float64),
                                       want_grads, rtol=rtol, atol=rtol * 1e-2)


class _Recorder:
    """An engine that records the scales it is given and returns a fixed loss."""

    def __init__(self) -> None:
        self.scales: list[float] = []

    def forward_backward(self, inputs, targets, *, last, scale):
        self.scales.append(scale)
        return torch.tensor(2.5)


@pytest.mark.parametrize("accumulation", [1, 3, 7])
def test_unmasked_micro_batches_keep_the_weights_of_a_plain_mean(accumulation):
    """Plain batches (no masks): every weight is exactly 1/A, the old per-micro-batch mean's,
    so unmasked training is unchanged; and no collective is needed to count."""
    batches = [torch.zeros(2, 9, dtype=torch.int64) for _ in range(accumulation)]
    for world_size in (1, 4):  # 4: as one of 4 ranks (no group here, so the loss is not summed)
        engine = _Recorder()
        accumulate_step(engine, batches, CPU, world_size=world_size)
        assert engine.scales == [1.0 / accumulation] * accumulation
    assert accumulate_step(_Recorder(), batches, CPU, world_size=1) == 2.5


@pytest.fixture(scope="module")
def masked_prefix(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("masked_run")
    docs = segmented_documents(240, seed=4)
    model = train_tiny_tokenizer(root, [write_plain_jsonl(root / "plain.jsonl", docs)],
                                 vocab_size=400)
    source = write_segments_jsonl(root / "seg.jsonl", docs)
    assert tokenize(model, [source], root / "seg", "--segments-key", "segments") == 0
    return root / "seg", model


def test_evaluation_is_weighted_by_scored_targets(masked_prefix):
    """Document-aligned, masked validation data: the evaluated loss is the mean over all scored
    targets (hand: per-token log-softmax), the same for any batch size."""
    prefix, _ = masked_prefix
    data = build_train_val([prefix], seq_len=20, val_fraction=0.1, align="document")
    model = tiny_model(vocab_size=400, max_seq_len=32, attention=ATTENTION)
    model.eval()
    terms = []
    with torch.no_grad():
        for index in range(len(data.val)):
            sample = data.val[index]
            tokens = torch.from_numpy(sample.tokens)
            logp = torch.log_softmax(model(tokens[None, :-1])[0], dim=-1)
            terms += [-float(logp[t - 1, int(tokens[t])]) for t in range(1, len(tokens))
                      if sample.mask[t]]
    want = sum(terms) / len(terms)
    for batch_size in (1, 3, 8):
        result = evaluate(model, data.val, GlobalSampler(len(data.val), shuffle=False,
                                                         num_epochs=1), batch_size=batch_size)
        assert result["loss"] == pytest.approx(want, rel=1e-12)
        assert result["scored_targets"] == len(terms) and result["samples"] == len(data.val)


def test_trainer_trains_on_masked_document_aligned_data(masked_prefix, tmp_path):
    prefix, tokenizer = masked_prefix
    config = load_config(TINY_CONFIG, [*TINY_OVERRIDES, f"--data.path={prefix}",
                                       f"--data.tokenizer={tokenizer}", f"--run_dir={tmp_path}",
                                       "--data.align=document", "--train.steps=3",
                                       f"--execution.attention={ATTENTION}",
                                       "--checkpoint.interval=0", "--logging.tensorboard=false",
                                       "--checkpoint.save_at_end=false"])
    trainer = Trainer(config)
    assert trainer.data.train.has_loss_mask
    seen = []
    clean = trainer.engine.forward_backward

    def forward_backward(inputs, targets, **kwargs):
        seen.append((int((targets != IGNORE_INDEX).sum()), targets.numel(), kwargs["scale"]))
        return clean(inputs, targets, **kwargs)

    trainer.engine.forward_backward = forward_backward
    last = trainer.train()
    records = train_records(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in records) and math.isfinite(last["eval_loss"])
    assert all(scored < numel for scored, numel, _ in seen)  # padding and prompts are masked
    # Two micro-batches a step, weighted by their scored targets (a step with none: weights 0,
    # not 0/0).
    assert sum(scored for scored, _, _ in seen) > 0
    for first, second in zip(seen[::2], seen[1::2]):
        total = max(first[0] + second[0], 1)
        assert (first[2], second[2]) == (first[0] / total, second[0] / total)
    with pytest.raises(ConfigError, match="data.align = 'lines': must be packed, block or document"):
        load_config(TINY_CONFIG, [*TINY_OVERRIDES, "--data.align=lines"]).validate()
