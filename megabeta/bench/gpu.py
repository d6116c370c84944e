"""The device check for one CUDA GPU: kernels, model exactness, speed and MFU, in one script.

    python -m megabeta.bench gpu                       # on the GPU machine (megabeta bench gpu)
    python -m megabeta.bench gpu --device cpu --quick  # the same plumbing, tiny, on a CPU

Sections, in order:

1. versions and features: torch, CUDA, triton, the device, bf16, TF32, and whether
   `execution.attention = "triton"` and `execution.elementwise_kernels = "triton"` can
   be selected (a tiny model is built with each);
2. kernel checks, forward and backward, fp32 and bf16, against float64 CPU references: the Triton
   block attention (megabeta/kernels/triton_attention.py) at t19_flash's shapes and the fused
   elementwise kernels (megabeta/kernels/triton_elementwise.py) against megabeta.model.layers;
3. model exactness on the device for the triton attention backend:
   beta_1.2 at c = T equals the standard arm, prefill + steps equal the forward, and beta_1.2 at
   c = 8 equals the float64 explicit backend (logits, loss, fp32 gradients);
4. the wavefront schedule (megabeta/bench/wavefront.py, paired in one process): beta_1.2_test
   (c = 32, batch 8 x 512) on the block and the wavefront schedule next to the standard arm
   (FLOP/s ratios), kernel-launching dispatches per step of either schedule on this device, and
   t19_flash wavefront against block time;
5. speed: t19_flash forward+backward with block checkpointing under bf16 autocast at 4096 and
   16384 tokens, micro-batch 1 and the largest that fits, eager / compiled / CUDA-graphed, and
   on the wavefront schedule with wave checkpointing, next to the standard arm of the same
   shape: s/step, tokens/s, MFU, peak memory;
6. the article's §7 arms at batch 16 next to its 0.876 / 0.124 / 0.094 s/batch.

Time: everything runs within --budget-s seconds (default 420); what no longer fits is skipped and
listed with the reason, as is everything that cannot run here, and a failing check records its
error and the script goes on. Output: gpu.json and gpu.md (Markdown tables) in $OUT when set,
else in --out (default: the current directory), rewritten after every section; progress lines
on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
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
from megabeta.model.attention.backend import per_query_head  # noqa: E402
from megabeta.model.flops import training_flops  # noqa: E402
from megabeta.parallel.wrap import apply_compile  # noqa: E402
from megabeta.train.metrics import device_peak_flops  # noqa: E402

KERNEL_TOL = {"fp32": 1e-4, "bf16": 2e-2}
"""Kernel checks: max |kernel - float64 reference| over max |reference|, per output tensor."""
MODEL_TOL = {"fp32": 1e-4, "bf16": 5e-2}
"""Model checks (logits, loss), relative to the reference's largest magnitude as above."""
GRAD_TOL = {"fp32": 1e-3, "bf16": 5e-2}
"""Model parameter gradients (a few layers of rounding more than one kernel)."""
GRAD_FLOOR = {"fp32": 1e-3, "bf16": 1e-2}
"""Smallest gradient scale, as a fraction of the largest parameter gradient (see `rel_err`):
bf16 rounds the largest gradients at about 1e-2 of their scale, so a small gradient is judged
against that."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ARTICLE_S_PER_BATCH = {"beta_1.2_test": 0.876, "beta_1.2_c256": 0.124, "t16_std_tf_rope": 0.094}
"""Article §7.1: s/batch at B = 16 (its sequence length is not stated; --article-seq-len)."""
SECTIONS = ("versions", "kernels", "exactness", "wavefront", "speed", "article")
TITLES = {"versions": "Versions and features", "kernels": "Kernel checks (forward and backward)",
          "exactness": "Model exactness on the device",
          "wavefront": "The wavefront schedule (paired)", "speed": "Speed: t19_flash",
          "article": "The article's §7 arms at batch 16"}
MODES = {"eager": dict(activation_checkpoint="block"),
         "compiled": dict(activation_checkpoint="block", compile=True),
         "graphed": dict(activation_checkpoint="block", cuda_graphs=True),
         "wavefront": dict(schedule="wavefront", activation_checkpoint="wave")}
"""The speed section's modes: the beta arm's execution settings."""
SETTINGS = {"attention=triton": dict(attention="triton"),
            "elementwise_kernels=triton": dict(elementwise_kernels="triton")}
"""The execution settings whose availability section 1 probes (and later sections rely on)."""
ARTICLE_RESERVE_S = {"cuda": 60.0, "cpu": 8.0}
"""Budget kept for section 6 while section 5 runs (its three arms, warm-up and timing)."""
SHARE_END = {"kernels": 0.25, "exactness": 0.45, "wavefront": 0.55}
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
        shown = {k: v for k, v in row.items() if k != "errors"}
        self.log(f"  {' | '.join(_fmt(v) for v in shown.values())}")

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

    def failures(self) -> list[tuple[str, dict[str, Any]]]:
        return [(key, row) for key, sec in self.sections.items() for row in sec["rows"]
                if row.get("verdict") == "FAIL"]

    def summary(self) -> dict[str, int]:
        rows = [r for sec in self.sections.values() for r in sec["rows"]]
        return dict(passed=sum(r.get("verdict") == "pass" for r in rows),
                    failed=len(self.failures()),
                    not_run=sum(len(sec["not_run"]) for sec in self.sections.values()),
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
                 f"- checks: {s['passed']} passed, {s['failed']} FAILED, {s['not_run']} not run, "
                 f"{s['errors']} errors", ""]
        for failed_section, row in self.failures():
            lines.append(f"- **FAILED** ({failed_section}): {_row_label(row)}")
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
    return ", ".join(f"{k} {_fmt(v)}" for k, v in row.items() if k not in ("errors", "verdict"))


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


# ---- comparisons --------------------------------------------------------------------------------

def rel_err(got: Tensor | None, want: Tensor, floor: float = 0.0) -> float:
    """max |got - want| / max(max |want|, floor) (float64, on the CPU); inf for a missing
    tensor or a shape mismatch, nan when `got` holds NaN. `floor`: the scale of a reference
    that is (near) zero, e.g. the gradient of a parameter the loss does not depend on."""
    if got is None:
        return math.inf
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got.shape != want.shape:
        return math.inf
    if not want.numel():
        return 0.0
    err = (got - want).abs().max().item()
    scale = max(want.abs().max().item(), floor)
    return err / scale if scale > 0 else (0.0 if err == 0 else math.inf)


def verdict(errors: dict[str, float], tol: float) -> str:
    """`pass` when every error is within `tol` (NaN is not), else `FAIL`."""
    return "pass" if errors and all(e <= tol for e in errors.values()) else "FAIL"


def _check_row(check: str, case: str, dtype: str, errors: dict[str, float],
               tol: float) -> dict[str, Any]:
    worst = max(errors, key=lambda k: math.inf if errors[k] != errors[k] else errors[k])
    return dict(check=check, case=case, dtype=dtype, tol=tol,
                worst=f"{worst} {_fmt(errors[worst])}", verdict=verdict(errors, tol),
                errors=errors)


def _round_to(t: Tensor, dtype: torch.dtype) -> Tensor:
    """float64 values that `dtype` represents exactly: one reference serves every dtype."""
    return t.to(dtype).double()


def _value_and_grads(fn: Callable[..., Tensor | tuple[Tensor, ...]], inputs: dict[str, Tensor],
                     weights: list[Tensor]) -> dict[str, Tensor]:
    """`fn`'s outputs (`out0`, …) and the gradients (`d<name>`; zero where unused) of
    `Σ out·weight` w.r.t. the inputs (fresh leaves)."""
    leaves = {k: t.detach().clone().requires_grad_() for k, t in inputs.items()}
    out = fn(*leaves.values())
    outs = list(out) if isinstance(out, tuple) else [out]
    loss = sum((o * w.to(o.device, o.dtype)).sum() for o, w in zip(outs, weights))
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves.values(), grads)]
    result = {f"out{i}" if len(outs) > 1 else "out": o for i, o in enumerate(outs)}
    result.update({f"d{k}": g for k, g in zip(leaves, grads)})
    return result


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
    # fp32 checks compare against float64: TF32 would be a 1e-3 error of its own.
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    report.note(key, "this run sets float32 matmul precision 'highest' and cuDNN TF32 off, so "
                     "fp32 checks see IEEE float32 products")
    for name, execution in SETTINGS.items():
        why, what = _probe(run, execution)
        if why is not None:
            run.unavailable[name] = why
        report.add(key, dict(item=f"execution.{name.replace('=', ' = ')}",
                             value=what if why is None else f"{what}: {why}"))


# ---- section 2: kernel checks -------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionCase:
    """One block attention call: a block of `n` queries at `layer` starting at `start`, reading
    groups `sources` of a `[layers, batch, kv_heads, length, head_dim]` history."""

    name: str
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    n: int
    layers: int
    length: int
    start: int
    sources: tuple[int, ...]
    layer: int
    window: int

    def lo(self, source: int) -> int:
        """First history row group `source` reads (history.group_rows)."""
        deeper = self.window > 0 and source > self.layer
        return max(0, self.start - self.window) if deeper else 0

    def label(self) -> str:
        return (f"{self.name}: B{self.batch} H{self.heads}/{self.kv_heads} d{self.head_dim} "
                f"n{self.n} sources {list(self.sources)} at layer {self.layer} T{self.length} "
                f"start {self.start} window {self.window}")


def attention_cases(quick: bool) -> list[AttentionCase]:
    """t19_flash's shapes (d_h 200, 8 heads, c = 32, 3 groups, T = 4096) with GQA and a deep-token
    window; --quick: the same structure at interpreter sizes (d_h 24, ragged tiles)."""
    if quick:
        return [AttentionCase("mha", 1, 2, 2, 24, 8, 3, 40, 24, (0, 1, 2), 0, 0),
                AttentionCase("gqa+window", 2, 2, 1, 24, 8, 4, 40, 24, (1, 2, 3), 1, 10),
                AttentionCase("one block", 1, 2, 1, 24, 8, 0, 0, 0, (), 0, 0)]
    return [AttentionCase("t19 mha", 1, 8, 8, 200, 32, 4, 4096, 2080, (0, 1, 2), 0, 0),
            AttentionCase("t19 gqa+window", 2, 8, 2, 200, 32, 4, 4096, 2080, (1, 2, 3), 1, 1000),
            AttentionCase("t19 one block", 1, 8, 8, 200, 32, 0, 0, 0, (), 0, 0)]


def attention_inputs(case: AttentionCase, seed: int = 0) -> dict[str, Tensor]:
    """float64 CPU inputs, all representable in bfloat16: `q, k, v, hist_k, hist_v, shift,
    self_bias`, the output weights `grad` and the gradient buffers' earlier content
    `prior_k, prior_v` (the kernel must ADD to it)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0, offset: float = 0.0) -> Tensor:
        t = torch.randn(*shape, generator=gen, dtype=torch.float64) * scale + offset
        return _round_to(t, torch.bfloat16)

    b, h, hkv, d, n = case.batch, case.heads, case.kv_heads, case.head_dim, case.n
    hist = (case.layers, b, hkv, case.length, d)
    return dict(q=rand(b, h, n, d), k=rand(b, hkv, n, d), v=rand(b, hkv, n, d),
                hist_k=rand(*hist), hist_v=rand(*hist),
                shift=_round_to(torch.rand(len(case.sources), h, generator=gen,
                                           dtype=torch.float64) * 2, torch.bfloat16),
                self_bias=rand(1, scale=0.3, offset=1.5), grad=rand(b, h, n, d),
                prior_k=rand(*hist, scale=0.1), prior_v=rand(*hist, scale=0.1))


def reference_block_attention(q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor,
                              shift: Tensor, self_bias: Tensor, case: AttentionCase) -> Tensor:
    """The block attention contract as one explicit softmax: group g's rows [lo_g, start) of
    hist[sources[g]] with score minus shift[g, h], then the causal own keys with b_σ on the
    diagonal; scores q·k/√d."""
    heads, n = q.shape[1], q.shape[2]
    keys, values, bias = [], [], []
    for g, m in enumerate(case.sources):
        rows = slice(case.lo(m), case.start)
        keys.append(hist_k[m, :, :, rows])
        values.append(hist_v[m, :, :, rows])
        bias.append((-shift[g]).view(heads, 1, 1).expand(heads, n, rows.stop - rows.start))
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    square = q.new_zeros(n, n).masked_fill(~causal, float("-inf"))
    bias.append((square + torch.eye(n, dtype=q.dtype) * self_bias).expand(heads, n, n))
    keys_all = per_query_head(torch.cat([*keys, k], dim=2), heads)
    values_all = per_query_head(torch.cat([*values, v], dim=2), heads)
    scores = q @ keys_all.transpose(-1, -2) / math.sqrt(q.shape[-1]) + torch.cat(bias, dim=2)
    return torch.softmax(scores, dim=-1) @ values_all


def _reference_attention_grads(case: AttentionCase, inputs: dict[str, Tensor]
                               ) -> dict[str, Tensor]:
    names = ("q", "k", "v", "hist_k", "hist_v", "shift", "self_bias")
    got = _value_and_grads(lambda *xs: reference_block_attention(*xs, case),
                           {k: inputs[k] for k in names}, [inputs["grad"]])
    return {("d_" + k[1:] if k.startswith("d") else k): t for k, t in got.items()}


def run_block_attention(case: AttentionCase, inputs: dict[str, Tensor], dtype: torch.dtype,
                        device: torch.device) -> dict[str, Tensor]:
    """`triton_attention.block_attention` forward and backward as the triton backend calls it:
    rows >= start of the history are NaN (never to be read), the start a 0-d view of a position
    table, the gradient buffers float32 holding `prior_*` (to be added to)."""
    from megabeta.kernels import triton_attention

    def leaf(name: str, kind: torch.dtype = dtype) -> Tensor:
        return inputs[name].to(device, kind).requires_grad_()

    q, k, v = leaf("q"), leaf("k"), leaf("v")
    shift, self_bias = leaf("shift", torch.float32), leaf("self_bias", torch.float32)
    if case.sources:
        hist_k, hist_v = (inputs[n].to(device, dtype) for n in ("hist_k", "hist_v"))
        hist_k[:, :, :, case.start:] = float("nan")
        hist_v[:, :, :, case.start:] = float("nan")
        grad_k, grad_v = (inputs[n].to(device, torch.float32) for n in ("prior_k", "prior_v"))
        start = torch.arange(case.length, device=device)[case.start]
    else:
        hist_k = hist_v = grad_k = grad_v = q.new_empty(0)
        start = torch.zeros((), dtype=torch.int64, device=device)
    out = triton_attention.block_attention(
        q, k, v, hist_k, hist_v, grad_k, grad_v, start, shift, self_bias,
        sources=list(case.sources), layer=case.layer, window=case.window,
        scale=1.0 / math.sqrt(case.head_dim))
    out.backward(inputs["grad"].to(device, dtype))
    result = dict(out=out, d_q=q.grad, d_k=k.grad, d_v=v.grad, d_shift=shift.grad,
                  d_self_bias=self_bias.grad)
    if case.sources:
        result["d_hist_k"] = grad_k.double().cpu() - inputs["prior_k"].float().double()
        result["d_hist_v"] = grad_v.double().cpu() - inputs["prior_v"].float().double()
    return result


def check_block_attention(run: Run, case: AttentionCase, dtypes: list[str]) -> None:
    """Rows of the block attention kernel against the float64 reference, one per dtype."""
    inputs = attention_inputs(case)
    want = _reference_attention_grads(case, inputs)
    if not case.sources:
        want = {k: t for k, t in want.items() if not k.startswith("d_hist")}
    for name in dtypes:
        with attempt(run, "kernels", f"block_attention {case.name} {name}"):
            got = run_block_attention(case, inputs, DTYPES[name], run.device)
            errors = {k: rel_err(got[k], want[k]) for k in want}
            run.report.add("kernels", _check_row("block_attention", case.label(), name, errors,
                                                 KERNEL_TOL[name]))


def cell_cases(quick: bool) -> dict[str, tuple[int, ...]]:
    """Shapes: rows `[B, n, d]`, the projection `[B, n, heads·d_h]` as (B, n, rotary heads,
    plain heads, d_h) and SwiGLU's `[B, n, 2h]`; t19_flash's widths (d 1600, d_h 200, hidden
    3200, one c = 32 block's finished + input projection: 24 rotary heads, 16 plain)."""
    if quick:
        return dict(rows=(2, 9, 40), heads=(2, 9, 3, 2, 8), gate_up=(2, 9, 2 * 24))
    return dict(rows=(4, 32, 1600), heads=(4, 32, 24, 16, 200), gate_up=(4, 32, 2 * 3200))


def check_elementwise_kernels(run: Run, dtypes: list[str]) -> None:
    """The Triton elementwise kernels against the torch functions of megabeta.model.layers run in
    float64, forward and backward."""
    from megabeta.kernels import triton_elementwise
    from megabeta.model import layers

    shapes = cell_cases(run.quick)
    gen = torch.Generator().manual_seed(1)
    eps = 1e-6
    batch, n, rotary, plain, head_dim = shapes["heads"]
    # RoPE tables rounded to bf16, so the float64 reference sees the numbers the kernel reads;
    # the kernel gets them in the inputs' dtype, as DecoderLM.rope gives them.
    cos, sin = (_round_to(t, torch.bfloat16) for t in layers.rope_tables(head_dim, 100, n, 1e4))
    rope = dict(rotary_heads=rotary, head_dim=head_dim)
    projection = (batch, n, (rotary + plain) * head_dim)

    kernels: dict[str, tuple[list[tuple[int, ...]], Callable[..., Any], Callable[..., Any]]] = {
        "rms_normalize": ([shapes["rows"]], lambda x: triton_elementwise.rms_normalize(x, eps),
                          lambda x: layers.rms_normalize(x, eps)),
        "add_rms_normalize": ([shapes["rows"]] * 2,
                              lambda x, d: triton_elementwise.add_rms_normalize(x, d, eps),
                              lambda x, d: layers.add_rms_normalize(x, d, eps)),
        "split_heads_rope": ([projection],
                             lambda y: triton_elementwise.split_heads_rope(y, cos.to(y), sin.to(y),
                                                                    **rope),
                             lambda y: layers.split_heads_rope(y, cos, sin, **rope)),
        "swiglu": ([shapes["gate_up"]], lambda x: triton_elementwise.swiglu(x), layers.swiglu),
    }
    for kernel, (input_shapes, fn, reference) in kernels.items():
        inputs = {f"x{i}": _round_to(torch.randn(*shape, generator=gen, dtype=torch.float64),
                                     torch.bfloat16)
                  for i, shape in enumerate(input_shapes)}
        outputs = reference(*inputs.values())
        weights = [_round_to(torch.randn(o.shape, generator=gen, dtype=torch.float64),
                             torch.bfloat16)
                   for o in (outputs if isinstance(outputs, tuple) else (outputs,))]
        want = _value_and_grads(reference, inputs, weights)
        label = " and ".join(f"[{', '.join(map(str, shape))}]" for shape in input_shapes) + (
            f", {rotary} rotary + {plain} plain heads of {head_dim}"
            if kernel == "split_heads_rope" else "")
        for name in dtypes:
            with attempt(run, "kernels", f"{kernel} {name}"):
                got = _value_and_grads(fn, {k: x.to(run.device, DTYPES[name])
                                            for k, x in inputs.items()}, weights)
                errors = {k: rel_err(got[k], want[k]) for k in want}
                run.report.add("kernels", _check_row(kernel, label, name, errors,
                                                     KERNEL_TOL[name]))


def section_kernels(run: Run) -> None:
    report, key = run.report, "kernels"
    report.note(key, "error = max |kernel - float64 CPU reference| / max |reference| per output "
                     "and gradient; inputs are bf16-representable, so one reference serves both "
                     f"dtypes; tolerances fp32 {KERNEL_TOL['fp32']}, bf16 {KERNEL_TOL['bf16']}")
    dtypes = ["fp32", "bf16"]
    if not run.cuda:
        dtypes = ["fp32"]
        for what in ("block_attention bf16", "elementwise kernels bf16"):
            report.not_run(key, what, "no GPU: Triton's CPU interpreter gets bfloat16 wrong "
                                      "(tl.dot, triton#11584), so bf16 is checked on a GPU only")
    try:
        from megabeta.kernels import triton_attention  # noqa: F401
        attention_ok = None if triton_attention.available() else "triton is not importable"
    except ImportError as exc:
        attention_ok = f"megabeta.kernels.triton_attention does not import: {exc}"
    estimate = 20.0 if run.cuda else 4.0
    for case in attention_cases(run.quick):
        if attention_ok:
            report.not_run(key, f"block_attention {case.name}", attention_ok)
            continue
        why = run.budget.why_not(estimate, run.reserve(key))
        if why:
            report.not_run(key, f"block_attention {case.name}", why)
            continue
        with attempt(run, key, f"block_attention {case.name}"):
            check_block_attention(run, case, dtypes)
    try:
        from megabeta.kernels import triton_elementwise  # noqa: F401
        cell_ok = None
    except ImportError as exc:
        cell_ok = f"megabeta.kernels.triton_elementwise does not import: {exc}"
    why = cell_ok or run.budget.why_not(estimate, run.reserve(key))
    if why:
        report.not_run(key, "elementwise kernels (rms_normalize, split_heads_rope, swiglu)", why)
    else:
        check_elementwise_kernels(run, dtypes)


# ---- section 3: model exactness -----------------------------------------------------------------

def _randomise(model: DecoderLM, seed: int) -> DecoderLM:
    """Non-trivial weights: matrices with unit-scale outputs (attention far from uniform), norm
    weights away from one, every beta extra non-zero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                value = torch.rand(p.shape, generator=gen, dtype=torch.float64) + 0.5
            elif p.dim() == 2:
                value = torch.randn(p.shape, generator=gen, dtype=torch.float64) / p.shape[1] ** 0.5
            else:
                value = torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5
            p.copy_(value)
    return model


def _reference(config: ModelConfig, seed: int = 0) -> DecoderLM:
    """The float64 CPU model on the explicit backend, randomised."""
    torch.manual_seed(seed)
    return _randomise(build_model(config, ExecutionConfig(attention="explicit")).double(), seed)


def _on_device(run: Run, reference: DecoderLM, dtype: torch.dtype, **execution: Any) -> DecoderLM:
    model = _build(reference.config, run.device, ExecutionConfig(**execution))
    model.load_state_dict(reference.state_dict())
    return model.to(dtype)


def _exact_shape(quick: bool) -> tuple[dict[str, Any], int, int]:
    """(config fields, sequence length, prompt length): a ragged last block, a prompt ending
    inside a block."""
    if quick:
        return dict(vocab_size=61, d_model=32, hidden_dim=48, num_heads=4, num_layers=3,
                    block_size=8, depth_window=2, max_seq_len=64), 19, 11
    return dict(vocab_size=97, d_model=160, hidden_dim=224, num_heads=4, num_layers=3,
                block_size=8, depth_window=2, max_seq_len=128), 45, 13


def _tokens(vocab: int, batch: int, length: int, seed: int) -> Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _runs(model: DecoderLM) -> str:
    """What the model really runs (a setting may map to another backend on this device)."""
    return f"; runs {model.attention_backend.name}, elementwise kernels {model.elementwise_kernels.name}"


def _grads(model: DecoderLM) -> dict[str, Tensor]:
    return {n: torch.zeros_like(p) if p.grad is None else p.grad
            for n, p in model.named_parameters()}


def check_one_block(run: Run, backend: str, dtype_name: str, fields: dict[str, Any], *,
                    length: int, case: str) -> None:
    """beta_1.2 at c = T (b_σ = 0, f = 0) against the standard arm with the same weights."""
    config = ModelConfig(**dict(fields, block_size=length))
    beta = _reference(config)
    with torch.no_grad():
        for layer in beta.layers:
            layer.attention.self_bias.zero_()
            layer.attention.f_q.zero_()
    standard = build_model(config.replace(arch="standard"),
                           ExecutionConfig(attention="explicit")).double()
    standard.load_state_dict(beta.state_dict(), strict=False)
    x = _tokens(config.vocab_size, 2, length, 1)
    want = standard(x)
    dtype = DTYPES[dtype_name]
    model = _on_device(run, beta, dtype, attention=backend)
    with torch.no_grad():
        got = model(x.to(run.device))
        twin = _on_device(run, standard, dtype, attention=backend)(x.to(run.device))
    errors = {"logits vs float64 standard": rel_err(got, want),
              "vs standard on device": rel_err(got, twin)}
    run.report.add("exactness", _check_row(f"{backend}: c = T equals standard",
                                           f"{case}, T {length}{_runs(model)}", dtype_name,
                                           errors, MODEL_TOL[dtype_name]))


def check_decoding(run: Run, backend: str, dtype_name: str, fields: dict[str, Any], *,
                   length: int, prompt: int, case: str) -> None:
    """Prefill of a prompt ending inside a block, then one step per token, equals the forward."""
    config = ModelConfig(**fields)
    model = _on_device(run, _reference(config), DTYPES[dtype_name], attention=backend).eval()
    x = _tokens(config.vocab_size, 2, length, 1).to(run.device)
    with torch.no_grad():
        full = model(x)
        logits, cache = model.prefill(x[:, :prompt])
        steps = [logits] + [model.step(x[:, t], cache)[:, None] for t in range(prompt, length)]
    errors = {"prefill+steps vs forward": rel_err(torch.cat(steps, dim=1), full)}
    run.report.add("exactness", _check_row(f"{backend}: prefill + step = forward",
                                           f"{case}, c {config.block_size}, prompt {prompt} of "
                                           f"{length}{_runs(model)}", dtype_name, errors,
                                           MODEL_TOL[dtype_name]))


def check_against_explicit(run: Run, backend: str, dtype_name: str, fields: dict[str, Any], *,
                           length: int, case: str) -> None:
    """beta_1.2 at c = 8 on `backend` against the float64 CPU explicit backend: logits, loss and
    every parameter's gradient, with block checkpointing as in training."""
    config = ModelConfig(**fields)
    reference = _reference(config)
    x, y = _tokens(config.vocab_size, 2, length, 1), _tokens(config.vocab_size, 2, length, 2)
    with torch.no_grad():
        want_logits = reference(x)
    want_loss = reference(x, y)
    want_loss.backward()
    model = _on_device(run, reference, DTYPES[dtype_name], attention=backend,
                       activation_checkpoint="block")
    with torch.no_grad():
        got_logits = model(x.to(run.device))
    loss = model(x.to(run.device), y.to(run.device))
    errors = {"logits": rel_err(got_logits, want_logits), "loss": rel_err(loss, want_loss)}
    check = f"{backend}: c = {config.block_size} equals explicit"
    label = f"{case}, T {length}{_runs(model)}"
    run.report.add("exactness", _check_row(check, label, dtype_name, errors,
                                           MODEL_TOL[dtype_name]))
    loss.backward()
    want, got = _grads(reference), _grads(model)
    # A parameter without influence (θ of a layer that reads no deeper group) has a zero
    # reference gradient: its error is measured against the largest gradient's scale.
    floor = GRAD_FLOOR[dtype_name] * max(g.abs().max().item() for g in want.values())
    grads = {f"d {n}": rel_err(got[n], want[n], floor) for n in want}
    run.report.add("exactness", _check_row(check + " (gradients)", label, dtype_name, grads,
                                           GRAD_TOL[dtype_name]))


def check_static_step(run: Run, backend: str, dtype_name: str, fields: dict[str, Any], *,
                      length: int, case: str, mode: str) -> None:
    """The static block step, compiled (`mode` "compiled": execution.compile) or captured in
    CUDA graphs ("graphed": execution.cuda_graphs), against the eager block loop on the same
    device and weights: loss and every parameter's gradient over two training steps with
    block checkpointing; and how many graphs it took (one compiled graph; two CUDA graphs)."""
    config = ModelConfig(**fields)
    reference = _reference(config)
    dtype = DTYPES[dtype_name]
    execution = dict(attention=backend, activation_checkpoint="block")
    eager = _on_device(run, reference, dtype, **execution)
    model = _on_device(run, reference, dtype, cuda_graphs=mode == "graphed", **execution)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    if mode == "compiled":
        apply_compile(model)
    captures = count_graph_captures() if run.cuda else contextlib.nullcontext([0])
    errors: dict[str, float] = {}
    with captures as count:
        for step in range(2):
            x = _tokens(config.vocab_size, 2, length, 1 + step).to(run.device)
            y = _tokens(config.vocab_size, 2, length, 3 + step).to(run.device)
            results = []
            for m in (eager, model):
                m.zero_grad(set_to_none=True)
                loss = m(x, y)
                loss.backward()
                results.append((loss.detach(), _grads(m)))
            (want_loss, want), (got_loss, got) = results
            floor = GRAD_FLOOR[dtype_name] * max(g.abs().max().item() for g in want.values())
            errors[f"step {step} loss"] = rel_err(got_loss, want_loss)
            errors[f"step {step} gradients (worst)"] = max(rel_err(got[n], want[n], floor)
                                                           for n in want)
    graphs = (torch._dynamo.utils.counters["stats"]["unique_graphs"] if mode == "compiled"
              else count[0])
    label = (f"{case}, T {length}, c {config.block_size}{_runs(model)}; "
             f"{'compiled graphs' if mode == 'compiled' else 'CUDA graphs captured'}: {graphs}")
    row = _check_row(f"{backend}: {mode} block step equals eager", label, dtype_name, errors,
                     GRAD_TOL[dtype_name])
    want_graphs = 1 if mode == "compiled" else 2
    if graphs != want_graphs:
        row["verdict"] = "FAIL"
        row["why"] = f"{graphs} graphs, expected {want_graphs}"
    run.report.add("exactness", row)


def check_wavefront(run: Run, backend: str, dtype_name: str, fields: dict[str, Any], *,
                    length: int, case: str) -> None:
    """The wavefront schedule with wave checkpointing against the block schedule on the same
    device and weights: loss and every parameter's gradient of one training step."""
    config = ModelConfig(**fields)
    reference = _reference(config)
    dtype = DTYPES[dtype_name]
    models = [_on_device(run, reference, dtype, attention=backend, **execution)
              for execution in (dict(activation_checkpoint="block"),
                                dict(schedule="wavefront", activation_checkpoint="wave"))]
    x = _tokens(config.vocab_size, 2, length, 1).to(run.device)
    y = _tokens(config.vocab_size, 2, length, 3).to(run.device)
    results = []
    for m in models:
        loss = m(x, y)
        loss.backward()
        results.append((loss.detach(), _grads(m)))
    (want_loss, want), (got_loss, got) = results
    floor = GRAD_FLOOR[dtype_name] * max(g.abs().max().item() for g in want.values())
    errors = {"loss": rel_err(got_loss, want_loss),
              "gradients (worst)": max(rel_err(got[n], want[n], floor) for n in want)}
    run.report.add("exactness", _check_row(
        f"{backend}: wavefront equals block schedule",
        f"{case}, T {length}, c {config.block_size}{_runs(models[1])}", dtype_name, errors,
        GRAD_TOL[dtype_name]))


def section_exactness(run: Run) -> None:
    report, key = run.report, "exactness"
    report.note(key, f"error = max |device - reference| / max |reference|; tolerances fp32 "
                     f"{MODEL_TOL['fp32']}, bf16 {MODEL_TOL['bf16']} (bf16 parameters); "
                     f"parameter gradients within {GRAD_TOL} of max(their own scale, "
                     f"{GRAD_FLOOR} x the largest gradient's) by dtype; references: float64 "
                     "CPU on the explicit backend")
    fields, length, prompt = _exact_shape(run.quick)
    cases = {"mha": fields, "gqa+window": dict(fields, num_kv_heads=2, deep_token_window=12)}
    if run.quick:
        del cases["gqa+window"]
        report.not_run(key, "gqa+window cases", "--quick runs the mha case only")
    estimate = 15.0 if run.cuda else 3.0
    for backend in ("triton",):
        why = run.unavailable.get(f"attention={backend}")
        if why:
            report.not_run(key, f"attention = {backend} (all checks)", why)
            continue
        dtypes = ["fp32"] if run.quick else ["fp32", "bf16"]
        if run.quick:
            report.not_run(key, f"attention = {backend}, bf16", "--quick checks fp32 only")
        elif backend == "triton" and not run.cuda:
            dtypes = ["fp32"]
            report.not_run(key, "attention = triton, bf16", "no GPU: the Triton interpreter "
                                                            "gets bfloat16 tl.dot wrong")
        for case, case_fields in cases.items():
            for dtype_name in dtypes:
                checks = {
                    "c = T equals standard": functools.partial(check_one_block, length=length),
                    "prefill + step": functools.partial(check_decoding, length=length,
                                                        prompt=prompt),
                    "c = 8 equals explicit": functools.partial(check_against_explicit,
                                                               length=length),
                    "wavefront": functools.partial(check_wavefront, length=length)}
                # Compiling takes a minute: the first case only.
                if backend == "triton" and dtype_name == "fp32" and case == "mha":
                    for mode in ("compiled", "graphed"):
                        if mode == "graphed" and not run.cuda:
                            report.not_run(key, f"{backend} graphed block step {case}",
                                           "CUDA graphs need a CUDA device")
                            continue
                        checks[f"{mode} block step"] = functools.partial(
                            check_static_step, length=length, mode=mode)
                for what, check in checks.items():
                    label = f"{backend} {what} {case} {dtype_name}"
                    why = run.budget.why_not(estimate, run.reserve("exactness"))
                    if why:
                        report.not_run(key, label, why)
                        continue
                    with attempt(run, key, label):
                        check(run, backend, dtype_name, case_fields, case=case)


# ---- sections 4-6: speed -------------------------------------------------------------------------

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
    if mode == "compiled":
        apply_compile(model)  # what TorchEngine does for execution.compile = true
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
    if mode == "graphed":
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
                     "fastest path, at the same batch, mode and precision (mode wavefront: "
                     "execution.schedule = wavefront with activation_checkpoint = wave for the "
                     "beta arm, compared with the eager rows: time_vs_block)")
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
        extra = {"compiled": args.compile_estimate_s, "graphed": 3 * base}.get(mode, 0.0)
        return 2 * (steps * base * batch + extra)  # two arms

    standard: dict[tuple[int, int], Timing] = {}
    """(length, batch) -> the standard arm's eager timing (the wavefront mode's base)."""
    block: dict[tuple[int, int], Timing] = {}
    """(length, batch) -> the beta arm's eager (block schedule) timing."""

    def arms(length: int, mode: str, batch: int) -> None:
        """Beta, then the standard arm, at one setting: a row each (the wavefront mode reuses
        the eager standard arm's timing: its schedule is beta12's alone)."""
        base = standard.get((length, batch)) if mode == "wavefront" else None
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
                if mode == "wavefront" and (length, batch) in block:
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
                if mode == "graphed" and not timing.captures:
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
    if "graphed" in modes and not run.cuda:
        modes.remove("graphed")
        report.not_run(key, "mode graphed (execution.cuda_graphs = true)",
                       "CUDA graphs need a CUDA device")
    tasks: list[tuple[str, int, str]] = [("b1", n, "eager") for n in lengths]
    tasks += [("compare", lengths[0], "eager"), ("profile", lengths[0], "eager")]
    if "wavefront" in modes:
        tasks += [("b1", n, "wavefront") for n in lengths]
    tasks += [("b1", lengths[0], mode) for mode in modes if mode != "wavefront"]
    tasks += [("max", n, "eager") for n in lengths]
    for mode in modes:
        tasks += [("b1", n, mode) for n in lengths[1:] if mode != "wavefront"]
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
    "versions": section_versions, "kernels": section_kernels, "exactness": section_exactness,
    "wavefront": section_wavefront, "speed": section_speed, "article": section_article}


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
                        help="execution.attention of the beta arms in sections 4-6 (default: "
                             "triton on CUDA, auto on CPU, where the Triton interpreter takes "
                             "seconds per call; 'auto' when it cannot be selected)")
    parser.add_argument("--compare-attention", default="",
                        help="comma-separated execution.attention values also timed on the "
                             "beta arm at the first length, batch 1, eager, next to --attention "
                             "(e.g. explicit; default: none)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="speed modes of section 5 (eager always runs; default: %(default)s)")
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
                        help="sequence length of section 6 (default: 1024; --quick: 64)")
    parser.add_argument("--article-batch", type=int, default=None,
                        help="batch of section 6 (default: 16, the article's; --quick: 2)")
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
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
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
    report.log(f"done: {summary['passed']} passed, {summary['failed']} FAILED, "
               f"{summary['not_run']} not run, {summary['errors']} errors; "
               f"{out_dir / 'gpu.md'}")
    return report


if __name__ == "__main__":
    main()
