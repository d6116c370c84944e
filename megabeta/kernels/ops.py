"""How megabeta's kernels become torch operators, and how their launches are counted.

Every fused kernel is a `torch.library` custom op in the `megabeta` namespace (`custom_op`), with
a fake implementation, so it traces under `torch.compile` and CUDA-graph capture as one opaque
call. One opaque call may launch several kernels, though, and a count of dispatches that took
each op as one would flatter it. So:

- every Triton launch goes through `launch`, which shows it to the active `LaunchObserver`s: a
  `LaunchCount` counts it, a compile check (`megabeta.kernels.compile_target`) compiles it for
  a GPU target instead of running it;
- `custom_op` keeps each op's Python implementation (`implementation(name)`), so that a
  dispatch counter (`megabeta.bench.dispatch`) can run it in place of the opaque op and count
  the ATen operators inside it too.
"""

from __future__ import annotations

import inspect
from collections import Counter
from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

NAMESPACE = "megabeta"

_IMPLEMENTATIONS: dict[str, Callable[..., Any]] = {}
_observers: list["LaunchObserver"] = []


def custom_op(name: str, *, mutates_args: Iterable[str] = ()) -> Callable[[Callable[..., Any]],
                                                                          Any]:
    """`torch.library.custom_op("megabeta::<name>", ...)` that also records the implementation
    under the op's qualified name (`megabeta::<name>`).

    An op that mutates arguments may give no argument a default: a boxed call drops trailing
    arguments equal to their defaults, and torch before 2.13 then looks a mutated one up past
    the end of the argument tuple (an IndexError in the backward, seen with torch 2.11)."""

    def wrap(fn: Callable[..., Any]) -> Any:
        qualified = f"{NAMESPACE}::{name}"
        defaulted = [p.name for p in inspect.signature(fn).parameters.values()
                     if p.default is not inspect.Parameter.empty]
        if mutates_args and defaulted:
            raise TypeError(f"custom op {qualified} mutates its arguments, so none may have a "
                            f"default (these do: {', '.join(defaulted)}): pass them explicitly")
        _IMPLEMENTATIONS[qualified] = fn
        return torch.library.custom_op(qualified, mutates_args=tuple(mutates_args))(fn)

    return wrap


def implementation(qualified: str) -> Callable[..., Any] | None:
    """The Python implementation of the custom op `megabeta::<name>`, or None for another op."""
    return _IMPLEMENTATIONS.get(qualified)


class RunImplementations(TorchDispatchMode):
    """While active, each megabeta custom op runs as its Python implementation, under this
    mode, so that the operators and launches inside it are seen (and, under `FakeTensorMode`,
    launched with fake tensors instead of answered by the op's fake implementation); every
    other operator goes to `other`, which runs it."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        impl = implementation(func._schema.name)
        if impl is not None:
            with self:
                return impl(*args, **kwargs)
        return self.other(func, args, kwargs)

    def other(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """An operator that is not a megabeta custom op."""
        return func(*args, **kwargs)


class LaunchObserver:
    """Sees every Triton launch made while active (`with observer: …`; re-entrant: a dispatch
    counter re-enters itself to count inside custom ops, and is counted once however deep).

    `run = False`: the launches are not run (their outputs keep whatever memory held).
    `device_type`: the device the launches are prepared for, when not the tensors' own
    (`target_device_type`): a compile check builds CUDA kernels from CPU tensors."""

    run: bool = True
    device_type: str | None = None

    def __init__(self) -> None:
        self._depth = 0

    def __enter__(self) -> "LaunchObserver":
        if not self._depth:
            _observers.append(self)
        self._depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        if not self._depth:
            _observers.remove(self)

    def launched(self, kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        """Called for each launch (before it runs, if it runs)."""


class LaunchCount(LaunchObserver):
    """Triton kernel launches made while active (`with LaunchCount() as count: …; count.total`).
    `run=False` counts them without running them: the count does not depend on the numbers,
    and Triton's CPU interpreter would take minutes for a model's step."""

    def __init__(self, *, run: bool = True) -> None:
        super().__init__()
        self.run = run
        self.total = 0
        self.by_kernel: dict[str, int] = {}

    def __enter__(self) -> "LaunchCount":
        return super().__enter__()  # type: ignore[return-value]

    def launched(self, kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        self.total += 1
        name = kernel_name(kernel)
        self.by_kernel[name] = self.by_kernel.get(name, 0) + 1


NO_KERNEL = {
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
    "aten::new_empty_strided", "aten::detach", "aten::lift_fresh", "aten::_to_copy_noop",
    "aten::sym_size", "aten::sym_stride", "aten::sym_numel", "aten::is_same_size",
    "aten::set_", "aten::resize_", "aten::_unsafe_view", "aten::promote_types",
    "aten::result_type",
}
"""Operators that allocate or relabel memory without launching a kernel (views are recognised
from their schema)."""


class DispatchCount(RunImplementations):
    """Kernel-launching operators run while active (`total`, and per operator in `by_op`): a
    megabeta custom op counts as what it runs, its ATen operators and its launches."""

    def __init__(self, *, run_kernels: bool = True) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()
        self._launches = LaunchCount(run=run_kernels)

    @property
    def total(self) -> int:
        return sum(self.by_op.values()) + self._launches.total

    def __enter__(self) -> "DispatchCount":
        self._launches.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._launches.__exit__(*exc)

    def other(self, func: Any, args: tuple, kwargs: dict) -> Any:
        name = func._schema.name
        if not func.is_view and name not in NO_KERNEL:
            self.by_op[name.removeprefix("aten::")] += 1
        return func(*args, **kwargs)

    def launches(self) -> dict[str, int]:
        """Triton launches per kernel."""
        return dict(self._launches.by_kernel)


def kernel_name(kernel: Any) -> str:
    """The Python name of a Triton kernel (a `JITFunction` or the interpreter's wrapper)."""
    return getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__",
                                                        "triton")


def target_device_type(device: torch.device) -> str:
    """The device type kernels for tensors on `device` are prepared for: the active observers'
    `device_type` where one sets it, else the device's own."""
    for observer in _observers:
        if observer.device_type is not None:
            return observer.device_type
    return device.type


LAUNCH_OPTIONS = {"enable_fp_fusion": True}
"""Compile options of every kernel, set here rather than left to Triton's default: floating-point
contraction (a·b + c as one FMA, rounded once) stays on, as Triton has compiled these kernels so
far; Triton 3.10 turns its default off."""


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """Launch the Triton `kernel` on `grid` with `LAUNCH_OPTIONS` (seen first by every active
    `LaunchObserver`)."""
    kwargs = {**LAUNCH_OPTIONS, **kwargs}
    for observer in _observers:
        observer.launched(kernel, grid, args, kwargs)
    if not all(observer.run for observer in _observers):
        return
    # Outside any dispatch mode: Triton's CPU interpreter copies each tensor argument with ATen
    # operators, which a dispatch counter would otherwise charge to the launch.
    with _disable_current_modes():
        kernel[grid](*args, **kwargs)
