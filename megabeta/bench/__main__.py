"""`megabeta bench NAME [options]` (or `python -m megabeta.bench NAME`): run one benchmark."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {"model": "megabeta.bench.model", "data": "megabeta.bench.data",
              "train": "megabeta.bench.train", "dispatch": "megabeta.bench.dispatch",
              "gpu": "megabeta.bench.gpu", "checkpoint": "megabeta.bench.checkpoint",
              "wavefront": "megabeta.bench.wavefront",
              "kernels": "megabeta.bench.kernels", "roofline": "megabeta.bench.roofline",
              "trace": "megabeta.bench.trace",
              "packing": "megabeta.bench.packing", "documents": "megabeta.bench.documents",
              "hf": "megabeta.bench.hf_export", "host": "megabeta.bench.host",
              "attention": "megabeta.bench.attention"}
PROG = "megabeta bench"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: {PROG} {{{','.join(BENCHMARKS)}}} [options]\n"
              "  model  beta_1.2 vs the standard arm: time, FLOP/s, prefill/decode, memory\n"
              "  data   tokenization and loader throughput, tokenizer memory\n"
              "  train  tokens/s and MFU per parallel backend, framework overhead, checkpoints\n"
              "  dispatch  kernel launches per (block, layer) cell of a training step\n"
              "  gpu    one CUDA GPU: speed eager/compiled/graphed, largest micro-batch, "
              "share of the roofline\n"
              "  host   the GPU path's host time per cell (no kernel run), launches per "
              "micro-step\n"
              "  attention  the CPU attention kernels alone: a wave's cells (cold and warm "
              "history), a standard cell\n"
              "  checkpoint  what fsync (durable commits) adds to a checkpoint save\n"
              "  wavefront  the wavefront schedule vs the block schedule and standard (paired)\n"
              "  kernels  every Triton kernel compiled for sm_80/sm_90 (no GPU): registers, "
              "spills\n"
              "  roofline  the training step's FLOPs and HBM bytes per part, its time bound, "
              "MFU ceiling\n"
              "  trace  a run's profiler trace drawn as a timeline PNG (no browser needed)\n"
              "  packing  padding share of packed, block-aligned and one-document samples\n"
              "  documents  a training step with a document mask vs without (CPU, paired)\n"
              "  hf     export --format hf and reload of a model: seconds, peak memory\n"
              f"Each takes --help ({PROG} model --help).", file=sys.stderr)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"{PROG}: error: unknown benchmark {argv[0]!r}; choose one of "
                  f"{', '.join(BENCHMARKS)}", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
