"""The driver of a beta12 pass: every unit of the plan in order, and in backward every unit in
reverse order (spec §4.6, §5).

A unit (model/plan.py: a block of the block schedule, a wave of the wavefront) runs its waves
(`run_unit`, over wave.py's `run_wave`) and then writes the finished K/V of its cells into the
history (model/history.py). Its readers are all in later units, so in backward, when the driver
reaches a unit, every reader of its finished K/V has run backward and their gradients are
complete in the history's gradient buffers (finished by the backend where it defers them,
`AttentionBackend.history_gradients`). The order is the driver's, not autograd's: the whole
pass is ONE autograd node (`_Pass`), whose backward walks the units back.

- With recomputation (`activation_checkpoint`), the forward runs the units without autograd and
  keeps each unit's inputs (the carried state, a few numbers per token and layer); the backward
  runs each unit again under autograd and differentiates it at once. Without it, the forward
  keeps each unit's graph.
- The pass's weights enter the node as tensors (`PassWeights.tensors`); inside, the units read
  leaf copies of them. By-hand stacks and bias rows (`PassWeights.gradients`) hand their
  gradients back once per pass; the rest comes from autograd, unit by unit.
- The same driver is what the executor captures in two CUDA graphs (model/graphs.py): its
  forward with no autograd, its backward with the recomputation.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from megabeta.model.attention.backend import Reads
from megabeta.model.history import History
from megabeta.model.pass_weights import PassWeights
from megabeta.model.plan import Unit, WavePlan
from megabeta.model.wave import Body, Carried, Entering, run_wave


@dataclass
class UnitOutput:
    """What a unit hands on: the next unit's carried state, its cells' finished K/V (in the
    order of its waves' cells) and the hidden states of the blocks that leave in it."""

    carried: Carried | None
    finished: list[tuple[Tensor, Tensor]]
    hidden: list[Tensor]


@dataclass(frozen=True)
class UnitArgs:
    """Everything a unit reads besides its state and weights, per wave: the cells' history
    views and bounds (`Reads`), their RoPE tables `[n, c, d_h]` and those of the block that
    joins at the wave's end (`[c, d_h]` each; None where none joins)."""

    reads: tuple[Reads, ...]
    cos: tuple[Tensor, ...]
    sin: tuple[Tensor, ...]
    joining: tuple[tuple[Tensor, Tensor] | None, ...]


def run_unit(body: Body, weights: PassWeights, unit: Unit, carried: Carried | None,
             entering: list[Tensor], args: UnitArgs, *, dropout: float,
             copy_next: bool) -> UnitOutput:
    """The unit's waves in order (`run_wave`); `entering`: the embeddings of the blocks whose
    input projection it runs (`Unit.entering`: alone at a wave's start, or joining at its
    end)."""
    finished: list[tuple[Tensor, Tensor]] = []
    hidden: list[Tensor] = []
    entering = list(entering)
    last = len(unit.waves) - 1
    for i, wave in enumerate(unit.waves):
        block = entering.pop(0) if unit.enters_alone(i) else None
        joining = None
        if unit.joining(i):
            cos, sin = args.joining[i]
            joining = Entering(entering.pop(0), cos, sin)
        out = run_wave(body, weights, wave, carried, block, args.reads[i], args.cos[i],
                       args.sin[i], dropout=dropout, copy_next=copy_next and i == last,
                       joining=joining)
        finished += out.finished
        if out.hidden is not None:
            hidden.append(out.hidden)
        carried = out.carried
    return UnitOutput(carried, finished, hidden)


UnitFn = Callable[..., UnitOutput]


@dataclass
class PassSettings:
    """How the driver runs a pass, fixed by the executor (model/executor.py)."""

    recompute: bool
    """Recompute each unit in backward (`activation_checkpoint`)."""
    weight_gradients: str
    """How the weight stacks' gradients are formed (`StackedWeight`): by hand, once per pass
    (`"pass"`) or per call (`"call"`); `"autograd"` in traced units."""
    unit: UnitFn = run_unit
    """`run_unit`, or compiled."""


@dataclass
class _Saved:
    """What the forward keeps of one unit for its backward."""

    carried: Carried | None
    entering: list[Tensor]
    rng: tuple | None = None
    output: UnitOutput | None = None
    """The unit's output with its graph (no recomputation)."""


@dataclass
class Driver:
    """One pass of `plan` (module doc): `template` the pass's weights (their layout),
    `history` its buffers (None: one block, no history), `cos/sin [blocks, c, d_h]` its RoPE
    tables, `documents [B, T']` its document starts (None: no mask)."""

    body: Body
    plan: WavePlan
    settings: PassSettings
    template: PassWeights
    history: History | None
    cos: Tensor
    sin: Tensor
    dropout: float
    documents: Tensor | None = None
    _saved: list[_Saved] = field(default_factory=list)
    _weights: PassWeights | None = None
    _leaves: list[Tensor] = field(default_factory=list)
    _autocast: tuple = ()

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, x: Tensor, tensors: list[Tensor], *, keep: bool) -> Tensor:
        """The final hidden states `[B, T', d]` of the embeddings `x [B, T', d]` (T' whole
        blocks, or one block) with the pass's weight `tensors`; `keep`: keep what backward
        needs."""
        c = self.cos.shape[1]
        batch, length = x.shape[0], x.shape[1]
        self._leaves = [t.detach().requires_grad_(t.is_floating_point()) if keep else t
                        for t in tensors]
        self._weights = weights = self.template.with_tensors(
            self._leaves, gradients=self.settings.weight_gradients, batch=batch, length=length)
        self._saved = []
        self._autocast = _autocast_state(x.device)
        blocks = list(x.split(c, dim=1)) if length > c else [x]
        hidden: list[Tensor] = []
        carried = None
        grad = keep and not self.settings.recompute
        units = self.plan.units()
        for unit in units:
            entering = [blocks[b] for b in unit.entering]
            if grad:
                carried = _leaf(carried)
                entering = [e.detach().requires_grad_() for e in entering]
            saved = _Saved(carried, entering)
            if keep and self.dropout and self.settings.recompute:
                saved.rng = _rng_state(x.device)
            with torch.set_grad_enabled(grad), _unchecked(grad):
                out = self._unit(unit, weights, carried, entering,
                                 copy_next=keep and self.settings.recompute)
            self._publish(unit, out)
            hidden += out.hidden
            if keep:
                if grad:
                    saved.output = out
                self._saved.append(saved)
            carried = out.carried
        return torch.cat(hidden, dim=1) if len(hidden) > 1 else hidden[0]

    def _unit(self, unit: Unit, weights: PassWeights, carried: Carried | None,
              entering: list[Tensor], *, copy_next: bool) -> UnitOutput:
        c = self.cos.shape[1]
        reads, cos, sin, joining = [], [], [], []
        for i, wave in enumerate(unit.waves):
            cells = len(wave.layers)
            newest = (wave.first + cells - 1) * c
            history = None if self.history is None else self.history.view(newest)
            lower = (None if self.documents is None
                     else _consecutive(self.documents, newest, c, cells))
            reads.append(Reads(wave.layers, history, lower))
            cos.append(self.cos[wave.first:wave.first + cells])
            sin.append(self.sin[wave.first:wave.first + cells])
            joining.append((self.cos[wave.after], self.sin[wave.after]) if unit.joining(i)
                           else None)
        args = UnitArgs(tuple(reads), tuple(cos), tuple(sin), tuple(joining))
        return self.settings.unit(self.body, weights, unit, carried, entering, args,
                                  dropout=self.dropout, copy_next=copy_next)

    def _publish(self, unit: Unit, out: UnitOutput) -> None:
        if self.history is None:
            return
        cells, keys, values = self._published(unit, out)
        self.history.write(cells, keys, values)

    def _published(self, unit: Unit, out: UnitOutput
                   ) -> tuple[list[tuple[int, int]], list[Tensor], list[Tensor]]:
        """The cells a unit publishes (block start, layer) and their finished K/V."""
        c = self.cos.shape[1]
        cells, keys, values = [], [], []
        all_cells = [cell for wave in unit.waves for cell in wave.cells]
        for (b, l), (k, v) in zip(all_cells, out.finished):
            if b < self.plan.blocks - 1:
                cells.append((b * c, l))
                keys.append(k)
                values.append(v)
        return cells, keys, values

    # ---- backward ---------------------------------------------------------------------------
    def backward(self, d_hidden: Tensor) -> tuple[Tensor, list[Tensor | None]]:
        """The gradients of the embeddings and of the pass's weight tensors, from the hidden
        states' `d_hidden [B, T', d]`."""
        c = self.cos.shape[1]
        weights = self._weights
        batch, length = d_hidden.shape[0], d_hidden.shape[1]
        history = self.history
        if history is not None and history.grad_keys is not None:
            history.grad_keys.zero_()
            history.grad_values.zero_()
        weights.start_backward()
        d_blocks = list(d_hidden.split(c, dim=1)) if length > c else [d_hidden]
        d_x: list[Tensor | None] = [None] * len(d_blocks)
        wanted = [t for t in self._leaves if t.requires_grad]
        leaf_grads: list[Tensor | None] = [None] * len(wanted)
        d_carried: list[Tensor | None] | None = None
        units = self.plan.units()
        for index in range(len(units) - 1, -1, -1):
            unit, saved = units[index], self._saved[index]
            if history is not None and unit.published:
                self.body.attention.history_gradients(
                    history, [(b * c, l) for b, l in unit.published], c)
            if saved.output is None:
                carried = _leaf(saved.carried)
                entering = [e.detach().requires_grad_() for e in saved.entering]
                with torch.enable_grad(), _autocast(self._autocast), \
                        _restored(saved.rng, d_hidden.device):
                    out = self._unit(unit, weights, carried, entering,
                                     copy_next=False)
            else:
                carried, entering, out = saved.carried, saved.entering, saved.output
            outputs: list[Tensor] = []
            grads: list[Tensor] = []
            if out.carried is not None and d_carried is not None:
                for t, g in zip(out.carried.tensors(), d_carried):
                    if g is not None:
                        outputs.append(t)
                        grads.append(g)
            cells, keys, values = self._published(unit, out)
            if cells:
                for t, g in zip([*keys, *values], history.gradient(cells, c)):
                    outputs.append(t)
                    grads.append(g if g.dtype == t.dtype else g.to(t.dtype))
            for b, h in zip(unit.exiting, out.hidden):
                outputs.append(h)
                grads.append(d_blocks[b])
            inputs = [*([] if carried is None else carried.tensors()), *entering]
            found = torch.autograd.grad(outputs, [*inputs, *wanted], grads, allow_unused=True)
            carried_in = 0 if carried is None else 4
            d_carried = list(found[:carried_in]) if carried_in else None
            for b, g in zip(unit.entering, found[carried_in:len(inputs)]):
                d_x[b] = g
            for i, g in enumerate(found[len(inputs):]):
                if g is not None:
                    leaf_grads[i] = g if leaf_grads[i] is None else leaf_grads[i] + g
            # No recomputation: the unit's graph goes once it ran backward.
            saved.output = None
        by_autograd = iter(leaf_grads)
        autograd_grads = [next(by_autograd) if t.requires_grad else None for t in self._leaves]
        total = [a if b is None else (b if a is None else a + b)
                 for a, b in zip(autograd_grads, weights.gradients())]
        d_embeddings = torch.cat([torch.zeros_like(d_blocks[i]) if g is None else g
                                  for i, g in enumerate(d_x)], dim=1)
        return d_embeddings, total


class _Pass(torch.autograd.Function):
    """The whole pass as one autograd node (module doc): forward and backward by `run`, the
    driver's or its captured replays (model/graphs.py)."""

    @staticmethod
    def forward(ctx: Any, run: "PassRun", x: Tensor, *tensors: Tensor) -> Tensor:
        ctx.run = run
        # Detached: without recomputation the driver's forward ran under autograd, and the
        # node's output must be its own, not a view that autograd would trace back through.
        return run.forward(x, list(tensors), keep=True).detach()

    @staticmethod
    def backward(ctx: Any, d_hidden: Tensor) -> tuple[Tensor | None, ...]:
        run, ctx.run = ctx.run, None
        d_x, grads = run.backward(d_hidden)
        return (None, d_x, *grads)


class PassRun:
    """What `_Pass` calls: the driver itself, or its captured replays (model/graphs.py)."""

    def forward(self, x: Tensor, tensors: list[Tensor], *, keep: bool) -> Tensor:
        raise NotImplementedError

    def backward(self, d_hidden: Tensor) -> tuple[Tensor, list[Tensor | None]]:
        raise NotImplementedError


class EagerRun(PassRun):
    """The driver, run as it is."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver

    def forward(self, x: Tensor, tensors: list[Tensor], *, keep: bool) -> Tensor:
        return self.driver.forward(x, tensors, keep=keep)

    def backward(self, d_hidden: Tensor) -> tuple[Tensor, list[Tensor | None]]:
        return self.driver.backward(d_hidden)


def run_pass(run: PassRun, x: Tensor, tensors: list[Tensor]) -> Tensor:
    """The pass's hidden states, differentiable w.r.t. `x` and `tensors` when autograd wants
    them (one node, `_Pass`); without autograd the forward alone, keeping nothing."""
    if torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in tensors)):
        return _Pass.apply(run, x, *tensors)
    return run.forward(x, tensors, keep=False)


# ---- helpers ------------------------------------------------------------------------------------
def _leaf(carried: Carried | None) -> Carried | None:
    """`carried` as leaves that ask for gradients (a unit's inputs)."""
    if carried is None:
        return None
    return Carried(*(t.detach().requires_grad_() for t in carried.tensors()))


def _inputs(carried: Carried | None, entering: list[Tensor]) -> list[Tensor]:
    return [*([] if carried is None else carried.tensors()), *entering]


def _consecutive(documents: Tensor, newest: int, n: int, cells: int) -> Tensor:
    """The document starts of `cells` consecutive blocks of n tokens, the newest at `newest`:
    `[cells, B, n]`, a strided view."""
    first = newest - (cells - 1) * n
    rows = documents[:, first:first + n]
    step = n * documents.stride(1)
    return rows.as_strided((cells, *rows.shape), (step, *rows.stride()), rows.storage_offset())


def _unchecked(grad: bool) -> contextlib.AbstractContextManager:
    """Under autograd, what a unit saves for its backward is saved as it is, without autograd's
    version check: a compiled unit saves its inputs, the history's buffers among them, which
    later units write at rows this unit never reads (the check would refuse what is correct;
    the eager readers hold the buffers unsaved)."""
    if not grad:
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_same, _same)


def _same(t: Tensor) -> Tensor:
    return t


def _autocast_state(device: torch.device) -> tuple:
    kind = device.type
    if kind not in ("cpu", "cuda"):
        return (kind, False, None)
    return (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))


def _autocast(state: tuple) -> contextlib.AbstractContextManager:
    """The forward's autocast state: autograd runs the backward (and so the recompute) outside
    the forward's context."""
    kind, enabled, dtype = state
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(kind, dtype=dtype, enabled=enabled)


def _rng_state(device: torch.device) -> tuple:
    """The RNG state a unit's dropout starts from (CPU's, and the device's)."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _restored(state: tuple | None, device: torch.device):
    """Run with the RNG state `state` (a recompute draws the forward's dropout masks), the
    outer state untouched."""
    if state is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


__all__ = ["Driver", "EagerRun", "PassRun", "PassSettings", "UnitArgs", "UnitOutput",
           "run_pass", "run_unit"]
