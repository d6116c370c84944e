"""What a document mask (spec §7) costs on the CPU: a training step with and without it.

    python -m megabeta.bench documents [--rounds N] [--batch B] [--seq-len T]

Samples of `--seq-len` tokens packed unaligned from documents of 64-300 tokens (uniform,
seeded: issue 31's mix, as `bench packing`'s short corpus), `--batch` of them; the preset
(`beta_1.2_test`) on the `cpu` attention backend. Per schedule (block, wavefront), the training step
(forward + backward) with the documents' mask and without it, alternating in one process
(`bench wavefront`'s `paired`, one warm-up round): the median ms of each and the ratio.

The mask saves work only where the fused kernels skip it: the finished groups' key rows below
a query tile's smallest document bound (the tiles are at most one block of c queries, so that
is the block's smallest bound). `skipped_share` counts those rows from the documents alone;
`masked_share` is the ideal, every query row's keys before its own document.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import numpy as np
import torch

from megabeta.bench.wavefront import paired
from megabeta.model import DecoderLM, ExecutionConfig, build_model, get_preset
from megabeta.model.documents import document_starts


def packed_documents(batch: int, length: int, low: int, high: int, seed: int) -> torch.Tensor:
    """Document ids `[batch, length]` of documents of `low`-`high` tokens (uniform, seeded)
    packed end to end and cut into samples, unaligned: a document cut by a sample's end
    continues at the next sample's start."""
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    doc = 0
    while len(ids) < batch * length:
        ids += [doc] * int(rng.integers(low, high + 1))
        doc += 1
    return torch.tensor(ids[:batch * length]).view(batch, length)


def skipped_share(starts: torch.Tensor, block: int) -> float:
    """The share of the finished groups' key rows (spec §3: every position before a query's
    block) that the fused kernels skip with document starts `starts [B, T]`: per block, the
    rows below its smallest bound. The same for every group, so a share of all their work."""
    return _share(starts, block, lambda bounds: bounds.min(dim=1, keepdim=True).values)


def masked_share(starts: torch.Tensor, block: int) -> float:
    """The share of the finished groups' key rows that the mask excludes, row by row (what a
    kernel skipping every masked key would save)."""
    return _share(starts, block, lambda bounds: bounds)


def _share(starts: torch.Tensor, block: int,
           skipped: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """Σ over queries of the finished rows `skipped(bounds)` skips (bounds of one block
    `[B, n]`), over Σ of the finished rows they read unmasked."""
    length = starts.shape[1]
    total = saved = 0
    for s in range(block, length, block):
        bounds = starts[:, s:s + block]
        total += s * bounds.numel()
        saved += int(torch.clamp(skipped(bounds), max=s).expand_as(bounds).sum())
    return saved / total if total else 0.0


def _step(model: DecoderLM, tokens: torch.Tensor,
          ids: torch.Tensor | None) -> Callable[[], float]:
    """One timed training step (forward and backward), masked by `ids` (None: unmasked)."""
    def step() -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model(tokens[:, :-1], tokens[:, 1:], documents=ids).backward()
        return time.perf_counter() - start
    return step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="megabeta bench documents", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="beta_1.2_test")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = get_preset(args.preset, vocab_size=8192, max_seq_len=args.seq_len + 1)
    # Ids of the inputs (the targets are the next tokens, unmasked: the loss is per token).
    ids = packed_documents(args.batch, args.seq_len + 1, 64, 300, args.seed)[:, :-1]
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(args.seed))
    starts = document_starts(ids, ids)
    c = config.block_size
    print(f"{args.preset} (c = {c}), batch {args.batch} x {args.seq_len}, documents of 64-300 "
          f"tokens packed unaligned ({int(ids.max() - ids.min()) + 1} in the batch), "
          f"cpu attention, float32, {torch.get_num_threads()} threads, {args.rounds} rounds")
    print(f"finished-group key rows skipped by the fused kernels: "
          f"{skipped_share(starts, c):.1%} (masked row by row: {masked_share(starts, c):.1%})")
    print("| schedule | unmasked ms | masked ms | masked / unmasked |")
    print("|---|---|---|---|")
    for schedule in ("block", "wavefront"):
        torch.manual_seed(0)
        model = build_model(config, ExecutionConfig(attention="cpu", schedule=schedule))
        times = paired({"unmasked": _step(model, tokens, None),
                        "masked": _step(model, tokens, ids)}, args.rounds)
        print(f"| {schedule} | {times['unmasked'] * 1e3:.0f} | {times['masked'] * 1e3:.0f} | "
              f"{times['masked'] / times['unmasked']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
