"""The CPU attention kernels alone (the `cpu` backend, kernels/cpu_attention.cpp): forward and
backward of one wave of beta_1.2 cells and of one standard-arm cell, in GFLOP/s.

    python -m megabeta.bench attention [--batch 8] [--heads 3] [--head-dim 64] [--layers 20]
        [--length 512] [--block 32] [--cells 7] [--repeats 10]

- `wave, cold history`: `--cells` cells of `--block` queries on different blocks (blocks 2, 4,
  6, ...), cell i at layer 3i (as on the wavefront at depth window 2) reading its own keys and
  its finished groups (spec §3: layers 3i to 3i + 2, fewer at the top) from history buffers
  of `--layers` layers. At the defaults the buffers are 63 MB, larger than the caches: the
  groups' rows come from memory, as in a training step.
- `wave, warm history`: the same forward with every cell's groups on the first three layers
  of buffers of three layers (9 MB): what the kernels do when the history is in cache. Forward
  only: in backward those cells would add into the same history gradient rows at once.
- `standard cell`: one cell of `--length` queries, causal, no history (the standard arm's
  layer).

FLOPs are counted as the kernels do them: 4·d a visible key and query forward (QKᵀ and PV), 2.5
times that backward (S recomputed, dP, dQ, dK, dV). Each figure is the best of 7 rounds of
`--repeats` calls: the kernels' own speed, with the machine's noise left out.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Callable

import torch

from megabeta.kernels import cpu_attention


@dataclass(frozen=True)
class Wave:
    """The geometry of one call: `cells` cells of `block` queries, cell i on block
    `first + 2i`, each reading its groups' rows [0, start) of source layers `sources[i]` from
    buffers of `layers` layers of `length` rows."""

    cells: int
    block: int
    layers: int
    length: int
    sources: tuple[tuple[int, ...], ...]
    first: int = 2

    @classmethod
    def spread(cls, cells: int, block: int, layers: int, length: int, *,
               warm: bool) -> "Wave":
        """Cell i at layer 3i reading layers 3i to 3i + 2 (cold), or all on layers 0-2 of a
        3-layer history (warm)."""
        if warm:
            return cls(cells, block, 3, length, tuple((0, 1, 2) for _ in range(cells)))
        return cls(cells, block, layers, length,
                   tuple(tuple(range(3 * i, min(3 * i + 3, layers))) for i in range(cells)))

    def starts(self) -> list[int]:
        return [self.block * (self.first + 2 * i) for i in range(self.cells)]

    def groups(self) -> list[int]:
        """The kernels' flattened (cell, source layer, first row, end row, g) per group."""
        flat: list[int] = []
        for i, (start, sources) in enumerate(zip(self.starts(), self.sources)):
            for g, m in enumerate(sources):
                flat += [i, m, 0, start, g]
        return flat

    def visible_keys(self) -> int:
        """Σ over the cells' queries of the keys each reads: its own causal keys and every
        group's rows before the block."""
        own = self.block * (self.block + 1) // 2
        return sum(own + len(sources) * start * self.block
                   for start, sources in zip(self.starts(), self.sources))

    def check(self) -> None:
        if self.starts()[-1] + self.block > self.length:
            raise SystemExit(f"megabeta bench attention: {self.cells} cells of {self.block} "
                             f"queries on blocks 2, 4, ... need --length >= "
                             f"{self.starts()[-1] + self.block}")
        if any(not sources for sources in self.sources):
            raise SystemExit(f"megabeta bench attention: {self.cells} cells 3 layers apart "
                             f"need --layers >= {3 * (self.cells - 1) + 1}")


def _best(fn: Callable[[], object], repeats: int) -> float:
    """Seconds a call: the best of 7 rounds of `repeats` calls, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def _time_wave(wave: Wave, batch: int, heads: int, dim: int, repeats: int, *,
               backward: bool = True) -> tuple[float, float | None]:
    """Forward and backward seconds of one call over `wave` (backward None: not timed)."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    c, n = wave.cells, wave.block
    q, k, v, grad = (rand(c, batch, heads, n, dim) for _ in range(4))
    hist_k, hist_v = (rand(wave.layers, batch, heads, wave.length, dim) for _ in range(2))
    shift, self_bias = torch.rand(c, 3, heads, generator=gen), torch.rand(c, generator=gen)
    starts, groups, scale = wave.starts(), wave.groups(), dim ** -0.5
    out, lse = cpu_attention.forward(q, k, v, hist_k, hist_v, shift, self_bias, None, starts,
                                     groups, scale)
    grad_k, grad_v = torch.zeros_like(hist_k), torch.zeros_like(hist_v)
    forward = _best(lambda: cpu_attention.forward(q, k, v, hist_k, hist_v, shift, self_bias,
                                                  None, starts, groups, scale), repeats)
    if not backward:
        return forward, None
    return forward, _best(lambda: cpu_attention.backward(
        grad, q, k, v, hist_k, hist_v, out, lse, shift, self_bias, None, grad_k, grad_v,
        starts, groups, 3, scale), repeats)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="megabeta bench attention", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="batch rows (default 8)")
    parser.add_argument("--heads", type=int, default=3, help="heads (default 3: beta_1.2_test)")
    parser.add_argument("--head-dim", type=int, default=64, help="head width (default 64)")
    parser.add_argument("--layers", type=int, default=20,
                        help="layers of the cold history (default 20)")
    parser.add_argument("--length", type=int, default=512,
                        help="history rows, and the standard cell's queries (default 512)")
    parser.add_argument("--block", type=int, default=32, help="queries a cell, c (default 32)")
    parser.add_argument("--cells", type=int, default=7, help="cells in the wave (default 7)")
    parser.add_argument("--repeats", type=int, default=10,
                        help="calls a round, best of 7 rounds (default 10)")
    args = parser.parse_args(argv)
    if not cpu_attention.build():
        raise SystemExit("megabeta bench attention: the fused CPU kernels did not build (the "
                         "warning above says why)")
    rows = []
    for name, warm in (("wave, cold history", False), ("wave, warm history", True)):
        wave = Wave.spread(args.cells, args.block, args.layers, args.length, warm=warm)
        wave.check()
        fwd, bwd = _time_wave(wave, args.batch, args.heads, args.head_dim, args.repeats,
                              backward=not warm)
        rows.append((name, wave.visible_keys(), fwd, bwd))
    standard = Wave(1, args.length, 1, 0, ((),), first=0)
    fwd, bwd = _time_wave(standard, args.batch, args.heads, args.head_dim, args.repeats)
    rows.append(("standard cell", standard.visible_keys(), fwd, bwd))

    print(f"## CPU attention kernels, batch {args.batch}, {args.heads} heads of "
          f"{args.head_dim}, {torch.get_num_threads()} threads\n")
    print("| call | forward ms | forward GFLOP/s | backward ms | backward GFLOP/s |")
    print("|---|---|---|---|---|")
    rates = []
    for name, keys, fwd, bwd in rows:
        flops = 4 * args.head_dim * keys * args.batch * args.heads
        rates.append(flops / fwd)
        back = "- | -" if bwd is None else f"{bwd * 1e3:.2f} | {2.5 * flops / bwd / 1e9:.0f}"
        print(f"| {name} | {fwd * 1e3:.2f} | {flops / fwd / 1e9:.0f} | {back} |")
    print(f"\n- the wave's forward FLOP/s with its history warm against cold: "
          f"{rates[1] / rates[0]:.2f}x")

if __name__ == "__main__":
    main()
