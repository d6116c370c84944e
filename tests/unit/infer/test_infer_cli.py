"""`megabeta eval` cuts the samples as the run did (data.align, data.document_mask) and hands the
model their document ids; a model that cannot take them is refused, not evaluated unmasked."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from data_tools.writer import IndexedDatasetWriter
from megabeta.checkpoint.export import ModelSource
from megabeta.data import build_train_val
from megabeta.infer import cli
from support.model_helpers import tiny_config

SEQ, BLOCK = 32, 8


class Recorder(nn.Module):
    def __init__(self, takes_documents: bool) -> None:
        super().__init__()
        self.config = tiny_config(vocab_size=100, block_size=BLOCK)
        self.calls: list[Tensor] = []
        if not takes_documents:
            self.forward = lambda tokens, targets=None: tokens.float().mean() * 0

    def forward(self, tokens: Tensor, targets: Tensor, documents: Tensor | None = None) -> Tensor:
        self.calls.append(documents)
        return tokens.float().mean() * 0


def run_eval(tmp_path: Path, monkeypatch, model: Recorder) -> tuple[int, Path]:
    lengths = np.random.default_rng(0).integers(2, 40, 100)
    tokens = np.random.default_rng(1).integers(4, 100, int(lengths.sum())).astype(np.uint16)
    with IndexedDatasetWriter(tmp_path / "d", np.uint16) as writer:
        writer.add_documents(tokens, lengths)
        writer.commit({"tokenizer": {"vocab_size": 100, "eos_id": 2, "pad_id": 0}})
    run = {"path": [str(tmp_path / "d")], "seq_len": SEQ, "val_fraction": 0.2, "align": "block",
           "document_mask": True}
    source = ModelSource(Path("m.safetensors"), model.config, data=run, settings_from="the test")
    monkeypatch.setattr(cli, "read_source", lambda path: source)
    monkeypatch.setattr(cli, "load_model", lambda path, device: model)
    return cli.eval_main(["--checkpoint=m.safetensors", "--batch-size=2", "--batches=2",
                          "--device=cpu"]), tmp_path / "d"


def test_eval_hands_the_model_the_runs_document_ids(tmp_path, monkeypatch):
    model = Recorder(takes_documents=True)
    status, prefix = run_eval(tmp_path, monkeypatch, model)
    assert status == 0 and len(model.calls) == 2
    val = build_train_val([prefix], seq_len=SEQ, val_fraction=0.2, align="block",
                          document_mask=True, block_size=BLOCK).val
    expected = np.stack([val[i].documents for i in range(4)])
    np.testing.assert_array_equal(torch.cat(model.calls).numpy(), expected)


def test_eval_refuses_a_model_without_documents(tmp_path, monkeypatch, capsys):
    status, _ = run_eval(tmp_path, monkeypatch, Recorder(takes_documents=False))
    assert status == 2
    error = capsys.readouterr().err
    assert "data.document_mask = true needs a model that takes documents=" in error
