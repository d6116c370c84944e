"""The wavefront schedule against the block schedule and the standard arm, paired in one process.

    python -m megabeta.bench wavefront          # or: megabeta bench wavefront

- Speed: beta_1.2 at c = 32 on the block and the wavefront schedule, and the standard arm of the
  same shape, one training step (forward + backward) each in turn, round after round, in one
  process; each arm's median s/step over the rounds, FLOP/s (model/flops.py) as a ratio to the
  standard arm's. The same pairing for t19_flash's shape (L = 4, k = 2: about 4/3 cells a wave,
  little to batch), block against wavefront.
- Dispatches: kernel-launching operators of one training step (bench/dispatch.py's counter) on
  either schedule, each with its checkpointing (block / wave), at the counting width, on the
  device the benchmark runs on (with the Triton backend on a GPU, one launch per wave's
  attention).

On a GPU every step runs under bf16 autocast (float32 parameters, as train.precision = bf16) and
is timed between device synchronisations.

Targets (issue "The wavefront schedule"): c = 32 at >= 0.9x the standard arm's FLOP/s;
dispatches per step <= 0.35x the block schedule's; t19_flash no slower than the block schedule.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from megabeta.bench.dispatch import count_step, counting_config
from megabeta.model import DecoderLM, ExecutionConfig, ModelConfig, build_model, get_preset
from megabeta.model.flops import training_flops
from megabeta.model.execution import SCHEDULES, UNITS

FLOPS_TARGET = 0.9
DISPATCH_TARGET = 0.35


@dataclass
class Settings:
    """What one wavefront measurement runs (the command's options)."""

    preset: str = "beta_1.2_test"
    control: str = "t16_std_tf_rope"
    vocab: int = 8192
    batch: int = 8
    seq_len: int = 512
    block_size: int = 32
    rounds: int = 4
    attention: str = "auto"
    elementwise_kernels: str = "auto"
    checkpoint: bool = False
    t19_len: int = 2048
    dispatches_only: bool = False
    profile: int = 0
    """Operators listed per arm from one profiled step after the timing (0: none)."""
    shape: dict[str, Any] = field(default_factory=dict)
    """Model fields both arms of the paired speed take instead of their presets' (a smaller
    model for a quick run); the dispatch counts keep the presets' structure."""


@dataclass
class Figures:
    """What it measured."""

    seconds: dict[str, float]
    """Median s/step: standard, block, wavefront."""
    rate: dict[str, float]
    """FLOP/s per arm (model/flops.py's count over the median time)."""
    vs_standard: dict[str, float]
    """FLOP/s as a ratio to the standard arm's, per arm."""
    dispatches: dict[str, dict[str, int]]
    """Per preset, per schedule: kernel-launching dispatches of one step."""
    t19: dict[str, float] = field(default_factory=dict)
    """t19_flash s/step per schedule (empty: not measured)."""
    leaders: dict[str, list[tuple[str, float, int]]] = field(default_factory=dict)
    """Per arm, the operators with the most self time in one profiled step: (name, seconds,
    calls) (empty: not profiled)."""

    def dispatch_ratio(self, preset: str) -> float:
        counts = self.dispatches[preset]
        return counts["wavefront"] / counts["block"]


def _model(preset: str, execution: ExecutionConfig, device: torch.device,
           **overrides: Any) -> DecoderLM:
    return _built_on(device, get_preset(preset, **overrides), execution)


def _built_on(device: torch.device, config: ModelConfig, execution: ExecutionConfig) -> DecoderLM:
    """The model built ON `device` (seed 0): the attention backend is chosen for the device it
    runs on (a CUDA-only backend refuses a model built on the CPU)."""
    torch.manual_seed(0)
    with torch.device(device):
        return build_model(config, execution)


def _execution(schedule: str, settings: Settings, checkpoint: bool) -> ExecutionConfig:
    return ExecutionConfig(schedule=schedule, attention=settings.attention,
                           elementwise_kernels=settings.elementwise_kernels,
                           activation_checkpoint=UNITS[schedule] if checkpoint else "none")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(model: DecoderLM, tokens: torch.Tensor) -> Callable[[], float]:
    """One timed training step; on a GPU under bf16 autocast, between synchronisations."""
    device = tokens.device
    cast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
            else contextlib.nullcontext())

    def step() -> float:
        model.zero_grad(set_to_none=True)
        _sync(device)
        start = time.perf_counter()
        with cast:
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        _sync(device)
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


def profiled(step: Callable[[], float], top: int) -> list[tuple[str, float, int]]:
    """The `top` operators by self time in one step under torch.profiler: (name, seconds,
    calls)."""
    from torch.profiler import profile

    with profile() as prof:
        step()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in events]


def dispatches(preset: str, settings: Settings, device: torch.device, *,
               one_cell: bool = False) -> dict[str, int]:
    """Kernel-launching operators of one training step per schedule (16 blocks of 32). Triton
    kernels run only on a GPU: under the interpreter they are counted, not run (the count
    does not depend on the numbers). `one_cell`: with k = L-1, a wave is one cell (period L):
    the block schedule's order, run as waves."""
    shape = _counting_shape(preset)
    if one_cell:
        shape["depth_window"] = shape["num_layers"] - 1
    config = counting_config(**shape)
    tokens = torch.randint(0, config.vocab_size, (1, 16 * config.block_size),
                           generator=torch.Generator().manual_seed(0)).to(device)
    out = {}
    for schedule in SCHEDULES:
        model = _built_on(device, config, _execution(schedule, settings, checkpoint=True))
        out[schedule] = count_step(model, tokens, run_kernels=device.type == "cuda").total
    return out


def _counting_shape(preset: str) -> dict[str, Any]:
    """`preset`'s structure (layers, depth window, flags) at the counting width."""
    config = get_preset(preset)
    return dict(arch=config.arch, num_layers=config.num_layers,
                depth_window=config.depth_window, depth_stride=config.depth_stride)


def measure(settings: Settings, device: torch.device) -> Figures:
    """The paired speed, the dispatch counts and the t19_flash pairing (module doc)."""
    s = settings
    shape = dict(s.shape, vocab_size=s.vocab, max_seq_len=s.seq_len)
    beta = dict(shape, block_size=s.block_size)
    models = {"standard": _model(s.control, ExecutionConfig(attention=s.attention,
                                                            elementwise_kernels=s.elementwise_kernels),
                                 device, **shape)}
    for schedule in SCHEDULES:
        models[schedule] = _model(s.preset, _execution(schedule, s, s.checkpoint), device,
                                  **beta)
    tokens = torch.randint(0, s.vocab, (s.batch, s.seq_len + 1),
                           generator=torch.Generator().manual_seed(0)).to(device)
    seconds = paired({name: _step(m, tokens) for name, m in models.items()}, s.rounds)
    leaders = ({name: profiled(_step(m, tokens), s.profile) for name, m in models.items()}
               if s.profile else {})
    del models
    flops = {"standard": training_flops(get_preset(s.control, **shape), s.seq_len)}
    flops["block"] = flops["wavefront"] = training_flops(get_preset(s.preset, **beta),
                                                         s.seq_len)
    rate = {name: s.batch * flops[name] / t for name, t in seconds.items()}
    figures = Figures(seconds, rate, {name: r / rate["standard"] for name, r in rate.items()},
                      {p: dispatches(p, s, device) for p in (s.preset, "t19_flash")},
                      leaders=leaders)
    if s.t19_len:
        t19 = dict(s.shape, vocab_size=s.vocab, max_seq_len=s.t19_len)
        pair = {name: _model("t19_flash", _execution(name, s, True), device, **t19)
                for name in SCHEDULES}
        t19_tokens = torch.randint(0, s.vocab, (1, s.t19_len + 1),
                                   generator=torch.Generator().manual_seed(1)).to(device)
        figures.t19 = paired({name: _step(m, t19_tokens) for name, m in pair.items()},
                             max(1, s.rounds // 2))
    return figures


def verdicts(settings: Settings, figures: Figures) -> list[str]:
    """One line per target: the figure, and whether it meets the target."""
    s, f = settings, figures
    ratio = f.vs_standard["wavefront"]
    lines = [f"wavefront c = {s.block_size} FLOP/s >= {FLOPS_TARGET}x standard: {ratio:.2f}x "
             f"({'meets' if ratio >= FLOPS_TARGET else 'MISSES'} target); block schedule "
             f"{f.vs_standard['block']:.2f}x; wavefront / block time "
             f"{f.seconds['wavefront'] / f.seconds['block']:.2f}x"]
    for preset, counts in f.dispatches.items():
        r = f.dispatch_ratio(preset)
        # The 0.35x target is the batched shape's; t19_flash (about 4/3 cells a wave) has none.
        verdict = (f" ({'meets' if r <= DISPATCH_TARGET else 'MISSES'} the "
                   f"{DISPATCH_TARGET}x target)" if preset == s.preset else "")
        lines.append(f"dispatches per step, {preset}: block {counts['block']}, wavefront "
                     f"{counts['wavefront']}: {r:.2f}x{verdict}")
    if f.t19:
        r = f.t19["wavefront"] / f.t19["block"]
        lines.append(f"t19_flash batch 1 x {s.t19_len}: block {f.t19['block']:.3f} s, wavefront "
                     f"{f.t19['wavefront']:.3f} s: {r:.2f}x "
                     f"({'meets' if r <= 1.0 else 'MISSES'} 'no slower')")
    return lines


def parse_args(argv: list[str] | None) -> Settings:
    d = Settings()
    parser = argparse.ArgumentParser(prog="megabeta bench wavefront", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default=d.preset, help="beta arm (%(default)s)")
    parser.add_argument("--control", default=d.control,
                        help="standard arm of the same shape (%(default)s)")
    parser.add_argument("--vocab", type=int, default=d.vocab, help="vocabulary size")
    parser.add_argument("--batch", type=int, default=d.batch, help="batch (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    parser.add_argument("--block-size", type=int, default=d.block_size,
                        help="c (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=d.rounds, help="timed rounds (median)")
    parser.add_argument("--attention", default=d.attention, help="execution.attention")
    parser.add_argument("--elementwise-kernels", "--cell-kernels", dest="elementwise_kernels",
                        default=d.elementwise_kernels,
                        help="execution.elementwise_kernels (%(default)s)")
    parser.add_argument("--checkpoint", action="store_true",
                        help="time each schedule with its activation checkpointing (block / wave)")
    parser.add_argument("--t19-len", type=int, default=d.t19_len,
                        help="t19_flash tokens per sequence (batch 1; 0 skips it)")
    parser.add_argument("--dispatches-only", action="store_true",
                        help="only count the dispatches (e.g. the GPU path on a CPU, its "
                             "Triton launches counted, not run: TRITON_INTERPRET=1 ... "
                             "--attention triton --elementwise-kernels triton)")
    parser.add_argument("--profile", type=int, default=d.profile, metavar="N",
                        help="after the timing, profile one step of each arm and list its N "
                             "operators with the most self time (host time: on a GPU the "
                             "kernels run asynchronously)")
    return Settings(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> None:
    settings = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if settings.dispatches_only:
        for preset, one_cell in ((settings.preset, False), ("t19_flash", False),
                                 ("t19_flash", True)):
            counts = dispatches(preset, settings, device, one_cell=one_cell)
            shape = f"{preset} at k = L-1 (one cell a wave)" if one_cell else preset
            print(f"- dispatches per step, {shape} ({settings.attention} attention, "
                  f"{settings.elementwise_kernels} elementwise kernels, {device}): "
                  f"block {counts['block']}, "
                  f"wavefront {counts['wavefront']}: "
                  f"{counts['wavefront'] / counts['block']:.2f}x")
        return
    print(f"# wavefront benchmark: {settings.preset} c={settings.block_size} vs "
          f"{settings.control}, {device}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    figures = measure(settings, device)
    print(f"\n## forward+backward, batch {settings.batch} x {settings.seq_len}, checkpointing "
          f"{'per schedule' if settings.checkpoint else 'off'} (median of {settings.rounds} "
          "rounds, paired in one process)")
    print("| arm | s/step | GFLOP/s | FLOP/s vs standard |")
    print("|---|---|---|---|")
    for name, seconds in figures.seconds.items():
        print(f"| {name} | {seconds:.3f} | {figures.rate[name] / 1e9:.1f} | "
              f"{figures.vs_standard[name]:.2f}x |")
    print()
    for line in verdicts(settings, figures):
        print(f"- {line}")
    for name, leaders in figures.leaders.items():
        print(f"\n## {name}: operators by self time, one profiled step")
        print("| operator | s | share of the step | calls |")
        print("|---|---|---|---|")
        for op, seconds, calls in leaders:
            share = seconds / figures.seconds[name]
            print(f"| {op[:60]} | {seconds:.3f} | {share:.0%} | {calls} |")


if __name__ == "__main__":
    main()
