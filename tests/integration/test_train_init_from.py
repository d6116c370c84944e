"""Issue 45, item 5: a model from a Hugging Face folder continues pretraining
(`megabeta train --model.init_from=DIR`): the run takes the folder's shape and weights (a fresh
optimizer, step 0), and its sharded DCP checkpoint exports to a folder again. A folder whose
model was trained with another tokenizer than the run's data, or a run that changes the shape,
is refused with one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("tokenizers")

from support.corpus import documents, train_tiny_tokenizer, write_jsonl
from support.hf_helpers import export_folder
from support.model_helpers import tiny_model
from support.train_helpers import launch

from megabeta.cli import main
from megabeta.config import load_config
from megabeta.hf.folder import read_weights

SHAPE = dict(vocab_size=300, d_model=32, hidden_dim=64, num_heads=2, num_layers=2, block_size=8,
             depth_window=1, max_seq_len=64)
RUN = ["--data.seq_len=32", "--data.num_workers=0", "--data.val_fraction=0.1",
       "--train.global_batch=2", "--train.micro_batch=2", "--monitor.probe_batch=1",
       "--eval.batches=1", "--logging.tensorboard=false"]


@pytest.fixture(scope="module")
def folder(tiny_data, tmp_path_factory) -> Path:
    return export_folder(tiny_model(torch.float32, **SHAPE), tiny_data[1],
                         tmp_path_factory.mktemp("init_from"))


def test_a_run_starts_from_the_folders_weights_and_exports_back(folder, tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    # A learning rate far below float32's resolution: after one step the weights are the
    # folder's, bit for bit, so the run must have started from them.
    launch([f"--data.path={tiny_data[0]}", f"--run_dir={run_dir}",
            f"--model.init_from={folder}", "--train.steps=1", "--optim.lr=1e-30",
            "--optim.weight_decay=0", "--schedule.warmup_steps=0", *RUN])
    saved = load_config(run_dir / "config.toml")
    assert saved.model.init_from == str(folder) and saved.model.d_model == 32
    again = tmp_path / "again"
    assert main(["export", "--format", "hf", "--checkpoint",
                 str(run_dir / "checkpoints" / "step_00000001"), "--output", str(again)]) == 0
    want, got = read_weights(folder), read_weights(again)
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert (again / "tokenizer.model").read_bytes() == Path(tiny_data[1]).read_bytes()


def test_a_folder_of_another_tokenizer_or_another_shape_is_refused(folder, tiny_data, tmp_path):
    corpus = write_jsonl(tmp_path / "other.jsonl", documents(120, seed=7))
    other_tokenizer = train_tiny_tokenizer(tmp_path, [corpus], vocab_size=300, seed=1)
    other = export_folder(tiny_model(torch.float32, **SHAPE), other_tokenizer, tmp_path / "o")
    done = launch([f"--data.path={tiny_data[0]}", f"--run_dir={tmp_path / 'r1'}",
                   f"--model.init_from={other}", "--train.steps=1", *RUN], check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "trained with another tokenizer" in errors[0]
    done = launch([f"--data.path={tiny_data[0]}", f"--run_dir={tmp_path / 'r2'}",
                   f"--model.init_from={folder}", "--model.num_layers=4", "--train.steps=1",
                   *RUN], check=False)
    assert done.returncode == 2
    assert "model.num_layers = 4, but the model in model.init_from" in done.stderr
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()
