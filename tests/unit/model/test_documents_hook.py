"""The data.document_mask hook (megabeta/model/documents.py): a run whose model cannot take
`documents=` is refused at start-up; a model that can gets each batch's ids, in training and in
evaluation, and a batch without ids calls the model exactly as before."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from data_tools.writer import IndexedDatasetWriter
from megabeta.config import load_config
from megabeta.data import GlobalSampler, MaskedBatch, build_train_val
from megabeta.infer.evaluate import evaluate
from megabeta.model import ConfigError, ExecutionConfig, build_model
from megabeta.model.documents import require_document_mask_support, takes_documents
from megabeta.train import loop
from megabeta.train.loop import Trainer, accumulate_step
from support.model_helpers import tiny_config
from support.train_helpers import TINY


class Recorder(nn.Module):
    """A stand-in model that takes `documents=` and records what it was called with."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(()))
        self.calls: list[Tensor | None] = []

    def forward(self, tokens: Tensor, targets: Tensor, documents: Tensor | None = None) -> Tensor:
        self.calls.append(documents)
        return self.weight + tokens.float().mean() * 0


class RecordingEngine:
    """The part of an Engine that accumulate_step uses."""

    def __init__(self) -> None:
        self.documents: list[Tensor | None] = []

    def forward_backward(self, inputs, targets, *, last, scale, documents=None) -> Tensor:
        self.documents.append(documents)
        return torch.zeros(())


# The spec's softmax written out: these tests need no JIT-built CPU kernel.
EXPLICIT = "--execution.attention=reference"


class Plain(nn.Module):
    """A stand-in model without document masking."""

    def forward(self, tokens: Tensor, targets: Tensor | None = None) -> Tensor:
        return tokens.float().mean()


def test_a_model_without_documents_is_refused():
    with pytest.raises(ConfigError, match=r"data\.document_mask = true needs a model that takes "
                                          r"documents="):
        require_document_mask_support(Plain())
    require_document_mask_support(Recorder())


@pytest.mark.parametrize("arch", ["beta12", "standard", "looped"])
def test_every_arm_takes_documents(arch):
    model = build_model(tiny_config(arch=arch), ExecutionConfig(attention="reference"))
    assert takes_documents(model)
    require_document_mask_support(model)


def test_training_hands_each_batch_its_ids_and_plain_batches_none():
    ids = torch.tensor([[0, 0, 1, 1], [0, 1, 2, 2]], dtype=torch.int32)
    tokens = torch.arange(8).reshape(2, 4)
    engine = RecordingEngine()
    accumulate_step(engine, [MaskedBatch(tokens, tokens, ids), MaskedBatch(tokens, tokens)],
                    torch.device("cpu"), world_size=1)
    accumulate_step(engine, [torch.arange(10).reshape(2, 5)], torch.device("cpu"), world_size=1)
    assert torch.equal(engine.documents[0], ids)
    assert engine.documents[1:] == [None, None]


def write_dataset(prefix: Path) -> Path:
    lengths = np.random.default_rng(0).integers(2, 40, 200)
    tokens = np.random.default_rng(1).integers(4, 100, int(lengths.sum())).astype(np.uint16)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        writer.add_documents(tokens, lengths)
        writer.commit({"tokenizer": {"vocab_size": 100, "eos_id": 2, "pad_id": 0}})
    return prefix


def test_evaluation_passes_the_ids_of_block_aligned_samples(tmp_path):
    data = build_train_val([write_dataset(tmp_path / "d")], seq_len=32, val_fraction=0.2,
                           align="block", document_mask=True, block_size=8)
    model = Recorder()
    evaluate(model, data.val, GlobalSampler(len(data.val), shuffle=False, num_epochs=1),
             batch_size=2, max_batches=2)
    assert len(model.calls) == 2
    for call, first in zip(model.calls, (0, 2)):
        expected = np.stack([data.val[first].documents, data.val[first + 1].documents])
        np.testing.assert_array_equal(call.numpy(), expected)


def test_a_run_with_the_mask_and_a_model_without_it_stops_at_start_up(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(loop, "build_model", lambda config, execution: Plain())
    config = load_config(TINY[0].split("=", 1)[1], [
        *TINY[1:], f"--data.path={write_dataset(tmp_path / 'd')}", "--data.align=block",
        "--data.document_mask=true", f"--run_dir={tmp_path / 'run'}", EXPLICIT])
    with pytest.raises(ConfigError, match="documents="):
        Trainer(config)
    assert not (tmp_path / "run").exists()


def test_a_block_aligned_run_hands_ids_to_every_forward(tmp_path, monkeypatch, one_torch_thread):
    """Two steps and an evaluation of a model that takes documents= (the tiny model, its forward
    wrapped to record the ids): every training and evaluation forward gets a batch's ids."""
    calls: list[Tensor] = []

    def build(config, execution):
        model = loop_build_model(config, execution)
        plain = model.forward

        def forward(tokens: Tensor, targets: Tensor | None = None,
                    documents: Tensor | None = None) -> Tensor:
            calls.append(documents)
            return plain(tokens, targets, documents)

        model.forward = forward
        return model

    loop_build_model = loop.build_model
    monkeypatch.setattr(loop, "build_model", build)
    config = load_config(TINY[0].split("=", 1)[1], [
        *TINY[1:], f"--data.path={write_dataset(tmp_path / 'd')}", "--data.align=block",
        "--data.document_mask=true", f"--run_dir={tmp_path / 'run'}", "--train.steps=2",
        "--checkpoint.interval=0", "--checkpoint.save_at_end=false", "--eval.batches=1",
        "--monitor.beta_dials=false", EXPLICIT])
    Trainer(config).train()
    assert len(calls) == 2 * 2 + 1  # 2 steps of 2 micro-batches, 1 evaluation batch
    for ids in calls:
        assert ids.dtype == torch.int32 and ids.shape == (2, 32)
        assert (ids[:, 0] == 0).all() and (ids.diff(dim=1) >= 0).all()
