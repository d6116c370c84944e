"""The GPU step's speed against its targets, on one CUDA GPU, in one script.

    python -m megabeta.bench gpu                       # on the GPU machine (megabeta bench gpu)
    python -m megabeta.bench gpu --device cpu --quick  # the same plumbing, tiny, on a CPU

Sections, in order:

1. versions and features: torch, CUDA, triton, the device, bf16, TF32, and whether
   `execution.attention = "triton"` and `execution.elementwise_kernels = "triton"` can be
   selected (a tiny model is built with each);
2. speed: t19_flash forward + backward (block recomputation, bf16 autocast over float32
   parameters, as the trainer runs it), most important first: at the short length (4096) and
   micro-batch 1 the standard arm, then beta_1.2 graphed (`execution.cuda_graphs`), eager and
   compiled; beta at the long length (16384) at its largest micro-batch; both arms at the short
   length at their largest micro-batches. The largest micro-batch is the memory model's
   (model/memory.py) at 85 % of the device's memory, halved on an out-of-memory error. Rows:
   s/step, tokens/s, MFU, peak memory, and for beta its share of the roofline bound
   (`of_bound`, megabeta bench roofline) and the CUDA graphs captured;
3. targets: graphed micro-batch 1 at the short length at most 0.4 s a step; beta's tokens/s at
   the short length at least a third of the standard arm's, each at its largest micro-batch;
   at the long length `of_bound` at least 0.5. Each met, missed or not measured.

The device's exactness checks are tests (`pytest -m gpu tests`), not part of this script.
Time: everything runs within --budget-s seconds; what no longer fits is skipped and listed with
the reason, as is everything that cannot run here, and a failing part records its error and the
script goes on. Output: gpu.json and gpu.md (Markdown tables) in $OUT when set, else in --out
(default: the current directory), rewritten after every section; progress lines on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import time
import traceback
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
from megabeta.model.memory import step_memory  # noqa: E402
from megabeta.train.metrics import device_peak_flops  # noqa: E402

SECTIONS = ("versions", "speed", "targets")
TITLES = {"versions": "Versions and features", "speed": "Speed: t19_flash",
          "targets": "Targets of the GPU step"}
MODES = {"eager": dict(activation_checkpoint="block"),
         "compiled": dict(activation_checkpoint="block", compile=True),
         "graphed": dict(activation_checkpoint="block", cuda_graphs=True)}
"""The speed section's modes: the beta arm's execution settings (block schedule)."""
SETTINGS = {"attention=triton": dict(attention="triton"),
            "elementwise_kernels=triton": dict(elementwise_kernels="triton")}
"""The execution settings whose availability section 1 probes (and later sections rely on)."""
TARGET_GRAPHED_S = 0.4
"""t19_flash at the short length, micro-batch 1, graphed: at most this many s/step."""
TARGET_TOKENS_RATIO = 1 / 3
"""At the short length, each arm at its largest micro-batch: beta's tokens/s over standard's."""
TARGET_OF_BOUND = 0.5
"""At the long length, beta's largest micro-batch: the roofline's bound over the measured step."""


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

    def why_not(self, estimate: float) -> str | None:
        """None when `estimate` seconds fit; else why not."""
        left = self.left()
        if estimate <= left:
            return None
        return f"skipped for time: needs ~{estimate:.0f} s, {max(left, 0):.0f} s of the budget left"


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


def _graphed(mode: str) -> bool:
    """Whether speed mode `mode` captures CUDA graphs (a CUDA device only)."""
    return MODES[mode].get("cuda_graphs", False)


# ---- section 2: speed against the targets -----------------------------------------------------

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
            mode: str, repeats: int, warmup: int) -> Timing:
    """s/step (median of `repeats` after the first step and `warmup` more) of one arm; fewer
    steps when the first one shows that they would not fit in the budget, down
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
        fit = int(run.budget.left() // first) if first > 0 else repeats + warmup
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


def _speed_config(run: Run, arch: str, length: int) -> ModelConfig:
    quick = dict(d_model=64, hidden_dim=128, num_heads=2, num_layers=2) if run.quick else {}
    config = get_preset("t19_flash", vocab_size=512 if run.quick else 55000,
                        max_seq_len=length, **quick)
    return config.replace(arch=arch) if arch == "standard" else config


def _execution(run: Run, arch: str, mode: str) -> ExecutionConfig:
    """The standard arm runs eager at its fastest attention; beta runs `mode` on --attention."""
    if arch == "standard":
        return ExecutionConfig(**MODES["eager"])
    return ExecutionConfig(attention=run.args.attention, **MODES[mode])


def largest_batch(run: Run, config: ModelConfig, execution: ExecutionConfig,
                  length: int) -> tuple[int, float]:
    """The memory model's largest micro-batch on this device (model/memory.py: float32
    parameters under bf16 autocast, as this script trains) capped by --max-batch, and the bytes
    it predicts a sequence."""
    memory = step_memory(config, execution, length, act_bytes=2, param_bytes=4,
                         deferred=execution.attention == "triton",
                         readers=execution.attention == "triton")
    capacity = (torch.cuda.get_device_properties(run.device).total_memory if run.cuda
                else run.args.cpu_memory_gib * 2**30)
    return max(1, min(run.args.max_batch, memory.largest_batch(capacity))), memory.sequence_bytes


def _speed_row(run: Run, arm: str, config: ModelConfig, batch: int, length: int, mode: str,
               timing: Timing, peak: float) -> dict[str, Any]:
    flops = batch * training_flops(config, length)
    row = dict(arm=arm, tokens=length, batch=batch, mode=mode, attention=timing.backend,
               s_per_step=timing.seconds, tokens_per_s=batch * length / timing.seconds,
               MFU=flops / timing.seconds / peak, first_step_s=timing.first_s,
               timed_steps=timing.timed_steps, peak_GiB=timing.peak_gib)
    device = device_for(torch.cuda.get_device_name(run.device)) if run.cuda else None
    if device is not None and config.arch == "beta12":
        bound = step_bound(config, ExecutionConfig(**MODES[mode]), length, batch, device)
        row["of_bound"] = bound.seconds / timing.seconds
    if _graphed(mode):
        row["graphs_captured"] = timing.captures
    return row


def section_speed(run: Run) -> None:
    """The targets' measurements, most important first (each within what the budget leaves):
    t19_flash at the short length and micro-batch 1 (standard; beta graphed, eager, compiled);
    beta at the long length and its largest micro-batch (its share of the roofline bound); both
    arms at the short length and their largest micro-batches (tokens/s)."""
    report, key, args = run.report, "speed", run.args
    peak, source = device_peak_flops(run.device, torch.bfloat16 if run.cuda else torch.float32)
    report.note(key, f"bf16 autocast with float32 parameters (as TorchEngine, train.precision = "
                     f"bf16); MFU = training_flops / time / peak, peak "
                     f"{_fmt(peak / 1e12)} TFLOP/s ({source}); s/step: the median of "
                     f"{args.repeats} steps after {args.warmup + 1} untimed ones (timed_steps: "
                     "how many fitted the budget; 0: the first step's time); of_bound: the "
                     "roofline's bound (megabeta bench roofline) over the measured step; largest "
                     "micro-batch: the memory model's (model/memory.py) at 85 % of the device's "
                     "memory, halved on an out-of-memory error")
    short, long = args.lengths
    timings: dict[tuple[str, int, int, str], Timing] = {}

    def time_arm(arm: str, length: int, batch: int, mode: str) -> Timing | None:
        arch = "standard" if arm == "standard" else "beta12"
        label = f"{arm} {length} tokens batch {batch} {mode}"
        if _graphed(mode) and not run.cuda:
            report.not_run(key, label, "CUDA graphs need a CUDA device")
            return None
        known = [t.seconds / b * batch * (length / n) ** 1.5
                 for (a, n, b, _), t in timings.items() if a == arm]
        estimate = (min(known) if known else 5.0) * (2 + args.warmup)
        why = run.budget.why_not(estimate)
        if why:
            report.not_run(key, label, why)
            return None
        config = _speed_config(run, arch, length)
        while batch >= 1:
            with attempt(run, key, label):
                try:
                    timing = measure(run, config, _execution(run, arch, mode), batch, length,
                                     mode, args.repeats, args.warmup)
                except torch.cuda.OutOfMemoryError:
                    report.note(key, f"{label}: out of memory; halving the micro-batch")
                    batch //= 2
                    label = f"{arm} {length} tokens batch {batch} {mode}"
                    continue
                report.add(key, _speed_row(run, arm, config, batch, length, mode, timing, peak))
                timings[(arm, length, batch, mode)] = timing
                if _graphed(mode) and not timing.captures:
                    report.note(key, f"{label}: no CUDA graph was captured: this ran eagerly")
                return timing
            return None
        return None

    beta = "beta_1.2 t19_flash"
    time_arm("standard", short, 1, "eager")
    for mode in args.modes:
        time_arm(beta, short, 1, mode)
    ran = [(t.seconds, m) for (a, n, b, m), t in timings.items() if a == beta and b == 1]
    best = min(ran)[1] if ran else args.modes[0]
    report.note(key, f"the beta arm's fastest mode at micro-batch 1: {best}")
    for arm, length in ((beta, long), ("standard", short), (beta, short)):
        arch = "standard" if arm == "standard" else "beta12"
        mode = "eager" if arm == "standard" else best
        config = _speed_config(run, arch, length)
        batch, per_seq = largest_batch(run, config, _execution(run, arch, mode), length)
        report.note(key, f"{arm} at {length} tokens ({mode}): the memory model holds "
                         f"{per_seq / 2**30:.2f} GiB a sequence: micro-batch {batch}")
        if batch > 1 or length == long:
            time_arm(arm, length, batch, mode)
    label = f"profile of {beta} {short} tokens batch 1 eager"
    why = run.budget.why_not(4 * timings[(beta, short, 1, "eager")].seconds
                             if (beta, short, 1, "eager") in timings else 30.0)
    if why:
        report.not_run(key, label, why)
        return
    with attempt(run, key, label):
        torch.manual_seed(0)
        config = _speed_config(run, "beta12", short)
        model = _build(config, run.device, _execution(run, "beta12", "eager"))
        tokens = torch.randint(0, config.vocab_size, (1, short + 1), device=run.device)
        report.add(key, dict(arm=beta, tokens=short, batch=1, mode="eager (profiled)",
                             attention=model.attention_backend.name,
                             **profile_step(model, tokens)))


def section_targets(run: Run) -> None:
    """Each target of the GPU step against the speed section's rows: met, missed or not
    measured."""
    report, key, args = run.report, "targets", run.args
    short, long = args.lengths
    beta = "beta_1.2 t19_flash"
    rows = run.report.sections["speed"]["rows"]

    def find(arm: str, length: int, mode: str | None = None, batch: int | None = None):
        found = [r for r in rows if r["arm"] == arm and r["tokens"] == length
                 and (mode is None or r["mode"] == mode) and (batch is None or r["batch"] == batch)]
        return found

    def target(name: str, want: str, got: float | None, met: bool | None) -> None:
        report.add(key, dict(target=name, want=want, got="not measured" if got is None else got,
                             met="not measured" if met is None else met))

    graphed = find(beta, short, "graphed", 1)
    s = graphed[0]["s_per_step"] if graphed else None
    target(f"{short} tokens, micro-batch 1, graphed: s/step", f"<= {TARGET_GRAPHED_S}", s,
           None if s is None else s <= TARGET_GRAPHED_S)
    std = [r for r in find("standard", short) if r["batch"] > 1] or find("standard", short)
    ours = [r for r in find(beta, short) if r["batch"] > 1] or find(beta, short)
    ratio = (max(r["tokens_per_s"] for r in ours) / max(r["tokens_per_s"] for r in std)
             if std and ours else None)
    target(f"{short} tokens, largest micro-batches: beta tokens/s over the standard arm's",
           f">= {TARGET_TOKENS_RATIO:.2f}", ratio,
           None if ratio is None else ratio >= TARGET_TOKENS_RATIO)
    bound = [r["of_bound"] for r in find(beta, long) if "of_bound" in r]
    share = max(bound) if bound else None
    target(f"{long} tokens, largest micro-batch: of_bound", f">= {TARGET_OF_BOUND}", share,
           None if share is None else share >= TARGET_OF_BOUND)


SECTION_FUNCTIONS: dict[str, Callable[[Run], None]] = {
    "versions": section_versions, "speed": section_speed, "targets": section_targets}


# ---- entry point --------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="megabeta bench gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device to time (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes everywhere: the whole script in a minute on a CPU")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="time budget of the whole run in seconds; what no longer fits is "
                             "skipped and listed (default: %(default)s)")
    parser.add_argument("--out", default=".",
                        help="directory for gpu.json and gpu.md when $OUT is not set")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help="comma-separated sections to run (default: all: %(default)s)")
    parser.add_argument("--attention", default=None,
                        help="execution.attention of the beta arm (default: triton on CUDA, "
                             "cpu on a CPU)")
    parser.add_argument("--modes", default="graphed,eager,compiled",
                        help="the beta arm's modes at micro-batch 1, in order (default: "
                             "%(default)s)")
    parser.add_argument("--lengths", default=None,
                        help="the short and the long sequence length (default: 4096,16384; "
                             "--quick: 64,128)")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="cap on the memory model's micro-batch (default: 64; --quick: 4)")
    parser.add_argument("--cpu-memory-gib", type=float, default=4.0,
                        help="the memory a CPU run plans micro-batches for (default: 4)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed steps per measurement (default: 3; --quick: 1)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps after the first (default: 1; --quick: 0)")
    args = parser.parse_args(argv)
    if args.attention is None:
        args.attention = "triton" if args.device.startswith("cuda") else "cpu"
    defaults = dict(lengths=("64,128", "4096,16384"), max_batch=(4, 64), repeats=(1, 3),
                    warmup=(0, 1))
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(f"argument --sections: unknown {sorted(unknown)}; choose from "
                     f"{', '.join(SECTIONS)} (the device's exactness checks are tests: "
                     f"pytest -m gpu tests)")
    modes = args.modes.split(",")
    if not modes or set(modes) - set(MODES):
        parser.error(f"argument --modes: unknown {sorted(set(modes) - set(MODES))}; choose from "
                     f"{', '.join(MODES)}")
    args.modes = modes
    try:
        args.lengths = tuple(int(n) for n in args.lengths.split(","))
    except ValueError:
        parser.error(f"argument --lengths: {args.lengths!r} is not two integers 'SHORT,LONG'")
    if len(args.lengths) != 2 or not 0 < args.lengths[0] <= args.lengths[1]:
        parser.error(f"argument --lengths: need 0 < SHORT <= LONG, got {args.lengths}")
    for flag in ("max_batch", "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"argument --{flag.replace('_', '-')}: must be >= 1")
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
