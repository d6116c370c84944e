"""The device check for one CUDA GPU: the gpu test suite, then speed and MFU, in one script.

    python -m megabeta.bench gpu                       # on the GPU machine (megabeta bench gpu)
    python -m megabeta.bench gpu --device cpu --quick  # the same plumbing, tiny, on a CPU

Sections, in order:

1. versions and features: torch, CUDA, triton, the device, bf16, TF32, and whether
   `execution.attention = "triton"` and `execution.elementwise_kernels = "triton"` can
   be selected (a tiny model is built with each);
2. the device checks: `pytest -m gpu tests/gpu` in a child process (the Triton block attention
   and elementwise kernels against float64 references, fwd and bwd, fp32 and bf16, at small and
   t19_flash sizes; the model on the triton backend against the explicit one, decoding, the
   wavefront and the compiled and graphed static step against the eager loop), its JUnit
   report in checks.xml and its output in checks.log; --quick leaves out the t19_flash sizes
   (`-m "gpu and not full_size"`); without CUDA every check is collected and skipped;
3. the wavefront schedule (megabeta/bench/wavefront.py, paired in one process): beta_1.2_test
   (c = 32, batch 8 x 512) on the block and the wavefront schedule next to the standard arm
   (FLOP/s ratios), kernel-launching dispatches per step of either schedule on this device, and
   t19_flash wavefront against block time;
4. speed: t19_flash forward+backward with block checkpointing under bf16 autocast at 4096 and
   16384 tokens, micro-batch 1 and the largest that fits, eager / compiled / CUDA-graphed, and
   on the wavefront schedule with wave checkpointing, next to the standard arm of the same
   shape: s/step, tokens/s, MFU, peak memory;
5. the article's §7 arms at batch 16 next to its 0.876 / 0.124 / 0.094 s/batch.

Time: everything runs within --budget-s seconds (default 420); the checks by CHECKS_SHARE of
it (checks not started by then are skipped and counted), what no longer fits later is skipped
and listed with the reason, as is everything that cannot run here, and a failing part records
its error and the script goes on. Output: gpu.json and gpu.md (Markdown tables) in $OUT when
set, else in --out (default: the current directory), rewritten after every section; progress
lines on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ElementTree
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

# `@triton.jit` reads TRITON_INTERPRET when a kernel is defined: without a GPU the kernels run
# under Triton's CPU interpreter, so it is set before anything imports megabeta's kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from megabeta.bench.model import peak_mib, timed  # noqa: E402
from megabeta.bench.roofline import device_for, step_bound  # noqa: E402
from megabeta.model import (ConfigError, DecoderLM, ExecutionConfig, ModelConfig,  # noqa: E402
                            build_model, get_preset)
from megabeta.model.flops import training_flops  # noqa: E402
from megabeta.train.metrics import device_peak_flops  # noqa: E402

ARTICLE_S_PER_BATCH = {"beta_1.2_test": 0.876, "beta_1.2_c256": 0.124, "t16_std_tf_rope": 0.094}
"""Article §7.1: s/batch at B = 16 (its sequence length is not stated; --article-seq-len)."""
SECTIONS = ("versions", "wavefront", "speed", "article")
TITLES = {"versions": "Versions and features",
          "wavefront": "The wavefront schedule (paired)", "speed": "Speed: t19_flash",
          "article": "The article's §7 arms at batch 16"}
MODES = {"eager": dict(activation_checkpoint="block"),
         "compiled": dict(activation_checkpoint="block", compile=True),
         "graphed": dict(activation_checkpoint="block", cuda_graphs=True),
         "wavefront": dict(schedule="wavefront", activation_checkpoint="wave"),
         "wavefront_compiled": dict(schedule="wavefront", activation_checkpoint="wave",
                                    compile=True),
         "wavefront_graphed": dict(schedule="wavefront", activation_checkpoint="wave",
                                   cuda_graphs=True)}
"""The speed section's modes: the beta arm's execution settings."""
SETTINGS = {"attention=triton": dict(attention="triton"),
            "elementwise_kernels=triton": dict(elementwise_kernels="triton")}
"""The execution settings whose availability section 1 probes (and later sections rely on)."""
ARTICLE_RESERVE_S = {"cuda": 60.0, "cpu": 8.0}
"""Budget kept for section 5 while section 4 runs (its three arms, warm-up and timing)."""
SHARE_END = {"wavefront": 0.25}
"""The fraction of --budget-s by which these sections must be done, so that the speed sections
keep their time; time they leave unused goes to the later sections."""
# ---- the report ---------------------------------------------------------------------------------

class Report:
    """Rows, notes, what was not run and errors, per section; written as gpu.json and gpu.md."""

    def __init__(self, out_dir: Path, meta: dict[str, Any]) -> None:
        self.out_dir = out_dir
        self.meta = meta
        self.start = time.monotonic()
        self.sections: dict[str, dict[str, Any]] = {
            key: dict(title=TITLES[key], rows=[], notes=[], not_run=[], errors=[])
            for key in SECTIONS}

    def log(self, text: str) -> None:
        print(f"[{time.monotonic() - self.start:6.1f}s] {text}", flush=True)

    def add(self, section: str, row: dict[str, Any]) -> None:
        self.sections[section]["rows"].append(row)
        self.log(f"  {' | '.join(_fmt(v) for v in row.values())}")

    def note(self, section: str, text: str) -> None:
        self.sections[section]["notes"].append(text)
        self.log(f"  note: {text}")

    def not_run(self, section: str, what: str, why: str) -> None:
        self.sections[section]["not_run"].append(dict(what=what, why=why))
        self.log(f"  NOT RUN {what}: {why}")

    def error(self, section: str, what: str, exc: BaseException) -> None:
        tail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-2000:]
        self.sections[section]["errors"].append(
            dict(what=what, error=f"{type(exc).__name__}: {_first_line(exc)}", traceback=tail))
        self.log(f"  ERROR {what}: {type(exc).__name__}: {_first_line(exc)}")

    def summary(self) -> dict[str, int]:
        """What was not run and the errors of the sections."""
        return dict(not_run=sum(len(sec["not_run"]) for sec in self.sections.values()),
                    errors=sum(len(sec["errors"]) for sec in self.sections.values()))

    def write(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        meta = dict(self.meta, elapsed_s=round(time.monotonic() - self.start, 1))
        data = dict(meta=meta, summary=self.summary(), sections=self.sections)
        (self.out_dir / "gpu.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
        (self.out_dir / "gpu.md").write_text(self._markdown(meta))

    def _markdown(self, meta: dict[str, Any]) -> str:
        s = self.summary()
        lines = ["# megabeta GPU device check", "",
                 *(f"- {k}: {_fmt(v)}" for k, v in meta.items()),
                 f"- {s['not_run']} not run, {s['errors']} errors", ""]
        for n, (key, sec) in enumerate(self.sections.items(), 1):
            lines += ["", f"## {n}. {sec['title']}", ""]
            lines += [f"- {text}" for text in sec["notes"]]
            if sec["rows"]:
                lines += ["", *_table(sec["rows"])]
            if sec["not_run"]:
                lines += ["", "Not run:", ""]
                lines += [f"- {item['what']}: {item['why']}" for item in sec["not_run"]]
            if sec["errors"]:
                lines += ["", "Errors:", ""]
                lines += [f"- {item['what']}: `{item['error']}`" for item in sec["errors"]]
            if not (sec["rows"] or sec["notes"] or sec["not_run"] or sec["errors"]):
                lines.append("(nothing recorded)")
        return "\n".join(lines) + "\n"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != value or value in (math.inf, -math.inf):
            return str(value)
        small_or_large = value and (abs(value) < 1e-2 or abs(value) >= 1e6)
        return f"{value:.2e}" if small_or_large else f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_fmt(v)}" for k, v in value.items())
    return str(value).replace("|", "/")


def _row_label(row: dict[str, Any]) -> str:
    return ", ".join(f"{k} {_fmt(v)}" for k, v in row.items() if k != "outcome")


def _table(rows: list[dict[str, Any]]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |" for row in rows]
    return out


class Budget:
    """The global time budget: every part asks whether its estimate still fits."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def why_not(self, estimate: float, reserve: float = 0.0) -> str | None:
        """None when `estimate` seconds fit with `reserve` kept back; else why not."""
        left = self.left() - reserve
        if estimate <= left:
            return None
        return (f"skipped for time: needs ~{estimate:.0f} s, {max(left, 0):.0f} s of the budget "
                f"left" + (f" ({reserve:.0f} s kept for later sections)" if reserve else ""))


@dataclass
class Run:
    """What every section reads: the options, the device, the report, the budget."""

    args: argparse.Namespace
    device: torch.device
    report: Report
    budget: Budget
    unavailable: dict[str, str] = field(default_factory=dict)
    """Execution settings of SETTINGS that cannot be selected here, with the reason."""

    @property
    def quick(self) -> bool:
        return self.args.quick

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def reserve(self, section: str) -> float:
        """Seconds of the budget that `section` must leave to the sections after it."""
        if section in SHARE_END:
            return self.args.budget_s * (1 - SHARE_END[section])
        return ARTICLE_RESERVE_S[self.device.type] if section == "speed" else 0.0

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


@contextlib.contextmanager
def attempt(run: Run, section: str, what: str) -> Iterator[None]:
    """Run one check; an exception is recorded as that check's error and the script goes on."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - one failed check must not end the device check
        run.report.error(section, what, exc)
    finally:
        _free(run.device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- section 1: versions and features -----------------------------------------------------------

def _tiny_config(**overrides: Any) -> ModelConfig:
    base = dict(vocab_size=61, d_model=32, hidden_dim=48, num_heads=4, num_layers=3,
                block_size=4, depth_window=2, max_seq_len=64)
    return ModelConfig(**{**base, **overrides})


def _build(config: ModelConfig, device: torch.device, execution: ExecutionConfig) -> DecoderLM:
    """The model built ON `device` (float32), so that the backend is selected for it at once."""
    with torch.device(device):
        return build_model(config, execution)


def _probe(run: Run, execution: dict[str, Any]) -> tuple[str | None, str]:
    """(None or why not, what the model selected) for a tiny beta model with these settings,
    built on the device and run forward once."""
    try:
        model = _build(_tiny_config(), run.device, ExecutionConfig(**execution))
        with torch.no_grad():
            model(torch.randint(0, 61, (1, 6), device=run.device))
        run.sync()
    except ConfigError as exc:
        return f"ConfigError: {_first_line(exc)}", "not selectable"
    except Exception as exc:  # noqa: BLE001 - a setting that builds but fails is unavailable too
        return f"{type(exc).__name__}: {_first_line(exc)}", "selectable but its forward fails"
    what = (f"selected: attention backend {model.attention_backend.name}, elementwise kernels "
            f"{model.elementwise_kernels.name}")
    wanted = execution.get("attention")
    if wanted and model.attention_backend.name != wanted:
        what += f" (NOT {wanted}: the model runs another backend for it here)"
    return None, what


def section_versions(run: Run) -> None:
    report, key = run.report, "versions"
    items: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                             "CUDA (torch build)": torch.version.cuda or "none"}
    try:
        import triton
        items["triton"] = triton.__version__
    except ImportError as exc:
        items["triton"] = f"not importable ({exc})"
    items["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET", "unset")
    items["device"] = str(run.device)
    if run.cuda:
        props = torch.cuda.get_device_properties(run.device)
        items.update({"device name": props.name,
                      "capability": ".".join(map(str, torch.cuda.get_device_capability())),
                      "memory GiB": round(props.total_memory / 2**30, 1),
                      "SMs": props.multi_processor_count,
                      "bf16 supported": torch.cuda.is_bf16_supported()})
        flash = getattr(torch.backends.cuda, "is_flash_attention_available", None)
        if flash is not None:
            items["SDPA flash kernel built"] = flash()
    else:
        items["device name"] = platform.processor() or platform.machine()
        items["CPU threads"] = torch.get_num_threads()
    items["TF32 matmul (default)"] = torch.backends.cuda.matmul.allow_tf32
    items["TF32 cuDNN (default)"] = torch.backends.cudnn.allow_tf32
    items["float32 matmul precision (default)"] = torch.get_float32_matmul_precision()
    for name, value in items.items():
        report.add(key, dict(item=name, value=value))
    for name, execution in SETTINGS.items():
        why, what = _probe(run, execution)
        if why is not None:
            run.unavailable[name] = why
        report.add(key, dict(item=f"execution.{name.replace('=', ' = ')}",
                             value=what if why is None else f"{what}: {why}"))


def _on_wavefront(mode: str) -> bool:
    """Whether speed mode `mode` runs the wavefront schedule (its rows compare with the eager
    block schedule's: time_vs_block)."""
    return MODES[mode].get("schedule") == "wavefront"


def _graphed(mode: str) -> bool:
    """Whether speed mode `mode` captures CUDA graphs (a CUDA device only)."""
    return MODES[mode].get("cuda_graphs", False)


# ---- sections 3-5: wavefront, speed, article -----------------------------------------------------

@contextlib.contextmanager
def count_graph_captures() -> Iterator[list[int]]:
    """How many CUDA graphs were captured inside (torch.cuda.graph, make_graphed_callables and
    cudagraph trees all call CUDAGraph.capture_begin): whether cuda_graphs did anything."""
    counter = [0]
    original = torch.cuda.CUDAGraph.capture_begin

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        counter[0] += 1
        return original(self, *args, **kwargs)

    torch.cuda.CUDAGraph.capture_begin = counting
    try:
        yield counter
    finally:
        torch.cuda.CUDAGraph.capture_begin = original


def _train_step(model: DecoderLM, tokens: Tensor) -> Callable[[], None]:
    """One forward+backward under bf16 autocast (float32 parameters, as TorchEngine with
    train.precision = bf16)."""
    def step() -> None:
        model.zero_grad(set_to_none=True)
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
    return step


@dataclass
class Timing:
    seconds: float
    first_s: float
    peak_gib: float
    static_gib: float
    backend: str
    captures: int
    timed_steps: int


def measure(run: Run, config: ModelConfig, execution: ExecutionConfig, batch: int, length: int,
            mode: str, repeats: int, warmup: int, reserve: float = 0.0) -> Timing:
    """s/step (median of `repeats` after the first step and `warmup` more) of one arm; fewer
    steps when the first one shows that they would not fit in the budget (`reserve` kept), down
    to the first step alone (`timed_steps` 0)."""
    _free(run.device)
    if run.cuda:
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = _build(config, run.device, execution)
    static = torch.cuda.memory_allocated() / 2**30 if run.cuda else 0.0
    tokens = torch.randint(0, config.vocab_size, (batch, length + 1), device=run.device)
    step = _train_step(model, tokens)
    captures = count_graph_captures() if run.cuda else contextlib.nullcontext([0])
    with captures as count:
        begin = time.perf_counter()
        step()
        run.sync()
        first = time.perf_counter() - begin
        fit = int((run.budget.left() - reserve) // first) if first > 0 else repeats + warmup
        repeats = max(0, min(repeats, fit - warmup))
        warmup = min(warmup, max(0, fit - repeats)) if repeats else 0
        seconds = timed(step, run.device, repeats, warmup) if repeats else first
    return Timing(seconds, first, peak_mib(run.device) / 1024, static,
                  model.attention_backend.name, count[0], repeats)


def profile_step(model: DecoderLM, tokens: Tensor, *, top: int = 6) -> dict[str, Any]:
    """One training step (`_train_step`, after a warm-up step) under torch.profiler: its wall
    time, the device's kernel time within it (`device_busy`: their ratio; low means the device
    waits for the host), the kernel launches the host made, and the `top` operators by self
    device time (by self CPU time on a CPU)."""
    from torch.profiler import ProfilerActivity, profile

    step = _train_step(model, tokens)
    cuda = tokens.device.type == "cuda"
    step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        begin = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(tokens.device)
        wall = time.perf_counter() - begin
    averages = prof.key_averages()

    def device_us(avg: Any) -> float:
        return getattr(avg, "self_device_time_total", 0.0) or 0.0

    busy = sum(device_us(a) for a in averages) / 1e6
    launches = sum(a.count for a in averages if "LaunchKernel" in a.key)
    rank = device_us if cuda else (lambda a: a.self_cpu_time_total)
    ops = sorted(averages, key=rank, reverse=True)[:top]
    return dict(wall_s=wall, device_busy=busy / wall if cuda else None,
                kernel_launches=launches,
                top_ops="; ".join(f"{a.key[:60]} {rank(a) / 1e3:.1f} ms x{a.count}" for a in ops))


def _beta_attention(run: Run) -> tuple[str, str | None]:
    """The attention backend the speed sections give the beta arms, and why when it is not
    --attention."""
    wanted = run.args.attention
    why = run.unavailable.get(f"attention={wanted}")
    return ("auto", f"attention = {wanted} not selectable ({why}): beta arms run 'auto'") \
        if why else (wanted, None)


def _speed_config(run: Run, arch: str, length: int) -> ModelConfig:
    quick = dict(d_model=64, hidden_dim=128, num_heads=2, num_layers=2) if run.quick else {}
    config = get_preset("t19_flash", vocab_size=512 if run.quick else 55000,
                        max_seq_len=length, **quick)
    return config.replace(arch=arch) if arch == "standard" else config


def _roofline_s(run: Run, config: ModelConfig, batch: int, length: int,
                mode: str) -> float | None:
    """The roofline's lower bound on s/step (megabeta/bench/roofline.py) of a beta arm on a GPU
    of its table; None for the standard arm, on a CPU or on another GPU."""
    device = device_for(torch.cuda.get_device_name(run.device)) if run.cuda else None
    if device is None or config.arch != "beta12":
        return None
    return step_bound(config, ExecutionConfig(**MODES[mode]), length, batch, device).seconds


def _speed_row(run: Run, arm: str, config: ModelConfig, batch: int, length: int, mode: str,
               timing: Timing, peak: float, base: Timing | None) -> dict[str, Any]:
    flops = batch * training_flops(config, length)
    row = dict(arm=arm, tokens=length, batch=batch, mode=mode, attention=timing.backend,
               s_per_step=timing.seconds, tokens_per_s=batch * length / timing.seconds,
               MFU=flops / timing.seconds / peak, first_step_s=timing.first_s,
               timed_steps=timing.timed_steps, peak_GiB=timing.peak_gib)
    bound = _roofline_s(run, config, batch, length, mode)
    if bound is not None:
        row["of_bound"] = bound / timing.seconds
    if _graphed(mode):
        row["graphs_captured"] = timing.captures
    if base is not None:
        row["time_vs_standard"] = timing.seconds / base.seconds
    return row


def section_speed(run: Run) -> None:
    report, key, args = run.report, "speed", run.args
    # A CPU's bf16 matmul is slow to measure and says nothing about MFU on a GPU.
    peak, source = device_peak_flops(run.device, torch.bfloat16 if run.cuda else torch.float32)
    report.note(key, f"bf16 autocast with float32 parameters (as TorchEngine, train.precision = "
                     f"bf16), activation_checkpoint = block; MFU = training_flops / time / peak, "
                     f"peak {_fmt(peak / 1e12)} TFLOP/s ({source}); s/step is the median of "
                     f"{args.repeats} steps after {args.warmup + 1} untimed ones (the first, "
                     "with compilation or capture, is shown apart; timed_steps says how many "
                     "fitted in the budget, 0: the first step's time)")
    report.note(key, "of_bound: the roofline's lower bound on the step (megabeta bench "
                     "roofline: the Triton kernels' loop structure, no L2 reuse) over the "
                     "measured s/step, on the GPUs of its table")
    attention, why = _beta_attention(run)
    if why:
        report.note(key, why)
    report.note(key, "the standard arm (arch = standard, same shape) runs attention = auto, its "
                     "fastest path, at the same batch, mode and precision (modes wavefront and "
                     "wavefront_compiled, wavefront_graphed: execution.schedule = "
                     "wavefront with activation_checkpoint = wave, and compile = true or "
                     "cuda_graphs = true, for the beta arm, "
                     "compared with the eager rows: time_vs_block)")
    lengths = [int(s) for s in args.speed_lengths.split(",")]
    reserve = run.reserve(key)
    known: dict[tuple[int, str], float] = {}
    """(length, mode) -> beta s/step at batch 1, for estimates."""
    largest: dict[int, int] = {}
    """length -> largest eager micro-batch of the beta arm that fit."""

    def estimate(length: int, mode: str, batch: int) -> float:
        base = known.get((length, mode)) or known.get((length, "eager"))
        if base is None:
            shorter = [known[(n, "eager")] * (length / n) ** 1.5 for n in lengths
                       if (n, "eager") in known]
            # measure() trims its repeats to the budget after the first step: a guess will do.
            base = max(shorter, default=3.0 if run.cuda else 2.0)
        steps = args.warmup + 1 + args.repeats
        # The compiled wavefront compiles a graph per kind of wave (`WavePlan.kinds`): a few.
        extra = {"compiled": args.compile_estimate_s, "graphed": 3 * base,
                 "wavefront_compiled": 4 * args.compile_estimate_s,
                 "wavefront_graphed": 3 * base}.get(mode, 0.0)
        return 2 * (steps * base * batch + extra)  # two arms

    standard: dict[tuple[int, int], Timing] = {}
    """(length, batch) -> the standard arm's eager timing (the wavefront mode's base)."""
    block: dict[tuple[int, int], Timing] = {}
    """(length, batch) -> the beta arm's eager (block schedule) timing."""

    def arms(length: int, mode: str, batch: int) -> None:
        """Beta, then the standard arm, at one setting: a row each (the wavefront mode reuses
        the eager standard arm's timing: its schedule is beta12's alone)."""
        base = standard.get((length, batch)) if _on_wavefront(mode) else None
        for arm, arch, backend in (("standard", "standard", "auto"),
                                   ("beta_1.2 t19_flash", "beta12", attention)):
            if arch == "standard" and base is not None:
                continue
            execution = MODES["eager" if arch == "standard" else mode]
            config = _speed_config(run, arch, length)
            label = f"{arm} {length} tokens batch {batch} {mode}"
            with attempt(run, key, label):
                try:
                    timing = measure(run, config, ExecutionConfig(attention=backend, **execution),
                                     batch, length, mode, args.repeats, args.warmup, reserve)
                except ConfigError as exc:
                    report.not_run(key, label, f"the model refuses it: {_first_line(exc)}")
                    continue
                row = _speed_row(run, arm, config, batch, length, mode, timing, peak,
                                 base if arch == "beta12" else None)
                if _on_wavefront(mode) and (length, batch) in block:
                    row["time_vs_block"] = timing.seconds / block[(length, batch)].seconds
                report.add(key, row)
                if arch == "standard":
                    base = timing
                    if mode == "eager":
                        standard[(length, batch)] = timing
                else:
                    if mode == "eager":
                        block[(length, batch)] = timing
                    if batch == 1:
                        known[(length, mode)] = timing.seconds
                if _graphed(mode) and not timing.captures:
                    report.note(key, f"{label}: cuda_graphs = true was accepted but no CUDA "
                                     "graph was captured: this ran eagerly")

    def compare(length: int) -> None:
        """The beta arm at batch 1, eager, on each --compare-attention backend, against the
        --attention row measured just before (time_vs_<attention>)."""
        config = _speed_config(run, "beta12", length)
        for backend in filter(None, args.compare_attention.split(",")):
            label = f"beta_1.2 t19_flash {length} tokens batch 1 eager, attention {backend}"
            why = run.unavailable.get(f"attention={backend}")
            if why:
                report.not_run(key, label, why)
                continue
            why = run.budget.why_not(estimate(length, "eager", 1) / 2, reserve)
            if why:
                report.not_run(key, label, why)
                continue
            with attempt(run, key, label):
                timing = measure(run, config, ExecutionConfig(attention=backend,
                                                              activation_checkpoint="block"),
                                 1, length, "eager", args.repeats, args.warmup, reserve)
                row = _speed_row(run, "beta_1.2 t19_flash", config, 1, length, "eager",
                                 timing, peak, standard.get((length, 1)))
                if (length, 1) in block:
                    row[f"time_vs_{block[(length, 1)].backend}"] = (
                        timing.seconds / block[(length, 1)].seconds)
                report.add(key, row)

    def profile(length: int) -> None:
        """Where the beta arm's step time goes (`profile_step`): device busy or waiting."""
        label = f"profile of beta_1.2 t19_flash {length} tokens batch 1 eager"
        why = run.budget.why_not(estimate(length, "eager", 1), reserve)
        if why:
            report.not_run(key, label, why)
            return
        with attempt(run, key, label):
            _free(run.device)
            torch.manual_seed(0)
            config = _speed_config(run, "beta12", length)
            model = _build(config, run.device, ExecutionConfig(attention=attention,
                                                               activation_checkpoint="block"))
            tokens = torch.randint(0, config.vocab_size, (1, length + 1), device=run.device)
            report.add(key, dict(arm="beta_1.2 t19_flash", tokens=length, batch=1,
                                 mode="eager (profiled)", attention=model.attention_backend.name,
                                 **profile_step(model, tokens)))

    def search(length: int) -> None:
        """Double the beta arm's micro-batch until it runs out of memory (one step each)."""
        config = _speed_config(run, "beta12", length)
        execution = ExecutionConfig(attention=attention, activation_checkpoint="block")
        batch, fits = 2, 1
        total = (torch.cuda.get_device_properties(run.device).total_memory / 2**30
                 if run.cuda else math.inf)
        last: Timing | None = None
        while batch <= args.max_batch:
            step_s = known.get((length, "eager"), 1.0) * batch
            why = run.budget.why_not(4 * step_s, reserve)
            if why:
                report.not_run(key, f"micro-batch {batch} at {length} tokens", why)
                break
            if last is not None and last.static_gib + 2 * (last.peak_gib - last.static_gib) > total:
                report.note(key, f"{length} tokens: micro-batch {batch} not tried, predicted "
                                 f"{last.static_gib + 2 * (last.peak_gib - last.static_gib):.1f}"
                                 f" GiB > {total:.1f} GiB")
                break
            try:
                last = measure(run, config, execution, batch, length, "eager", 0, 0)
                fits = batch
                batch *= 2
            except torch.cuda.OutOfMemoryError:
                report.note(key, f"{length} tokens: micro-batch {batch} ran out of memory")
                break
            finally:
                _free(run.device)
        largest[length] = fits
        report.note(key, f"{length} tokens: largest beta micro-batch that fits: {fits}"
                         + (f" (capped by --max-batch {args.max_batch})"
                            if batch > args.max_batch else ""))

    # By priority: batch 1 eager, each mode at the first length, the batch searches, the rest.
    modes = [m for m in MODES if m != "eager" and m in args.modes.split(",")]
    for mode in [m for m in modes if _graphed(m) and not run.cuda]:
        modes.remove(mode)
        report.not_run(key, f"mode {mode} (execution.cuda_graphs = true)",
                       "CUDA graphs need a CUDA device")
    tasks: list[tuple[str, int, str]] = [("b1", n, "eager") for n in lengths]
    tasks += [("compare", lengths[0], "eager"), ("profile", lengths[0], "eager")]
    for mode in filter(_on_wavefront, modes):
        tasks += [("b1", n, mode) for n in lengths]
    tasks += [("b1", lengths[0], mode) for mode in modes if not _on_wavefront(mode)]
    tasks += [("max", n, "eager") for n in lengths]
    for mode in modes:
        tasks += [("b1", n, mode) for n in lengths[1:] if not _on_wavefront(mode)]
        tasks += [("max", n, mode) for n in lengths]
    for mode in MODES:
        if mode != "eager" and mode not in args.modes.split(","):
            report.not_run(key, f"mode {mode}", "not in --modes")
    for kind, length, mode in tasks:
        if kind == "compare":
            compare(length)
            continue
        if kind == "profile":
            profile(length)
            continue
        label = f"{length} tokens, {'batch 1' if kind == 'b1' else 'largest batch'}, {mode}"
        if kind == "max":
            if length not in largest:
                if mode != "eager":
                    report.not_run(key, label, "no eager batch search at this length")
                    continue
                with attempt(run, key, f"batch search at {length} tokens"):
                    search(length)
            batch = largest.get(length, 1)
            if batch == 1:
                report.not_run(key, label, "the largest micro-batch found is 1 (rows above)")
                continue
        else:
            batch = 1
        why = run.budget.why_not(estimate(length, mode, batch), reserve)
        if why:
            report.not_run(key, label, why)
            continue
        arms(length, mode, batch)


def section_article(run: Run) -> None:
    report, key, args = run.report, "article", run.args
    seq, batch = args.article_seq_len, args.article_batch
    attention, why = _beta_attention(run)
    report.note(key, f"batch {batch} x {seq} tokens, vocab 8192, bf16 autocast, float32 "
                     "parameters, no activation checkpointing, eager; the article (§7.1) does "
                     "not state its sequence length or precision: 1024 is this script's "
                     "assumption (--article-seq-len)")
    if why:
        report.note(key, why)
    overrides = dict(num_layers=2) if run.quick else {}
    base: float | None = None
    for preset in ("t16_std_tf_rope", "beta_1.2_c256", "beta_1.2_test"):
        config = get_preset(preset, vocab_size=8192, **overrides)
        config = config.replace(max_seq_len=max(seq, config.max_seq_len))
        backend = "auto" if config.arch == "standard" else attention
        estimate = (base or (5.0 if run.cuda else 1.0)) * (8 if preset == "beta_1.2_test" else 2)
        why = run.budget.why_not(estimate * (args.warmup + 1 + args.repeats))
        if why:
            report.not_run(key, preset, why)
            continue
        with attempt(run, key, preset):
            timing = measure(run, config, ExecutionConfig(attention=backend), batch, seq,
                             "eager", args.repeats, args.warmup)
            if config.arch == "standard":
                base = timing.seconds
            article = ARTICLE_S_PER_BATCH[preset]
            report.add(key, dict(
                arm=preset, c=config.block_size if config.arch == "beta12" else "-",
                attention=timing.backend, s_per_batch=timing.seconds, article_s_per_batch=article,
                vs_article=timing.seconds / article,
                vs_standard=timing.seconds / base if base else "",
                article_vs_standard=article / ARTICLE_S_PER_BATCH["t16_std_tf_rope"],
                tokens_per_s=batch * seq / timing.seconds, timed_steps=timing.timed_steps,
                peak_GiB=timing.peak_gib))


def section_wavefront(run: Run) -> None:
    """`megabeta bench wavefront`'s measurement on this device, with each schedule's
    checkpointing, against the issue's targets."""
    from megabeta.bench import wavefront

    report, key = run.report, "wavefront"
    attention, why = _beta_attention(run)
    if why:
        report.note(key, why)
    settings = wavefront.Settings(attention=attention, checkpoint=True)
    if run.quick:
        settings = wavefront.Settings(
            attention=attention, checkpoint=True, vocab=512, batch=2, seq_len=64, block_size=8,
            rounds=1, t19_len=64, shape=dict(d_model=64, hidden_dim=128, num_heads=2,
                                             num_layers=6))
    report.note(key, f"{settings.preset} against {settings.control} at batch {settings.batch} x "
                     f"{settings.seq_len}, c = {settings.block_size}; block / wavefront with "
                     f"block / wave checkpointing; median of {settings.rounds} rounds, the arms "
                     "in turn in one process; bf16 autocast on CUDA; dispatches: one training "
                     "step of each schedule at the counting width (16 blocks of 32), "
                     "kernel-launching operators and Triton launches; t19_flash at batch 1 x "
                     f"{settings.t19_len}")
    why = run.budget.why_not(60.0 if run.cuda else 30.0, run.reserve(key))
    if why:
        report.not_run(key, "the paired measurement", why)
        return
    figures = wavefront.measure(settings, run.device)
    for name, seconds in figures.seconds.items():
        report.add(key, dict(figure=f"{name} s/step", value=seconds,
                             vs_standard=figures.vs_standard[name]))
    for preset, counts in figures.dispatches.items():
        report.add(key, dict(figure=f"dispatches per step, {preset}",
                             value=f"block {counts['block']}, wavefront {counts['wavefront']}",
                             wavefront_vs_block=figures.dispatch_ratio(preset)))
    if figures.t19:
        report.add(key, dict(figure=f"t19_flash s/step, {settings.t19_len} tokens",
                             value=f"block {_fmt(figures.t19['block'])}, wavefront "
                                   f"{_fmt(figures.t19['wavefront'])}",
                             wavefront_vs_block=figures.t19["wavefront"] / figures.t19["block"]))
    for line in wavefront.verdicts(settings, figures):
        report.note(key, line)


SECTION_FUNCTIONS: dict[str, Callable[[Run], None]] = {
    "versions": section_versions, "wavefront": section_wavefront,
    "speed": section_speed, "article": section_article}


# ---- entry point --------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="megabeta bench gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device to check (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes everywhere: the whole script in a few minutes on a CPU")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="time budget of the whole run in seconds; what no longer fits is "
                             "skipped and listed (default: %(default)s)")
    parser.add_argument("--out", default=".",
                        help="directory for gpu.json and gpu.md when $OUT is not set")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help="comma-separated sections to run (default: all: %(default)s)")
    parser.add_argument("--attention", default=None,
                        help="execution.attention of the beta arms in sections 3-5 (default: "
                             "triton on CUDA, auto on CPU, where the Triton interpreter takes "
                             "seconds per call; 'auto' when it cannot be selected)")
    parser.add_argument("--compare-attention", default="",
                        help="comma-separated execution.attention values also timed on the "
                             "beta arm at the first length, batch 1, eager, next to --attention "
                             "(e.g. explicit; default: none)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="speed modes of section 4 (eager always runs; default: %(default)s)")
    parser.add_argument("--speed-lengths", default=None,
                        help="t19_flash sequence lengths (default: 4096,16384; --quick: 64,128)")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="largest micro-batch the search tries (default: 64; --quick: 4)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed steps per measurement (default: 3; --quick: 1)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps after the first (default: 1; --quick: 0)")
    parser.add_argument("--compile-estimate-s", type=float, default=None,
                        help="expected torch.compile time per arm, for the budget (default: 60; "
                             "--quick: 30)")
    parser.add_argument("--article-seq-len", type=int, default=None,
                        help="sequence length of section 5 (default: 1024; --quick: 64)")
    parser.add_argument("--article-batch", type=int, default=None,
                        help="batch of section 5 (default: 16, the article's; --quick: 2)")
    args = parser.parse_args(argv)
    if args.attention is None:
        args.attention = "triton" if args.device.startswith("cuda") else "auto"
    defaults = dict(speed_lengths=("64,128", "4096,16384"), max_batch=(4, 64), repeats=(1, 3),
                    warmup=(0, 1), compile_estimate_s=(30.0, 60.0), article_seq_len=(64, 1024),
                    article_batch=(2, 16))
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)} "
                     f"(the device's exactness checks are tests: pytest -m gpu tests)")
    return args


def main(argv: list[str] | None = None) -> Report:
    """Run the device check; returns the report (also written to gpu.json / gpu.md)."""
    args = parse_args(argv)
    out_dir = Path(os.environ.get("OUT") or args.out)
    meta = dict(started=time.strftime("%Y-%m-%d %H:%M:%S"), device=args.device,
                quick=args.quick, budget_s=args.budget_s, host=platform.node())
    report = Report(out_dir, meta)
    run = Run(args, torch.device(args.device), report, Budget(args.budget_s))
    wanted = args.sections.split(",")
    report.log(f"megabeta GPU device check on {args.device}, budget {args.budget_s:.0f} s, "
               f"writing {out_dir / 'gpu.json'} and gpu.md")
    for n, key in enumerate(SECTIONS, 1):
        report.log(f"section {n}: {TITLES[key]}")
        if key not in wanted:
            report.not_run(key, "the whole section", "not in --sections")
        elif key != "versions" and run.budget.left() <= 0:
            report.not_run(key, "the whole section", "skipped for time: the budget is spent")
        else:
            with attempt(run, key, "the section"):
                SECTION_FUNCTIONS[key](run)
        report.write()
    summary = report.summary()
    report.log(f"done: {summary['not_run']} not run, {summary['errors']} errors; "
               f"{out_dir / 'gpu.md'}")
    return report


if __name__ == "__main__":
    main()
