"""`python -m megabeta.bench NAME [options]`: run one benchmark (`model` or `data`)."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {"model": "megabeta.bench.model", "data": "megabeta.bench.data",
              "train": "megabeta.bench.train"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: python -m megabeta.bench {{{','.join(BENCHMARKS)}}} [options]\n"
              "  model  beta_1.2 vs the standard arm: time, FLOP/s, prefill/decode, memory\n"
              "  data   tokenization and loader throughput, tokenizer memory\n"
              "  train  tokens/s and MFU per parallel backend, framework overhead, checkpoints\n"
              "Each takes --help.", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
