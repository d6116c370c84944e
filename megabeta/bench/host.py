"""The GPU path's host work per (block, layer) cell, measured on this CPU with no kernel run.

    python -m megabeta.bench host                 # t19_flash's structure, bf16 autocast
    python -m megabeta.bench host --float32 --repeats 7

On a GPU a beta_1.2 step at small c is host-bound when Python issues every launch: each cell
runs a few dozen small kernels, and the Python, autograd and dispatch around each launch cost
more than the kernel. That cost does not need a GPU to measure: the model is built for the
Triton path (`attention = "triton"`, `elementwise_kernels = "triton"`) on the CPU, and every
Triton launch is counted and skipped (`ops.LaunchCount(run=False)`), so what is timed is the
host's work alone: Python, autograd, ATen dispatch and the small torch kernels (on a CPU those
run here, a few microseconds each at this width).

Per mode, a training step (forward, backward with block recomputation) at two lengths; host
time per cell = the difference over the extra cells (the once-per-step work cancels), median of
--repeats, one intra-op thread. Modes:

- eager: the block loop from Python;
- compiled (`execution.compile`): every block through one compiled graph (its first steps
  compile, untimed);
- graphed (`execution.cuda_graphs`): the whole pass two CUDA graphs, replayed once each per
  micro-step (model/graphs.py). On a CPU the stand-in capture runs the pass eagerly, so its
  host time is not measured here: the replays per micro-step at both lengths are counted (on a
  GPU a replay's host cost is assumed at about 10 us, plus its copies in and out: the roofline's
  GRAPH_REPLAY_S, not measured here).

Launches per micro-step (kernel-launching operators plus Triton launches, `bench dispatch`'s
`count_step`; compiled: the Triton launches alone, as a dispatch mode cannot watch a compiled
graph) are printed for the longer step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace
from typing import Any

import torch

# The model is built for the Triton path on the CPU, which needs Triton's interpreter mode
# (`@triton.jit` reads it when a kernel is defined, so before megabeta's kernels are imported);
# no kernel runs either way.
os.environ["TRITON_INTERPRET"] = "1"

from megabeta.bench.dispatch import count_step, counting_config  # noqa: E402
from megabeta.kernels import ops  # noqa: E402
from megabeta.model import ExecutionConfig, build_model  # noqa: E402
from megabeta.model.executor import Executor  # noqa: E402
from megabeta.model.graphs import EagerCapture  # noqa: E402

PROG = "megabeta bench host"
MODES = ("eager", "compiled", "graphed")


def _model(mode: str, block_size: int, blocks: int, capture: EagerCapture | None = None) -> Any:
    config = counting_config(block_size=block_size, max_seq_len=blocks * block_size)
    execution = ExecutionConfig(attention="triton", elementwise_kernels="triton",
                                activation_checkpoint="block", compile=mode == "compiled")
    torch.manual_seed(0)
    model = build_model(config, execution)
    if mode == "graphed":
        model.execution = replace(model.execution, cuda_graphs=True)
        model.executor = Executor(model.execution, backend=model.attention_backend,
                                  device=model.kernels_device, layers=config.num_layers,
                                  capture=capture)
    return model


def _step(model: Any, tokens: torch.Tensor, bf16: bool) -> None:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        model(tokens, tokens).backward()


def measure(mode: str, *, blocks: tuple[int, int] = (4, 12), block_size: int = 32,
            bf16: bool = True, repeats: int = 5, warmup: int = 2) -> dict[str, Any]:
    """Host seconds per cell (eager, compiled), launches per micro-step and, graphed, the
    replays per micro-step at both lengths."""
    capture = EagerCapture()
    model = _model(mode, block_size, blocks[1], capture)
    layers = model.config.num_layers
    inputs = [torch.randint(0, model.config.vocab_size, (1, n * block_size)) for n in blocks]
    result: dict[str, Any] = {"mode": mode}
    with ops.LaunchCount(run=False):
        if mode == "graphed":
            replays = []
            for tokens in inputs:
                before = capture.replays
                _step(model, tokens, bf16)
                replays.append(capture.replays - before)
            result["replays"] = dict(zip(blocks, replays))
            return result
        times: list[list[float]] = [[], []]
        for i, tokens in enumerate(inputs):
            for _ in range(warmup):
                _step(model, tokens, bf16)
        for _ in range(repeats):
            for i, tokens in enumerate(inputs):
                start = time.perf_counter()
                _step(model, tokens, bf16)
                times[i].append(time.perf_counter() - start)
    short, long = (statistics.median(t) for t in times)
    result["cell_s"] = (long - short) / ((blocks[1] - blocks[0]) * layers)
    result["step_s"] = long
    if mode == "compiled":
        # A dispatch mode cannot watch a compiled graph: its Triton launches are counted alone.
        with ops.LaunchCount(run=False) as count:
            _step(model, inputs[1], bf16)
        result["triton_launches"] = count.total
    else:
        result["launches"] = count_step(model, inputs[1], run_kernels=False, bf16=bf16).total
    result["cells"] = blocks[1] * layers
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated, of {', '.join(MODES)} (default: all)")
    parser.add_argument("--float32", action="store_true",
                        help="float32 throughout (default: bf16 autocast over float32 "
                             "parameters, as the trainer runs)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per length")
    parser.add_argument("--blocks", default="4,12",
                        help="the two step lengths in blocks of 32 tokens (default 4,12)")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    for mode in modes:
        if mode not in MODES:
            parser.error(f"argument --modes: unknown mode {mode!r}; choose from "
                         f"{', '.join(MODES)}")
    try:
        args.blocks = tuple(int(b) for b in args.blocks.split(","))
    except ValueError:
        parser.error(f"argument --blocks: {args.blocks!r} is not two integers 'A,B'")
    if len(args.blocks) != 2 or not 0 < args.blocks[0] < args.blocks[1]:
        parser.error(f"argument --blocks: need two lengths 0 < A < B, got {args.blocks}")
    if args.repeats < 1:
        parser.error("argument --repeats: must be >= 1")
    args.modes = modes
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    precision = "float32" if args.float32 else "bf16 autocast"
    print(f"{PROG}: t19_flash's structure at the counting width (bench dispatch), c = 32, "
          f"{precision}, Triton launches counted and not run, one thread; steps of "
          f"{args.blocks[0]} and {args.blocks[1]} blocks")
    try:
        for mode in args.modes:
            r = measure(mode, blocks=args.blocks, bf16=not args.float32, repeats=args.repeats)
            if mode == "graphed":
                counts = ", ".join(f"{n} blocks: {k}" for n, k in r["replays"].items())
                print(f"{mode:>9}: CUDA graph replays per micro-step {counts} (host time not "
                      "measured here: the CPU stand-in runs the pass eagerly)")
                continue
            if "launches" in r:
                launches = (f"{r['launches']} launches per micro-step of {r['cells']} cells "
                            f"({r['launches'] / r['cells']:.1f} a cell)")
            else:
                launches = (f"{r['triton_launches']} Triton launches per micro-step of "
                            f"{r['cells']} cells (the graphs' own kernels are Inductor's, for "
                            "this CPU)")
            print(f"{mode:>9}: {r['cell_s'] * 1e3:.2f} ms host time per cell; {launches}; "
                  f"step {r['step_s']:.3f} s")
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
