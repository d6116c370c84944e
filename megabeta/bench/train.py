"""Training-framework benchmark: tokens/s and MFU per backend, framework overhead, checkpoint I/O.

    python -m megabeta.bench train            # or: megabeta bench train

For a tiny model and a beta_1.2_test-sized one (the ~10 M-parameter arm at a reduced context),
runs `megabeta train` under single, DDP, FSDP2 and DeepSpeed ZeRO-1/ZeRO-3 (2 CPU ranks for the
distributed ones), and a plain single-process loop over the same model, batch and optimizer
(the baseline: what the framework adds is measured against it). Step times are medians after
warm-up steps. The plain loop and the single-process run alternate for `--rounds` rounds and
each takes the median of its rounds: the machine's speed drifts over minutes, and the overhead
sought is a few percent. Checkpoint save and load times are measured on the single-process
run's state.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from megabeta.config import TrainConfig, load_config
from megabeta.data import StatefulLoader, TrainValData, build_train_val
from megabeta.engine.optim import build_optimizer
from megabeta.model import build_model

REPO = Path(__file__).resolve().parents[2]
SHAPES = {
    "tiny": ["--model.d_model=64", "--model.hidden_dim=192", "--model.num_heads=4",
             "--model.num_layers=2", "--model.block_size=16"],
    # The preset's shape, spelled out: keys in the config file would override a preset.
    "beta_1.2_test": ["--model.d_model=192", "--model.hidden_dim=512", "--model.num_heads=3",
                      "--model.num_layers=20", "--model.block_size=32", "--model.depth_window=2",
                      "--execution.activation_checkpoint=block"],
}
BACKENDS = [("single", 1, []), ("ddp", 2, []), ("fsdp", 2, []),
            ("deepspeed", 2, ["--parallel.zero_stage=1"]),
            ("deepspeed", 2, ["--parallel.zero_stage=3"])]


def _median_step(run_dir: Path, warmup: int) -> tuple[float, float, float]:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "split" not in r][warmup:]
    return (statistics.median(r["s_per_batch"] for r in steps),
            statistics.median(r["tokens_per_s"] for r in steps),
            statistics.median(r["mfu"] for r in steps))


def _common(data: Path, shape: str, steps: int, seq_len: int) -> list[str]:
    return [f"--config={REPO / 'configs' / 'tiny_cpu.toml'}", *SHAPES[shape],
            f"--data.path={data}", f"--data.seq_len={seq_len}", f"--model.max_seq_len={seq_len}",
            f"--train.steps={steps}",
            "--train.global_batch=8", "--train.micro_batch=4", "--checkpoint.interval=0",
            "--checkpoint.save_at_end=false", "--eval.interval=0", "--data.val_fraction=0",
            "--logging.interval=1", "--logging.tensorboard=false", "--data.num_workers=0"]


def _config_and_data(args: list[str]) -> tuple[TrainConfig, TrainValData]:
    """The run config of `args` (its --config first) and its data, vocab resolved."""
    config = load_config(args[0].split("=", 1)[1], args[1:])
    data = build_train_val(config.data.path, None, config.data.seq_len, 0.0)
    config.model = config.model.replace(vocab_size=data.vocab_size)
    return config, data


def plain_loop(args: list[str], steps: int, warmup: int) -> float:
    """Median seconds per step of a bare loop: same model, data, batch, AdamW, clipping."""
    config, data = _config_and_data(args)
    torch.manual_seed(config.train.seed)
    model = build_model(config.model, config.execution)
    optimizer = build_optimizer(model, config.optim)
    batches = iter(StatefulLoader(data.train, data.train_sampler(1, 0, config.train.seed),
                                  config.train.micro_batch))
    accumulation = config.train.global_batch // config.train.micro_batch
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        for _ in range(accumulation):
            batch = next(batches)
            (model(batch[:, :-1], batch[:, 1:]) / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:])


def checkpoint_io(args: list[str], workdir: Path) -> tuple[float, float, float]:
    """(save s, load s, MiB) of the single backend's DCP checkpoint of this model."""
    from megabeta.engine.torch_engine import TorchEngine

    config, data = _config_and_data(args)
    backend = TorchEngine(build_model(config.model, config.execution), config,
                          torch.device("cpu"))
    batch = next(iter(StatefulLoader(data.train, data.train_sampler(1, 0, 0), 2)))
    backend.forward_backward(batch[:, :-1], batch[:, 1:], last=True, scale=1.0)
    backend.step(True)  # optimizer state exists now
    path = workdir / "ckpt"
    start = time.perf_counter()
    backend.save(path)
    saved = time.perf_counter() - start
    start = time.perf_counter()
    backend.load(path)
    loaded = time.perf_counter() - start
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20
    return saved, loaded, size


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="megabeta bench train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="dataset prefix (default: build one from the stdlib "
                                       "sources like make demo)")
    parser.add_argument("--shapes", default="tiny,beta_1.2_test")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the median")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating rounds of the plain loop and the single backend")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="megabeta-bench-train-"))
    data = Path(args.data) if args.data else None
    if data is None:
        subprocess.run([sys.executable, "-m", "megabeta.demo", "--quick",
                        f"--workdir={work / 'demo'}"], check=True, capture_output=True)
        data = work / "demo" / "data" / "stdlib"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    print(f"# training benchmark, {os.cpu_count()} CPUs, torch {torch.__version__}; "
          f"global batch 8 x {args.seq_len} tokens, median of steps {args.warmup + 1}-{args.steps}")
    for shape in args.shapes.split(","):
        common = _common(data, shape, args.steps, args.seq_len)

        def run(backend: str, nproc: int, extra: list[str], tag: str) -> tuple | str:
            """(s/step, tokens/s, MFU) of `megabeta train`, or the error's last line."""
            run_dir = work / f"{shape}-{backend}-{'-'.join(extra) or 'x'}-{tag}"
            cmd = ([sys.executable, "-m", "megabeta.train"] if nproc == 1 else
                   [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc_per_node={nproc}", "-m", "megabeta.train"])
            done = subprocess.run([*cmd, *common, f"--parallel.backend={backend}", *extra,
                                   f"--run_dir={run_dir}"], capture_output=True, text=True,
                                  env=env if nproc > 1 else None, cwd=REPO)
            if done.returncode != 0:
                return done.stderr.strip().splitlines()[-1]
            return _median_step(run_dir, args.warmup)

        plains, singles = [], []
        for r in range(args.rounds):
            plains.append(plain_loop(common, args.steps, args.warmup))
            singles.append(run("single", 1, [], f"round{r}"))
        plain = statistics.median(plains)
        print(f"\n## {shape}\n| run | ranks | s/step | vs plain loop | tokens/s | MFU |")
        print("|---|---|---|---|---|---|")
        print(f"| plain loop (baseline, median of {args.rounds}) | 1 | {plain:.3f} | 1.00x | "
              f"{8 * args.seq_len / plain:.0f} | |")
        for backend, nproc, extra in BACKENDS:
            label = backend + (f" ZeRO-{extra[0][-1]}" if extra else "")
            if backend == "single":
                failed = [x for x in singles if isinstance(x, str)]
                result = failed[0] if failed else tuple(
                    statistics.median(x[i] for x in singles) for i in range(3))
                label += f" (median of {args.rounds})"
            else:
                result = run(backend, nproc, extra, "x")
            if isinstance(result, str):
                print(f"| {label} | {nproc} | failed: {result} | | | |")
                continue
            seconds, tokens, mfu = result
            print(f"| {label} | {nproc} | {seconds:.3f} | {seconds / plain:.2f}x | {tokens:.0f} "
                  f"| {100 * mfu:.2f}% |")
        saved, loaded, size = checkpoint_io(common, work)
        print(f"\ncheckpoint (single, DCP, model + AdamW state, {size:.1f} MiB): "
              f"save {saved:.2f} s, load {loaded:.2f} s")


if __name__ == "__main__":
    main()
