"""How megabeta's kernels become torch operators, and how their launches are counted.

Every fused kernel is a `torch.library` custom op in the `megabeta` namespace (`custom_op`), with
a fake implementation, so it traces under `torch.compile` and CUDA-graph capture as one opaque
call. One opaque call may launch several kernels, though, and a count of dispatches that took
each op as one would flatter it. So:

- every Triton launch goes through `launch`, which counts it while a `LaunchCount` is active;
- `custom_op` keeps each op's Python implementation (`implementation(name)`), so that a
  dispatch counter (`megabeta.bench.dispatch`) can run it in place of the opaque op and count
  the ATen operators inside it too.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import _disable_current_modes

NAMESPACE = "megabeta"

_IMPLEMENTATIONS: dict[str, Callable[..., Any]] = {}
_counters: list["LaunchCount"] = []


def custom_op(name: str, *, mutates_args: Iterable[str] = ()) -> Callable[[Callable[..., Any]],
                                                                          Any]:
    """`torch.library.custom_op("megabeta::<name>", ...)` that also records the implementation
    under the op's qualified name (`megabeta::<name>`)."""

    def wrap(fn: Callable[..., Any]) -> Any:
        qualified = f"{NAMESPACE}::{name}"
        _IMPLEMENTATIONS[qualified] = fn
        return torch.library.custom_op(qualified, mutates_args=tuple(mutates_args))(fn)

    return wrap


def implementation(qualified: str) -> Callable[..., Any] | None:
    """The Python implementation of the custom op `megabeta::<name>`, or None for another op."""
    return _IMPLEMENTATIONS.get(qualified)


class LaunchCount:
    """Triton kernel launches made while active (`with LaunchCount() as count: …; count.total`).
    `run=False` counts them without running them (their outputs keep whatever memory held):
    the count does not depend on the numbers, and Triton's CPU interpreter would take minutes
    for a model's step."""

    def __init__(self, *, run: bool = True) -> None:
        self.run = run
        self.total = 0
        self.by_kernel: dict[str, int] = {}
        self._depth = 0

    def __enter__(self) -> "LaunchCount":
        # Re-entrant (a dispatch counter re-enters itself to count inside custom ops): counted
        # once however deep.
        if not self._depth:
            _counters.append(self)
        self._depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        if not self._depth:
            _counters.remove(self)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """Launch the Triton `kernel` on `grid` (counted by every active `LaunchCount`)."""
    for count in _counters:
        count.total += 1
        name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None),
                                                           "__name__", "triton")
        count.by_kernel[name] = count.by_kernel.get(name, 0) + 1
    if not all(count.run for count in _counters):
        return
    # Outside any dispatch mode: Triton's CPU interpreter copies each tensor argument with ATen
    # operators, which a dispatch counter would otherwise charge to the launch.
    with _disable_current_modes():
        kernel[grid](*args, **kwargs)


def anchor_gradient(anchor: tuple[torch.dtype, torch.device] | None) -> torch.Tensor | None:
    """The gradient an attention operator returns for its ordering anchor (the history's: an
    input taken only so that autograd runs this backward before the anchor producer's), given
    the anchor's (dtype, device) or None. None in eager mode: the edge alone orders autograd
    and a zero would be a launch per call. A zero under torch.compile, whose graphs drop the
    edges of inputs whose gradient is None (and with them the ordering)."""
    if anchor is None or not torch.compiler.is_compiling():
        return None
    return torch.zeros((), dtype=anchor[0], device=anchor[1])
