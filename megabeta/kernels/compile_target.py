"""The project's Triton kernels compiled for an NVIDIA GPU on a machine without one.

Triton's wheel ships ptxas, so a kernel compiles to PTX and a cubin with no GPU and no driver:
all the compiler asks the driver for is the target. `StandInDriver` reports one
(`GPUTarget("cuda", arch, 32)`); `CompileForTarget` is a launch observer
(`megabeta.kernels.ops`) that, while active, takes every launch the model's own code makes and
compiles it for that target (`JITFunction.warmup`, Triton's own argument specialisation)
instead of running it, with CPU tensors of the real shapes and strides standing in for CUDA
ones (`ops.target_device_type` tells the launch code to choose the CUDA tiles); the tensors
may be fake (`FakeTensorMode`): a model's step then costs no arithmetic. Each distinct
compiled kernel becomes one `KernelBuild`: ptxas's registers, spill bytes and stack, Triton's
shared memory, warps and stages, and the MMA instructions in the PTX.

Triton reads `TRITON_INTERPRET` when a kernel is defined: this only works in a process where it
is unset (the interpreter's kernels cannot be compiled).
"""

from __future__ import annotations

import contextlib
import io
import re
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from torch.utils._python_dispatch import _disable_current_modes

from megabeta.kernels.ops import LaunchObserver, kernel_name


@dataclass(frozen=True)
class TargetLimits:
    """What one thread block may use on an NVIDIA architecture."""

    registers: int
    """Registers per thread."""
    shared: int
    """Shared memory per block, bytes (the opt-in maximum)."""


LIMITS = {80: TargetLimits(255, 166912), 90: TargetLimits(255, 232448)}
"""sm_80 (A100) and sm_90 (H100/H200): CUDA's per-architecture limits."""


class StandInDriver(DriverBase):
    """A driver that reports `arch` as the current target and has no device: enough for
    Triton to compile. The current "device" is the architecture number, so kernels compiled
    for different targets live in different per-device caches of the same `JITFunction`."""

    def __init__(self, arch: int) -> None:
        self.arch = arch

    @classmethod
    def is_active(cls) -> bool:
        return False

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("the stand-in driver builds no launchers")

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.arch, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_benchmarker(self) -> Any:
        raise NotImplementedError("the stand-in driver cannot time kernels")

    def get_current_device(self) -> int:
        return self.arch

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


@dataclass
class KernelBuild:
    """One compiled kernel for one target, and the launches (variants) that reached it."""

    kernel: str
    arch: int
    key: str
    """Identifies the compiled kernel (Triton's hash of source, specialisation and target; the
    error for one that failed)."""
    params: str
    """The kernel's distinguishing parameters (dtype, tile sizes, flags)."""
    variants: list[str] = field(default_factory=list)
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack: int = 0
    shared: int = 0
    num_warps: int = 0
    num_stages: int = 0
    mma: str = "none"
    """`wgmma` (Hopper warpgroup MMA), `mma.sync` or `none` (FMA products)."""
    seconds: float = 0.0
    error: str | None = None

    @property
    def spill(self) -> int:
        """Spilled bytes per thread, stores and loads together."""
        return self.spill_stores + self.spill_loads

    def limit_error(self) -> str | None:
        """What exceeds the target's limits, or None."""
        limits = LIMITS[self.arch]
        if self.error is None and self.registers > limits.registers:
            return f"{self.registers} registers > {limits.registers}"
        if self.error is None and self.shared > limits.shared:
            return f"{self.shared} B shared memory > {limits.shared} B"
        return None


_RESOURCES = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                        r"(\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")
_SHOWN = ("D", "BLOCK_M", "BLOCK_N", "BLOCK_D", "BLOCK_H", "BLOCK_HALF", "HAS_SELF",
          "ROWS_AT_START", "HAS_DOCS", "ADD", "COMPUTE")


def stand_in(arg: Any) -> Any:
    """A tensor argument as a meta tensor of the same dtype, shape, strides and byte offset:
    all Triton reads of a tensor to compile for it (its data pointer only for alignment), and
    one a fake tensor (which has no data pointer) can give. Other arguments as they are."""
    if not isinstance(arg, torch.Tensor):
        return arg
    return torch.empty(0, dtype=arg.dtype, device="meta").as_strided(
        arg.shape, arg.stride(), arg.storage_offset())


def _dtype_of(args: tuple[Any, ...]) -> str:
    """The dtype of the first floating tensor argument (the kernel's data)."""
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.is_floating_point():
            return str(arg.dtype).removeprefix("torch.")
    return "-"


def _params(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    shown = [f"{key}={getattr(kwargs[key], 'name', kwargs[key])}" for key in _SHOWN
             if key in kwargs]
    return " ".join([_dtype_of(args), *shown])


class CompileForTarget(LaunchObserver):
    """While active, every Triton launch is compiled for `arch` instead of run (module doc).

    `variant`: a label the caller sets before each model run; every build records the labels
    of the runs that reached it. `builds`: one per distinct compiled kernel, in compile order.
    """

    run = False
    device_type = "cuda"

    def __init__(self, arch: int) -> None:
        super().__init__()
        if arch not in LIMITS:
            raise ValueError(f"architecture sm_{arch}: choose one of "
                             f"{', '.join(f'sm_{a}' for a in LIMITS)}")
        self.arch = arch
        self.variant = ""
        self.builds: list[KernelBuild] = []
        self._by_key: dict[str, KernelBuild] = {}
        self._saved: dict[str, Any] = {}
        self._cache: tempfile.TemporaryDirectory[str] | None = None

    def __enter__(self) -> "CompileForTarget":
        if not self._depth:
            # The driver as it was, possibly none chosen yet (`reset_active` would create the
            # default one, which fails without a GPU).
            self._saved = {"driver": triton.runtime.driver._active,
                           "ptxas_log": triton.knobs.nvidia.dump_ptxas_log,
                           "cache_dir": triton.knobs.cache.dir}
            # A fresh cache: ptxas prints its log only when it runs.
            self._cache = tempfile.TemporaryDirectory(prefix="megabeta-kernels-")
            triton.knobs.cache.dir = self._cache.name
            triton.knobs.nvidia.dump_ptxas_log = True
            triton.runtime.driver.set_active(StandInDriver(self.arch))
        return super().__enter__()  # type: ignore[return-value]

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if not self._depth:
            triton.runtime.driver._active = self._saved["driver"]
            triton.knobs.nvidia.dump_ptxas_log = self._saved["ptxas_log"]
            triton.knobs.cache.dir = self._saved["cache_dir"]
            assert self._cache is not None
            self._cache.cleanup()

    def launched(self, kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        name = kernel_name(kernel)
        log = io.StringIO()
        began = time.perf_counter()
        try:
            # Outside the caller's dispatch modes (a fake tensor mode would make the stand-ins
            # fake).
            with _disable_current_modes(), contextlib.redirect_stdout(log):
                compiled = kernel.warmup(*map(stand_in, args), grid=grid, **kwargs)
        except Exception as exc:  # a compile error is a finding, reported per launch site
            message = str(exc).strip().splitlines()
            error = next((line for line in reversed(message) if line.strip()), type(exc).__name__)
            error = f"{type(exc).__name__}: {error}"
            key = f"{name} {_params(args, kwargs)} {error}"
            if key not in self._by_key:
                self._add(key, KernelBuild(name, self.arch, key, _params(args, kwargs),
                                           error=error))
            self._reached(key)
            return
        key = compiled.hash
        if key not in self._by_key:
            build = KernelBuild(name, self.arch, key, _params(args, kwargs),
                                seconds=time.perf_counter() - began)
            _read_resources(build, compiled, log.getvalue())
            self._add(key, build)
        self._reached(key)

    def _reached(self, key: str) -> None:
        variants = self._by_key[key].variants
        if self.variant not in variants:
            variants.append(self.variant)

    def _add(self, key: str, build: KernelBuild) -> None:
        self._by_key[key] = build
        self.builds.append(build)


def _read_resources(build: KernelBuild, compiled: Any, ptxas_log: str) -> None:
    """Fill `build` from ptxas's log and the compiled kernel's metadata and PTX."""
    resources = _RESOURCES.search(ptxas_log)
    registers = _REGISTERS.search(ptxas_log)
    if resources is None or registers is None:
        build.error = "no ptxas resource line in the log (was the kernel taken from a cache?)"
        return
    build.stack, build.spill_stores, build.spill_loads = map(int, resources.groups())
    build.registers = int(registers.group(1))
    build.shared = int(compiled.metadata.shared)
    build.num_warps = int(compiled.metadata.num_warps)
    build.num_stages = int(compiled.metadata.num_stages)
    ptx = compiled.asm.get("ptx", "")
    build.mma = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "none"
