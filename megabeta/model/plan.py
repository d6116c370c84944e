"""The order of a beta12 pass's (block, layer) cells (spec §5): one plan, waves at a period p.

Cell (b, l), layer l on block b, needs cell (b, l-1) and the finished K/V of the cells (b-1, m),
m ∈ M(l) ⊆ [l, top(l)], top(l) = min(l + k, L - 1). With a period p in [k' + 1, L]
(k' = min(k, L - 1)) cell (b, l) runs in wave t = b·p + l: after (b, l-1) (wave t - 1) and after
(b-1, top(l)) (wave t - p + top(l) - l < t). So the cells of a wave are independent: up to
⌈L/p⌉ of them, on consecutive blocks, at layers stepping down by p.

- p = k' + 1: the wavefront (`execution.schedule = "wavefront"`): (T/c - 1)·p + L waves instead
  of (T/c)·L cells, each wave's cells batched (one matmul per projection, one attention call);
  its recompute unit is one wave.
- p = L: the block schedule (`execution.schedule = "block"`): every wave holds one cell, the
  waves of block b are its layers 0 … L-1, and its recompute unit is the block (L waves).

A unit (`Unit`) is what the pass's driver (model/passes.py) runs, recomputes and replays as one:
consecutive waves; it publishes the finished K/V of its cells (but the last block's, which
nobody reads) after it has run. Its kind (`Unit.kind`) is everything a compiled unit's graph
depends on besides tensor contents.

A block enters at layer 0 (its input projection) in the wave before its first one where that
wave hands on a state (`Wave.continues`): the entering block's projections are concatenated
to the continuing cells' there, and the concatenation is the copy the next unit keeps (`joins`).
Where nothing is handed on (the block schedule, the first wave), it enters in its own wave.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Wave:
    """One wave's cells: blocks `first`, `first + 1`, … at `layers` (descending by the period)."""

    first: int
    """The oldest cell's block."""
    layers: tuple[int, ...]
    top: int
    """L - 1."""
    period: int
    finished: bool = True
    """Whether the cells' finished K/V are wanted: False only in a pass of one block (nobody
    reads its history); its cells then project plainly."""

    @property
    def cells(self) -> list[tuple[int, int]]:
        """(block, layer) per cell, oldest first."""
        return [(self.first + i, l) for i, l in enumerate(self.layers)]

    @property
    def enters(self) -> bool:
        """Whether the newest cell is a block at layer 0."""
        return self.layers[-1] == 0

    @property
    def continues(self) -> bool:
        """Whether cells go on to the next wave (all but an exiting one)."""
        return not (self.exits and len(self.layers) == 1)

    @property
    def after(self) -> int:
        """The block after the newest cell's: the one that enters in the next wave, if any."""
        return self.first + len(self.layers)

    @property
    def exits(self) -> bool:
        """Whether the oldest cell is at the last layer (its block leaves after this wave)."""
        return self.layers[0] == self.top

    def stack(self) -> slice:
        """The cells' layers in a stack of all L layers in reverse order (oldest cell first)."""
        return slice(self.top - self.layers[0], self.top - self.layers[-1] + 1, self.period)

    def next_stack(self) -> slice:
        """The next input projections of the cells below the top (layers l+1 ≥ 1) in the stack
        of layers L-1 … 1."""
        below = self.layers[1:] if self.exits else self.layers
        return slice(self.top - 1 - below[0], self.top - below[-1], self.period)


@dataclass(frozen=True)
class Unit:
    """Consecutive waves the driver runs as one (module doc)."""

    waves: tuple[Wave, ...]
    blocks: int
    """The pass's blocks: the last one publishes nothing."""
    joined: bool = False
    """Whether its first wave's entering block was projected by the unit before (module doc)."""
    joins: bool = False
    """Whether its last wave projects the block that enters in the next unit's first wave."""

    def joining(self, i: int) -> bool:
        """Whether wave i ends by projecting the block that enters in the wave after it."""
        if i + 1 < len(self.waves):
            return self.waves[i].continues and self.waves[i + 1].enters
        return self.joins

    def enters_alone(self, i: int) -> bool:
        """Whether wave i's entering block is projected at its start (nothing was handed on)."""
        wave = self.waves[i]
        return wave.enters and not (self.joined if i == 0 else self.joining(i - 1))

    @property
    def entering(self) -> list[int]:
        """The blocks whose input projection this unit runs, in order (module doc)."""
        blocks = []
        for i, wave in enumerate(self.waves):
            if self.enters_alone(i):
                blocks.append(wave.after - 1)
            if self.joining(i):
                blocks.append(wave.after)
        return blocks

    @property
    def exiting(self) -> list[int]:
        """The blocks that leave (after their last layer) in this unit, in order."""
        return [w.first for w in self.waves if w.exits]

    @property
    def published(self) -> list[tuple[int, int]]:
        """(block, layer) of every cell whose finished K/V it writes to the history."""
        return [(b, l) for w in self.waves for b, l in w.cells if b < self.blocks - 1]

    @property
    def kind(self) -> tuple:
        """What a compiled unit's graph depends on: its waves' layers and whether their K/V are
        finished (which blocks it holds, and whether it publishes, are not read inside)."""
        return (tuple((w.layers, w.finished) for w in self.waves), self.joined, self.joins)


@dataclass(frozen=True)
class WavePlan:
    """Which cells run in which wave, for `blocks` blocks of `layers` layers, period p."""

    blocks: int
    layers: int
    period: int
    """p ∈ [min(k, L-1) + 1, L]: cell (b, l) runs in wave b·p + l."""

    def __post_init__(self) -> None:
        if not 1 <= self.period <= self.layers:
            raise ValueError(f"wave plan: period {self.period} outside [1, {self.layers}]")

    @property
    def waves(self) -> int:
        return (self.blocks - 1) * self.period + self.layers

    def wave(self, t: int) -> Wave:
        p, top = self.period, self.layers - 1
        low = max(t % p, t - (self.blocks - 1) * p)
        high = min(top, t) - (min(top, t) - t) % p
        first = (t - high) // p
        layers = tuple(range(high, low - 1, -p))
        return Wave(first, layers, top, p, finished=self.blocks > 1)

    def units(self) -> list[Unit]:
        """The pass's units: a block of L waves at p = L, one wave otherwise."""
        waves = [self.wave(t) for t in range(self.waves)]
        size = self.layers if self.period == self.layers else 1
        joins = [i + 1 < len(waves) and waves[i].continues and waves[i + 1].enters
                 for i in range(len(waves))]
        return [Unit(tuple(waves[i:i + size]), self.blocks, joined=i > 0 and joins[i - 1],
                     joins=joins[i + size - 1]) for i in range(0, len(waves), size)]

    def kinds(self) -> int:
        """How many kinds of unit the plan has (a compiled unit has one graph per kind)."""
        return len({u.kind for u in self.units()})


def period(schedule: str, layers: int, depth_window: int) -> int:
    """The period of `execution.schedule`: L for `block`, min(k, L-1) + 1 for `wavefront`."""
    return layers if schedule == "block" else min(depth_window, layers - 1) + 1


__all__ = ["Unit", "Wave", "WavePlan", "period"]
