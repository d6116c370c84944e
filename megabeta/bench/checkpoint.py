"""What durability costs a checkpoint save: the real commit path with and without fsync.

    python -m megabeta.bench checkpoint [--config t19_flash] [--rounds 3]

Builds the model of `--config` with AdamW state (one optimizer step on zero gradients: no forward
needed), then saves it through `CheckpointManager.save` (DCP shards, RNG, train state, rename,
`latest`) alternately as shipped and with `os.fsync` made a no-op (the baseline: what the save
costs without durability), `--rounds` times each, and prints the medians. The figure depends on
the disk and on how much dirty data the page cache holds: measure on the cluster's file system.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from megabeta.checkpoint.manager import CheckpointManager, TrainState
from megabeta.config import load_config
from megabeta.engine.torch_engine import TorchEngine
from megabeta.model import build_model


def _engine(config_name: str, vocab: int) -> TorchEngine:
    config = load_config(config_name, ["--parallel.backend=single", "--execution.compile=false",
                                       f"--model.vocab_size={vocab}"])
    engine = TorchEngine(build_model(config.model, config.execution), config, torch.device("cpu"))
    for p in engine.model.parameters():
        p.grad = torch.zeros_like(p)
    engine.optimizer.step()  # AdamW's moments exist now, as in any checkpoint after step 1
    return engine


def _timed_save(engine: TorchEngine, run_dir: Path, step: int) -> float:
    manager = CheckpointManager(run_dir, keep=1)
    start = time.perf_counter()
    manager.save(step, TrainState(step=step), engine.save)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="megabeta bench checkpoint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="t19_flash",
                        help="model to save: a shipped config name or a TOML file (default "
                             "t19_flash)")
    parser.add_argument("--vocab", type=int, default=55000,
                        help="vocabulary size (the configs take it from the data; default 55000, "
                             "t19_flash's tokenizer)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="saves with and without fsync, alternating (default 3)")
    parser.add_argument("--dir", help="where to write (default: a temporary directory; the "
                                      "file system under test)")
    args = parser.parse_args(argv)
    engine = _engine(args.config, args.vocab)
    work = Path(tempfile.mkdtemp(prefix="megabeta-bench-ckpt-", dir=args.dir))
    synced, unsynced = [], []
    try:
        for r in range(args.rounds):
            for label, times in (("fsync", synced), ("none", unsynced))[::1 if r % 2 else -1]:
                run_dir = work / f"{label}-{r}"
                if label == "none":
                    with mock.patch("os.fsync", lambda fd: None):
                        times.append(_timed_save(engine, run_dir, r + 1))
                else:
                    times.append(_timed_save(engine, run_dir, r + 1))
                size = sum(f.stat().st_size for f in run_dir.rglob("*") if f.is_file())
                shutil.rmtree(run_dir)
                os.sync()  # the next save starts with no dirty pages of this one
    finally:
        shutil.rmtree(work, ignore_errors=True)
    with_sync, without = statistics.median(synced), statistics.median(unsynced)
    print(f"# checkpoint save, {args.config}: {size / 2**20:.0f} MiB (model + AdamW state, "
          f"DCP), {args.rounds} rounds alternating, medians")
    print("| save | s | MiB/s |\n|---|---|---|")
    for label, seconds in (("without fsync (baseline)", without), ("durable (fsync)", with_sync)):
        print(f"| {label} | {seconds:.2f} | {size / 2**20 / seconds:.0f} |")
    print(f"\nfsync adds {with_sync - without:.2f} s per save ({with_sync / without:.2f}x)")


if __name__ == "__main__":
    main()
