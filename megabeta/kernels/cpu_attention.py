"""The `cpu` attention backend's fused C++ kernels (`cpu_attention.cpp`): a stack of cells'
attention over their own keys and their finished groups, forward and backward, in one online
softmax per query tile.

Built with torch's JIT extension loader the first time a process needs them (about 10 s with
g++; cached under `TORCH_EXTENSIONS_DIR`, by default `~/.cache/torch_extensions`), under
`jit_build.build_lock`: a lock left by a run killed while loading them does not stall the next
runs. They build for AVX-512 where torch runs its own kernels with it, else for AVX2 (`isa()`).
Where they cannot be built (no C++ compiler, a CPU without AVX2), attention selection
takes the `reference` backend instead (`build()` says whether they built; the reason is logged
once). They take float32 and float64 (`DTYPES`).

They are the "cpu" implementation of `megabeta::history_attention`
(`megabeta/kernels/history_attention.py`), registered on import: the implementation reads the
cells' starts on the host (a CPU tensor: no synchronisation) and hands the kernels each cell's
groups, and its backward adds the groups' key and value gradients into the history's gradient
buffers (its state, `[grad_k, grad_v]`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil

import torch
from torch import Tensor

from megabeta.kernels import history_attention, jit_build
from megabeta.kernels.history_attention import Cells, group_rows, row_major

log = logging.getLogger(__name__)

DTYPES = (torch.float32, torch.float64)

_SOURCE = os.path.join(os.path.dirname(__file__), "cpu_attention.cpp")

# at::vec's vectors (its exp is Sleef's, exported by libtorch_cpu) and OpenMP for
# at::parallel_for, which is inlined into the kernels. AVX-512 as ATen compiles its own
# AVX512 kernels.
_COMMON_FLAGS = ["-O3", "-fopenmp"]
_ISA_FLAGS = {
    "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
}
ISAS = tuple(_ISA_FLAGS)
"""The instruction sets the kernels build for."""


def isa() -> str | None:
    """The instruction set the kernels build for on this machine: torch's own CPU capability
    (`torch.backends.cpu.get_cpu_capability()`, which `ATEN_CPU_CAPABILITY=avx2` lowers), so
    that they run the vectors ATen's kernels run. None: neither AVX2 nor AVX-512.

    AVX-512 where the CPU has it: on a 2-core AMD EPYC the kernels run 1.2-1.35x AVX2's rate
    on a wave's cells and 1.7x on a standard cell (docs/benchmarks/2026-12-07-cpu-avx512.md)."""
    capability = torch.backends.cpu.get_cpu_capability()
    return capability if capability in _ISA_FLAGS else None


def flags(isa_name: str) -> list[str]:
    """The compiler flags of the build for `isa_name` (one of `ISAS`)."""
    return _COMMON_FLAGS + _ISA_FLAGS[isa_name]


@functools.lru_cache(maxsize=None)
def build() -> bool:
    """Build (or find the cached build of) the kernels for this machine's instruction set
    (`isa()`) and register them as `torch.ops.megabeta_cpu.*`; False, with the reason logged
    once, where they cannot be built."""
    target = isa()
    if platform.machine() not in ("x86_64", "AMD64"):
        reason = f"they are written for x86-64 with AVX2, this machine is {platform.machine()}"
    elif target is None:
        reason = "this CPU lacks AVX2"
    else:
        try:
            from torch.utils.cpp_extension import load

            _put_ninja_on_path()
            name = build_name(target)
            with jit_build.build_lock(name):
                load(name=name, sources=[_SOURCE], extra_cflags=flags(target),
                     extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
            return True
        except Exception as error:  # noqa: BLE001 - any build failure means: use the fallback
            reason = f"building it failed ({type(error).__name__}: {str(error).strip()[:300]})"
    log.warning("megabeta: the fused CPU attention kernels are unavailable, attention takes the "
                "reference backend (slow): %s", reason)
    return False


def build_name(isa_name: str | None = None) -> str:
    """The name of the build for `isa_name` (default: this machine's, `isa()`), and so its
    folder in torch's extension cache: named by the source and flags, so that two checkouts
    of another version on one machine (or a run while another rebuilds) never load or
    overwrite each other's library."""
    chosen = flags(isa_name or isa() or "AVX2")
    digest = hashlib.sha256(open(_SOURCE, "rb").read() + " ".join(chosen).encode()).hexdigest()
    return f"megabeta_cpu_attention_{digest[:12]}"


def _put_ninja_on_path() -> None:
    """torch's loader runs `ninja` from PATH; the `ninja` package's binary sits in the
    environment's scripts folder, which is not on PATH when the venv is not activated."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def supports(dtype: torch.dtype) -> bool:
    """Whether the kernels take tensors of `dtype` (once `build()` succeeded)."""
    return dtype in DTYPES


def forward(q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor, shift: Tensor,
            self_bias: Tensor | None, lower: Tensor | None, starts: list[int],
            groups: list[int], scale: float) -> tuple[Tensor, Tensor]:
    """Attention of `q [cells, B, H, n, d]` over own keys `k, v [cells, B, H_kv, nk, d]`
    (nk >= n: query r is own key nk - n + r; causal, b_σ `self_bias [cells]` on the diagonal)
    and each cell's finished groups: `groups` flattened as (cell, source layer, first row, end
    row, g) for every group, read from `hist_k, hist_v [L, B, H_kv, T, d]` (empty: none) with
    score minus `shift[cell, g, h]` (`[cells, G, H]`). `starts`: each cell's block start (the
    own keys' first position); `lower [cells, B, n]` int64: each query's document bound (spec
    §7), or None. One dtype (float32, float64), contiguous last dimensions. Returns the output
    (a transposed view of `[cells, B, n, H, d]`) and lse `[cells, B, H, n]`."""
    empty = q.new_empty(0)
    return torch.ops.megabeta_cpu.history_attention_forward(
        q, k, v, hist_k, hist_v, shift, empty if self_bias is None else self_bias,
        empty.long() if lower is None else lower, starts, groups, scale)


def backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor,
             out: Tensor, lse: Tensor, shift: Tensor, self_bias: Tensor | None,
             lower: Tensor | None, grad_hist_k: Tensor, grad_hist_v: Tensor, starts: list[int],
             groups: list[int], group_count: int,
             scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of `forward` (own keys as long as the queries): dq, dk, dv, each group's
    per-row score-gradient sums `[cells, G, B, H, n]` and the diagonal's `[cells, B, H, n]`;
    the groups' key and value gradients are ADDED into `grad_hist_k, grad_hist_v` (shaped like
    the history; empty: not wanted)."""
    empty = q.new_empty(0)
    return torch.ops.megabeta_cpu.history_attention_backward(
        grad, q, k, v, hist_k, hist_v, out, lse, shift,
        empty if self_bias is None else self_bias, empty.long() if lower is None else lower,
        grad_hist_k, grad_hist_v, starts, groups, group_count, scale)


# ---- the "cpu" implementation of megabeta::history_attention -------------------------------
def _groups(cells: Cells, start: int, n: int, window: int) -> tuple[list[int], list[int]]:
    """Each cell's first position (`start`: the newest cell's) and its groups, flattened as
    (cell, source layer, first row, end row, g) for the kernels."""
    starts = [start - (cells.count - 1 - i) * n for i in range(cells.count)]
    flat: list[int] = []
    for i, (layer, first) in enumerate(zip(cells.layers(), starts)):
        for g, m in enumerate(cells.sources(i)):
            rows = group_rows(window, layer, m, first)
            if rows.stop > rows.start:
                flat += [i, m, rows.start, rows.stop, g]
    return starts, flat


def _forward(q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor, start: Tensor,
             shift: Tensor, self_bias: Tensor | None, lower: Tensor | None, sources: list[int],
             layers: list[int], top: int, window: int, scale: float) -> tuple[Tensor, Tensor]:
    cells = Cells.of(sources, layers, top)
    starts, groups = _groups(cells, int(start), q.shape[3], window)
    return forward(q, k, v, hist_k, hist_v, shift.to(q.dtype),
                                 None if self_bias is None else self_bias.to(q.dtype), lower,
                                 starts, groups, scale)


def _backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor,
              out: Tensor, lse: Tensor, start: Tensor, shift: Tensor, self_bias: Tensor | None,
              lower: Tensor | None, state: list[Tensor], sources: list[int], layers: list[int],
              top: int, window: int, scale: float, shift_rows: Tensor | None,
              diag_rows: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`state`: the history's gradient buffers `[grad_k, grad_v]` the groups' gradients are
    added into, or empty (none wanted)."""
    if shift_rows is not None:
        raise ValueError("history attention (cpu): returns the biases' gradients per call "
                         "(Capabilities.bias_rows is off), not in row buffers")
    cells = Cells.of(sources, layers, top)
    starts, groups = _groups(cells, int(start), q.shape[3], window)
    empty = q.new_empty(0)
    grad_hist_k, grad_hist_v = state if state else (empty, empty)
    dq, dk, dv, rows, diag = backward(
        row_major(grad.to(q.dtype)), q, k, v, hist_k, hist_v, out, lse, shift.to(q.dtype),
        None if self_bias is None else self_bias.to(q.dtype), lower, grad_hist_k, grad_hist_v,
        starts, groups, cells.groups, scale)
    # The shift is subtracted from the scores: minus its groups' row sums.
    d_shift = torch.zeros(shift.shape, dtype=lse.dtype)
    d_shift[:, :cells.groups] = -rows.sum((2, 4))
    d_self_bias = diag.sum((1, 2, 3)) if self_bias is not None else diag.new_empty(cells.count, 0)
    return dq, dk, dv, d_shift, d_self_bias


history_attention.register("cpu", forward=_forward, backward=_backward)
