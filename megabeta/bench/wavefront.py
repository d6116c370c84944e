"""The wavefront schedule against the block schedule and the standard arm, paired in one process.

    python -m megabeta.bench wavefront          # or: megabeta bench wavefront

- Speed: beta_1.2 at c = 32 on the block and the wavefront schedule, and the standard arm of the
  same shape, one training step (forward + backward) each in turn, round after round, in one
  process; each arm's median s/step over the rounds, FLOP/s (model/flops.py) as a ratio to the
  standard arm's. The same pairing for t19_flash's shape (L = 4, k = 2: about 4/3 cells a wave,
  little to batch), block against wavefront.
- Dispatches: kernel-launching operators of one training step (bench/dispatch.py's counter) on
  either schedule, each with its checkpointing (block / wave), at the counting width.

Targets (issue "The wavefront schedule"): c = 32 at >= 0.9x the standard arm's FLOP/s;
dispatches per step <= 0.35x the block schedule's; t19_flash no slower than the block schedule.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch

from megabeta.bench.dispatch import count_step, counting_config
from megabeta.model import DecoderLM, ExecutionConfig, build_model, get_preset
from megabeta.model.flops import training_flops

SCHEDULES = {"block": "block", "wavefront": "wave"}
"""Each schedule with the activation checkpointing it pairs with."""


def _model(preset: str, execution: ExecutionConfig, **overrides: Any) -> DecoderLM:
    torch.manual_seed(0)
    return build_model(get_preset(preset, **overrides), execution)


def _execution(schedule: str, attention: str, checkpoint: bool) -> ExecutionConfig:
    return ExecutionConfig(schedule=schedule, attention=attention,
                           activation_checkpoint=SCHEDULES[schedule] if checkpoint else "none")


def _step(model: DecoderLM, tokens: torch.Tensor) -> Callable[[], float]:
    def step() -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        return time.perf_counter() - start
    return step


def paired(arms: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Median seconds per arm over `rounds`, the arms in turn each round (one warm-up round)."""
    times: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(rounds + 1):
        for name, step in arms.items():
            seconds = step()
            if r:
                times[name].append(seconds)
    return {name: statistics.median(t) for name, t in times.items()}


def dispatches(preset: str, attention: str) -> dict[str, int]:
    """Kernel-launching operators of one training step per schedule (16 blocks of 32)."""
    config = counting_config(**_counting_shape(preset))
    tokens = torch.randint(0, config.vocab_size, (1, 16 * config.block_size),
                           generator=torch.Generator().manual_seed(0))
    out = {}
    for schedule in SCHEDULES:
        torch.manual_seed(0)
        model = build_model(config, _execution(schedule, attention, checkpoint=True))
        out[schedule] = count_step(model, tokens).total
    return out


def _counting_shape(preset: str) -> dict[str, Any]:
    """`preset`'s structure (layers, depth window, flags) at the counting width."""
    config = get_preset(preset)
    return dict(arch=config.arch, num_layers=config.num_layers,
                depth_window=config.depth_window, depth_stride=config.depth_stride)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="megabeta bench wavefront", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="beta_1.2_test", help="beta arm (%(default)s)")
    parser.add_argument("--control", default="t16_std_tf_rope",
                        help="standard arm of the same shape (%(default)s)")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
    parser.add_argument("--batch", type=int, default=8, help="batch (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--block-size", type=int, default=32, help="c (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds (median)")
    parser.add_argument("--attention", default="auto", help="execution.attention")
    parser.add_argument("--checkpoint", action="store_true",
                        help="time each schedule with its activation checkpointing (block / wave)")
    parser.add_argument("--t19-len", type=int, default=2048,
                        help="t19_flash tokens per sequence (batch 1; 0 skips it)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"# wavefront benchmark: {args.preset} c={args.block_size} vs {args.control}, "
          f"{device}, {torch.get_num_threads()} threads, torch {torch.__version__}")

    shape = dict(vocab_size=args.vocab, max_seq_len=args.seq_len)
    beta = dict(shape, block_size=args.block_size)
    models = {"standard": _model(args.control, ExecutionConfig(attention=args.attention),
                                 **shape)}
    for schedule in SCHEDULES:
        models[schedule] = _model(args.preset, _execution(schedule, args.attention,
                                                          args.checkpoint), **beta)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    models = {name: m.to(device) for name, m in models.items()}
    seconds = paired({name: _step(m, tokens.to(device)) for name, m in models.items()},
                     args.rounds)
    flops = {"standard": training_flops(get_preset(args.control, **shape), args.seq_len)}
    flops["block"] = flops["wavefront"] = training_flops(get_preset(args.preset, **beta),
                                                         args.seq_len)
    rate = {name: args.batch * flops[name] / s for name, s in seconds.items()}
    print(f"\n## forward+backward, batch {args.batch} x {args.seq_len}, checkpointing "
          f"{'per schedule' if args.checkpoint else 'off'} (median of {args.rounds} rounds, "
          "paired in one process)")
    print("| arm | s/step | GFLOP/s | FLOP/s vs standard |")
    print("|---|---|---|---|")
    for name in models:
        print(f"| {name} | {seconds[name]:.3f} | {rate[name] / 1e9:.1f} | "
              f"{rate[name] / rate['standard']:.2f}x |")
    ratio = rate["wavefront"] / rate["standard"]
    print(f"- wavefront c = {args.block_size} FLOP/s >= 0.9x standard: {ratio:.2f}x "
          f"({'meets' if ratio >= 0.9 else 'MISSES'} target); block schedule "
          f"{rate['block'] / rate['standard']:.2f}x; wavefront / block time "
          f"{seconds['wavefront'] / seconds['block']:.2f}x")

    print("\n## kernel-launching dispatches per training step (16 blocks of 32, counting width)")
    for preset in (args.preset, "t19_flash"):
        counts = dispatches(preset, args.attention)
        r = counts["wavefront"] / counts["block"]
        # The 0.35x target is the batched shape's; t19_flash (about 4/3 cells a wave) has none.
        verdict = (f" ({'meets' if r <= 0.35 else 'MISSES'} the 0.35x target)"
                   if preset == args.preset else "")
        print(f"- {preset}: block {counts['block']}, wavefront {counts['wavefront']}: "
              f"{r:.2f}x{verdict}")

    if args.t19_len:
        t19 = dict(vocab_size=args.vocab, max_seq_len=args.t19_len)
        pair = {s: _model("t19_flash", _execution(s, args.attention, True), **t19).to(device)
                for s in SCHEDULES}
        t19_tokens = torch.randint(0, args.vocab, (1, args.t19_len + 1),
                                   generator=torch.Generator().manual_seed(1)).to(device)
        t = paired({s: _step(m, t19_tokens) for s, m in pair.items()}, max(1, args.rounds // 2))
        r = t["wavefront"] / t["block"]
        print(f"\n## t19_flash, batch 1 x {args.t19_len}, checkpointing per schedule")
        print(f"- block {t['block']:.2f} s, wavefront {t['wavefront']:.2f} s: {r:.2f}x "
              f"({'meets' if r <= 1.0 else 'MISSES'} 'no slower')")


if __name__ == "__main__":
    main()
