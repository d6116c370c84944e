"""The beta_1.2 block step eager, compiled once (`execution.compile`) and, on CUDA, replayed
from CUDA graphs (`execution.cuda_graphs`), paired in one process.

    python -m megabeta.bench step                 # or: megabeta bench step

One model per mode, the same weights and tokens; the modes take turns, round after round, and
each reports its median s/step (forward+backward, block checkpointing) over rounds, with the
first step (compilation, capture) shown apart, the number of graphs it took (compiled graphs,
CUDA graphs captured) and its loss next to eager's.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Callable

import torch
import torch._dynamo

from megabeta.bench.gpu import count_graph_captures
from megabeta.model import DecoderLM, ExecutionConfig, build_model, get_preset
from megabeta.model.flops import training_flops
from megabeta.parallel.wrap import apply_compile


def _model(args: argparse.Namespace, device: torch.device, mode: str) -> DecoderLM:
    config = get_preset(args.preset, vocab_size=args.vocab, max_seq_len=args.seq_len)
    execution = ExecutionConfig(attention=args.attention, activation_checkpoint="block",
                                cuda_graphs=mode == "graphed")
    torch.manual_seed(0)
    model = build_model(config, execution).to(device)
    if mode == "compiled":
        apply_compile(model)
    return model


def _step(model: DecoderLM, tokens: torch.Tensor, bf16: bool) -> Callable[[], float]:
    def step() -> float:
        model.zero_grad(set_to_none=True)
        context = (torch.autocast(tokens.device.type, dtype=torch.bfloat16) if bf16
                   else contextlib.nullcontext())
        with context:
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        if tokens.is_cuda:
            torch.cuda.synchronize()
        return loss.item()
    return step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="megabeta bench step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="beta_1.2_test", help="model preset (%(default)s)")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
    parser.add_argument("--batch", type=int, default=8, help="batch (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (median)")
    parser.add_argument("--attention", default="auto",
                        help="execution.attention (auto: cpu_fused on CPU, triton on CUDA)")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (the GPU setting)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    modes = ["eager", "compiled"] + (["graphed"] if device.type == "cuda" else [])
    config = get_preset(args.preset, vocab_size=args.vocab, max_seq_len=args.seq_len)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(1)).to(device)
    steps, first, graphs, losses = {}, {}, {}, {}
    torch._dynamo.reset()
    for mode in modes:
        model = _model(args, device, mode)
        steps[mode] = _step(model, tokens, args.bf16)
        torch._dynamo.utils.counters.clear()
        captures = count_graph_captures() if device.type == "cuda" else contextlib.nullcontext([0])
        with captures as count:
            begin = time.perf_counter()
            losses[mode] = steps[mode]()
            first[mode] = time.perf_counter() - begin
            steps[mode]()  # a second untimed step: allocator and caches settled
        graphs[mode] = (torch._dynamo.utils.counters["stats"]["unique_graphs"]
                        if mode == "compiled" else count[0])
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode in modes:
            begin = time.perf_counter()
            steps[mode]()
            times[mode].append(time.perf_counter() - begin)
    flops = args.batch * training_flops(config, args.seq_len)
    eager = statistics.median(times["eager"])
    print(f"## {args.preset}, batch {args.batch} x {args.seq_len} tokens, c = "
          f"{config.block_size}, {device}, {'bf16 autocast' if args.bf16 else 'fp32'}, "
          f"block checkpointing (median of {args.rounds} rounds, modes in turn)")
    print("| mode | s/step | vs eager | GFLOP/s | first step s | graphs | loss |")
    print("|---|---|---|---|---|---|---|")
    for mode in modes:
        seconds = statistics.median(times[mode])
        print(f"| {mode} | {seconds:.3f} | {seconds / eager:.2f}x | {flops / seconds / 1e9:.1f} "
              f"| {first[mode]:.1f} | {graphs[mode] if mode != 'eager' else '-'} "
              f"| {losses[mode]:.6f} |")


if __name__ == "__main__":
    main()
