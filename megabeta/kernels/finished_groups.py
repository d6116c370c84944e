"""A block's attention over its finished groups as fused CPU kernels (`finished_groups.cpp`).

Forward: the groups' attention merged by log-sum-exp into the block's own-key output in one
pass per (batch, head): no repeated queries, no per-group outputs kept for backward.

Backward: ATen's flash backward hands back freshly zero-filled key/value gradients for every
history row of every group, which the caller then adds into the history's gradient buffer. At
c = 32 those memory passes, the per-group calls and the merge's small operations took about 40 %
of the merged attention's time (86-90 ms a layer against 52-57 ms for ATen's kernel calls
alone; docs/benchmarks/2026-12-01-amd-epyc-2core.md). The kernel does the same arithmetic per tile and adds into the
buffers in place (BLAS with beta = 1), and sums each group's score gradient per query row for
the depth bias's gradient.

It is built with torch's JIT extension loader the first time a process needs it (about 7 s
with g++; cached under `TORCH_EXTENSIONS_DIR`, by default `~/.cache/torch_extensions`). Where it
cannot be built (no C++ compiler, a CPU without AVX2), attention selection takes the
`cpu_flash` backend instead (`build()` says whether they built, and the reason is logged once);
for another dtype than float32 or float64 (`supports`) the `cpu_fused` backend uses ATen's
kernels.
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

log = logging.getLogger(__name__)

DTYPES = (torch.float32, torch.float64)

_SOURCE = os.path.join(os.path.dirname(__file__), "finished_groups.cpp")


@functools.lru_cache(maxsize=None)
def build() -> bool:
    """Build (or find the cached build of) the kernels and register them as
    `torch.ops.megabeta.*`; False, with the reason logged once, where they cannot be built."""
    if platform.machine() not in ("x86_64", "AMD64"):
        reason = f"they are written for x86-64 with AVX2, this machine is {platform.machine()}"
    elif torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        reason = "this CPU lacks AVX2"
    else:
        try:
            from torch.utils.cpp_extension import load

            _put_ninja_on_path()

            # at::vec's AVX2 vectors (its exp is Sleef's, exported by libtorch_cpu) and OpenMP
            # for at::parallel_for, which is inlined into the kernels.
            flags = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-DCPU_CAPABILITY=AVX2",
                     "-DCPU_CAPABILITY_AVX2"]
            load(name=_build_name(flags), sources=[_SOURCE], extra_cflags=flags,
                 extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
            return True
        except Exception as error:  # noqa: BLE001 - any build failure means: use the fallback
            reason = f"building it failed ({type(error).__name__}: {str(error).strip()[:300]})"
    log.warning("megabeta: fused CPU kernels for the finished groups unavailable, attention "
                "takes the cpu_flash backend (ATen's kernels, slower at small blocks): %s", reason)
    return False


def _build_name(flags: list[str]) -> str:
    """The build's name, and so its folder in torch's extension cache: named by the source and
    flags, so that two checkouts of another version on one machine (or a run while another
    rebuilds) never load or overwrite each other's library."""
    digest = hashlib.sha256(open(_SOURCE, "rb").read() + " ".join(flags).encode()).hexdigest()
    return f"megabeta_finished_groups_{digest[:12]}"


def _put_ninja_on_path() -> None:
    """torch's loader runs `ninja` from PATH; the `ninja` package's binary sits in the
    environment's scripts folder, which is not on PATH when the venv is not activated."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def supports(dtype: torch.dtype) -> bool:
    """Whether the kernels take tensors of `dtype` (once `build()` succeeded)."""
    return dtype in DTYPES


def forward(q: list[Tensor], keys: list[Tensor], values: list[Tensor], shift: list[Tensor],
            cells: list[int], scale: float, out: list[Tensor], lse: list[Tensor], *,
            lower: list[Tensor] | None = None, first: list[int] | None = None) -> None:
    """Merge attention over stacks of finished groups into `out` and `lse` (in place), for
    several query blocks in one call.

    Per query block i: `q[i], out[i] [B, H, n, d]`: queries and, on entry, the output over the
    block's own keys (normalized); `lse[i] [B, H, n]`: its log-sum-exp. Per stack j:
    `keys[j], values[j] [g, B, H_kv, R, d]`: the groups that query block `cells[j]` reads
    (non-decreasing); `shift[j] [g, H]`: subtracted from group g's scores for head h (the depth
    bias). On return `out`/`lse` are those of the merged key sets, each block's stacks merged
    in their order. Query head h reads KV head h // (H / H_kv). One dtype (`supports`),
    contiguous last dimensions, any other strides.

    Document masks (spec §7): `lower[i] [B, n]` int64, the position of the first key each of
    query block i's rows reads, and `first[j]`, the position of stack j's first row: row r reads
    row k of stack j iff `first[j] + k >= lower[i][:, r]`; keys below a block's (backward: a
    query tile's) smallest bound are skipped. A row that reads no key of the stacks keeps its
    output and lse. Both None: no mask.
    """
    torch.ops.megabeta.finished_groups_forward(q, keys, values, shift, cells, scale, out, lse,
                                               lower or [], first or [])


def backward(grad: list[Tensor], q: list[Tensor], keys: list[Tensor], values: list[Tensor],
             lse: list[Tensor], delta: list[Tensor], cells: list[int], scale: float,
             dq: list[Tensor], grad_keys: list[Tensor], grad_values: list[Tensor],
             row_sums: list[Tensor], *, lower: list[Tensor] | None = None,
             first: list[int] | None = None) -> None:
    """Add the gradients of attention over stacks of finished groups to `dq`, `grad_keys`,
    `grad_values`, and each group's per-row score-gradient sums to `row_sums` (in place), for
    several query blocks in one call.

    Per query block i: `q[i], grad[i], dq[i] [B, H, n, d]`: queries, the merged output's
    gradient, the queries' gradient; `delta[i] [B, H, n]`: rowsum(grad ∘ merged output). Per
    stack j (of query block `cells[j]`): `keys[j], values[j], grad_keys[j], grad_values[j]
    [g, B, H_kv, R, d]`: the groups and their gradient buffers (both empty: only `dq` is
    wanted); `lse[j] [g, B, H, n]`: the merged lse plus each group's shift; `row_sums[j]
    [g, B, H, n]`, or empty when not wanted. Different query blocks' stacks must not share
    gradient buffers (they run in parallel). Layouts and document bounds (`lower`, `first`:
    masked keys get no weight, hence no gradient) as in `forward`.
    """
    torch.ops.megabeta.finished_groups_backward(grad, q, keys, values, lse, delta, cells, scale,
                                                dq, grad_keys, grad_values, row_sums,
                                                lower or [], first or [])
