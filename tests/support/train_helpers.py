"""A tiny dataset and a way to launch `megabeta train` (1 process or torchrun) for the tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from support.corpus import documents, tokenize, train_tiny_tokenizer, write_jsonl
from support import REPO

if TYPE_CHECKING:
    from megabeta.train.loop import Trainer


# A 2-layer beta_1.2 of width 32: a step takes milliseconds, so the tests time the framework.
TINY_CONFIG = REPO / "configs" / "tiny_cpu.toml"
TINY_OVERRIDES = [
    "--model.d_model=32", "--model.hidden_dim=64", "--model.num_heads=2", "--model.block_size=8",
    "--data.seq_len=32", "--data.val_fraction=0.1", "--data.num_workers=0",
    "--train.steps=6", "--train.global_batch=4", "--train.micro_batch=2",
    "--schedule.warmup_steps=2", "--logging.interval=1", "--checkpoint.interval=3",
    "--eval.interval=0", "--eval.batches=2",
]
TINY = [f"--config={TINY_CONFIG}", *TINY_OVERRIDES]


def build_dataset(directory: Path) -> tuple[Path, Path]:
    """(dataset prefix, tokenizer .model) of a small generated corpus."""
    corpus = write_jsonl(directory / "corpus.jsonl", documents(600, seed=3))
    model = train_tiny_tokenizer(directory, [corpus], vocab_size=300)
    prefix = directory / "corpus"
    assert tokenize(model, [corpus], prefix) == 0
    return prefix, model


def launch(args: list[str], nproc: int = 1, timeout: float = 240,
           check: bool = True) -> subprocess.CompletedProcess:
    """Run `megabeta train` with `args` on `nproc` ranks (torchrun when > 1)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if nproc == 1:
        cmd = [sys.executable, "-m", "megabeta.train", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", "-m", "megabeta.train", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=REPO)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {done.returncode}:\n"
                             f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return done


def train_records(run_dir: Path) -> list[dict]:
    """The training lines of metrics.jsonl (evaluation lines have a `split`)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "split" not in r]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in train_records(run_dir)}


def snapshot_steps(trainer: Trainer) -> list[list[torch.Tensor]]:
    """The parameters after every step (filled in as the trainer runs)."""
    snapshots: list[list[torch.Tensor]] = []
    clean_step = trainer.engine.step

    def step(*args, **kwargs):
        result = clean_step(*args, **kwargs)
        snapshots.append([p.detach().clone() for p in trainer.engine.model.parameters()])
        return result

    trainer.engine.step = step
    return snapshots
