"""Padding of the three ways to pack documents into samples (docs/data.md, spec §7).

    python -m megabeta.bench packing                       # the demo corpus and a long-document one
    python -m megabeta.bench packing --data PREFIX [...]   # datasets of your own

For each corpus: the share of the samples' input positions that are padding with
``data.align = "packed"`` (none, by construction), ``"block"`` for each ``--blocks`` size c (each
document starts at a multiple of c), and ``"document"`` (one document per sample). Padding is
compute spent on nothing, so the share is the throughput lost against packed samples.

The corpora: the demo's (``make demo``: Python's standard-library files as documents, a 4096-piece
BPE tokenizer, tokenized by ``megabeta-data``, built here under ``--workdir``), and two synthetic
ones whose token ids are random (only the lengths matter): long documents (log-normal lengths,
median ``--long-median`` tokens) and short ones (uniform 64-300 tokens, issue 31's mix for the
cost of the mask). Every figure comes from the datasets' own ``padding_share``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from data_tools.writer import IndexedDatasetWriter
from megabeta.data import BlockAlignedDataset, DocumentDataset, IndexedDataset
from megabeta.demo import build_corpus


def demo_dataset(workdir: Path, max_files: int, vocab_size: int) -> Path:
    """The demo's dataset (the same commands as ``make demo``); returns its prefix."""
    corpus = workdir / "stdlib.jsonl"
    build_corpus(corpus, max_files)
    py = sys.executable
    subprocess.run([py, "-m", "data_tools", "train-tokenizer", "--inputs", str(corpus),
                    "--vocab-size", str(vocab_size), "--output", str(workdir / "tok"),
                    "--max-sentences", "200000", "--overwrite", "--quiet"], check=True)
    subprocess.run([py, "-m", "data_tools", "tokenize", "--tokenizer", str(workdir / "tok.model"),
                    "--inputs", str(corpus), "--output-prefix", str(workdir / "stdlib"),
                    "--workers", "2", "--overwrite"], check=True, capture_output=True)
    return workdir / "stdlib"


def synthetic_dataset(prefix: Path, lengths: np.ndarray, seed: int) -> Path:
    """Documents of the given lengths, random token ids; returns the prefix."""
    tokens = np.random.default_rng(seed).integers(4, 4096, int(lengths.sum())).astype(np.uint16)
    with IndexedDatasetWriter(prefix, np.uint16, overwrite=True) as writer:
        writer.add_documents(tokens, lengths)
        writer.commit({"tokenizer": {"vocab_size": 4096}})
    return prefix


def measure(prefix: Path, seq_len: int, blocks: list[int]) -> dict[str, float | int]:
    """Document statistics and the padding share of each way to pack."""
    source = IndexedDataset(prefix)
    lengths = np.diff(source.document_starts)
    row: dict[str, float | int] = {
        "documents": len(lengths), "tokens": int(lengths.sum()),
        "median": int(np.median(lengths)), "mean": float(lengths.mean()),
        "longer": float((lengths > seq_len).mean()), "packed": 0.0}
    for block in blocks:
        row[f"block {block}"] = BlockAlignedDataset(source, seq_len, block).padding_share
    row["document"] = DocumentDataset(source, seq_len).padding_share
    return row


def table(rows: dict[str, dict], seq_len: int, blocks: list[int]) -> str:
    ways = ["packed", *(f"block {c}" for c in blocks), "document"]
    lines = [f"seq_len {seq_len}; share of the samples' input positions that are padding",
             "",
             "| corpus | documents | tokens | median / mean length | longer than a sample | "
             + " | ".join(f"`{w}`" for w in ways) + " |",
             "|---" * (5 + len(ways)) + "|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['documents']} | {row['tokens']} | {row['median']} / "
                     f"{row['mean']:.0f} | {100 * row['longer']:.1f} % | "
                     + " | ".join(f"{100 * row[w]:.1f} %" for w in ways) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="megabeta bench packing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", nargs="*", default=None, metavar="PREFIX",
                        help="datasets to measure instead of the demo and long corpora")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sample (512)")
    parser.add_argument("--blocks", default="32,64,256",
                        help="block sizes c, comma-separated (32,64,256)")
    parser.add_argument("--workdir", default="", help="where the corpora are built (a temp dir)")
    parser.add_argument("--demo-files", type=int, default=600,
                        help="standard-library files in the demo corpus, as `make demo` (600)")
    parser.add_argument("--documents", type=int, default=2000,
                        help="documents of each synthetic corpus (2000)")
    parser.add_argument("--long-median", type=int, default=2048,
                        help="median length in tokens of the long corpus's documents (2048)")
    args = parser.parse_args(argv)
    blocks = [int(b) for b in args.blocks.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        workdir = Path(args.workdir or scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        if args.data:
            prefixes = {str(p): Path(p) for p in args.data}
        else:
            prefixes = {
                f"demo (stdlib, {args.demo_files} files)": demo_dataset(workdir, args.demo_files,
                                                                        4096),
                f"long (log-normal, median {args.long_median})": synthetic_dataset(
                    workdir / "long", np.maximum(2, rng.lognormal(
                        np.log(args.long_median), 1.0, args.documents).astype(np.int64)), 1),
                "short (uniform 64-300)": synthetic_dataset(
                    workdir / "short", rng.integers(64, 301, args.documents), 2)}
        rows = {name: measure(prefix, args.seq_len, blocks) for name, prefix in prefixes.items()}
    print(table(rows, args.seq_len, blocks))


if __name__ == "__main__":
    main()
