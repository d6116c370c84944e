"""``inspect``: counts, a length histogram, decoded samples, and checks of a token dataset.

Checks: the index and the ``.bin`` agree (sizes, every pointer); every id is below the vocabulary
size; the sidecar matches the index and the tokenizer file; every document ends with EOS when the
sidecar says EOS was appended; the loss mask, when there is one, holds only 0 and 1 and matches
its sidecar entry (scored-token count, SHA-256). Opening the dataset already fails on a truncated
or mismatched pair (or mask); the rest are reported one by one so a single run shows everything
that is wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

from data_tools.report import report_lines
from data_tools.tokenizer import load_tokenizer
from megabeta.data.errors import DataError
from megabeta.data.format import dtype_code
from megabeta.data.indexed import IndexedDataset

_BAR_WIDTH = 40


@dataclass(frozen=True)
class InspectConfig:
    """What ``megabeta-data inspect`` shows."""

    prefix: str
    """Dataset prefix (PREFIX.bin/.idx/.json)."""
    tokenizer: str | None = None
    """Model for decoding and the hash check; default: the one the sidecar names, if present."""
    samples: int = 1
    """Documents to decode."""
    sample_tokens: int = 64
    """Tokens shown per decoded document."""


def inspect(config: InspectConfig, out: TextIO) -> list[str]:
    """Print the report to ``out``; returns the failed checks' messages (empty: all good)."""
    dataset = IndexedDataset(config.prefix)
    lengths = document_lengths(dataset)
    _print_counts(dataset, lengths, out)
    _print_report(dataset, out)
    _print_histogram(lengths, out)
    processor, tokenizer_note = _tokenizer_for(dataset, config.tokenizer)
    vocab_size = processor.vocab_size if processor is not None else dataset.vocab_size
    failures = []
    print("checks:", file=out)
    for name, check in _checks(dataset, lengths, vocab_size, config.tokenizer, tokenizer_note):
        try:
            detail = check()
        except DataError as err:
            failures.append(str(err))
            print(f"  FAIL  {name}: {err}", file=out)
        else:
            print(f"  {'ok' if detail[0] else 'skip':4}  {name}: {detail[1]}", file=out)
    if processor is not None:
        _print_samples(dataset, processor, config, out)
    else:
        print(f"samples: not decoded ({tokenizer_note})", file=out)
    return failures


def document_lengths(dataset: IndexedDataset) -> np.ndarray:
    """Tokens per document (a document may span several sequences in Megatron datasets)."""
    starts = np.append(dataset.sequence_pointers // dataset.dtype.itemsize, dataset.num_tokens)
    return np.diff(starts[dataset.document_indices])


def _print_counts(dataset: IndexedDataset, lengths: np.ndarray, out: TextIO) -> None:
    paths = dataset.paths
    print(f"dataset    {paths.prefix}  (.bin {paths.bin.stat().st_size:,} bytes, .idx "
          f"{paths.idx.stat().st_size:,} bytes, sidecar "
          f"{'yes' if dataset.sidecar is not None else 'none'})", file=out)
    print(f"dtype      {dataset.dtype} (MMIDIDX code {dtype_code(dataset.dtype)})", file=out)
    print(f"documents  {dataset.num_documents:,}   sequences {len(dataset):,}   tokens "
          f"{dataset.num_tokens:,}", file=out)
    scored = ((dataset.sidecar or {}).get("loss_mask") or {}).get("scored_tokens")
    if not dataset.has_loss_mask:
        print("loss mask  none (every target scored)", file=out)
    elif not isinstance(scored, int):
        print(f"loss mask  {paths.mask.name} ({paths.mask.stat().st_size:,} bytes; no scored "
              "count in a sidecar, see the check below)", file=out)
    else:
        share = scored / max(dataset.num_tokens, 1)
        print(f"loss mask  {paths.mask.name}: {scored:,} of {dataset.num_tokens:,} tokens "
              f"scored ({100 * share:.1f} %)", file=out)
    if lengths.size:
        print(f"length     min {int(lengths.min()):,}  mean {lengths.mean():,.1f}  median "
              f"{float(np.median(lengths)):,.0f}  max {int(lengths.max()):,} tokens per document",
              file=out)


def _print_report(dataset: IndexedDataset, out: TextIO) -> None:
    """What making the dataset skipped, repaired or cut (the sidecar's report)."""
    if dataset.sidecar is None or "report" not in dataset.sidecar:
        return
    lines = [line.removeprefix("warning: ") for line in report_lines(dataset.sidecar["report"])]
    print(f"input      {lines[0] if lines else 'nothing skipped, repaired or cut'}", file=out)
    for line in lines[1:]:
        print(f"           {line}", file=out)


def _print_histogram(lengths: np.ndarray, out: TextIO) -> None:
    """Documents per power-of-two length bucket."""
    if not lengths.size:
        return
    buckets = np.zeros(64, dtype=np.int64)
    np.add.at(buckets, np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64), 1)
    zero = int(np.count_nonzero(lengths == 0))
    buckets[0] -= zero
    print("histogram  tokens per document:", file=out)
    rows = [("0", zero)] if zero else []
    rows += [(f"{2**b:,}-{2**(b + 1) - 1:,}", int(buckets[b])) for b in range(64) if buckets[b]]
    peak = max(count for _, count in rows)
    for label, count in rows:
        bar = "#" * max(1, round(_BAR_WIDTH * count / peak))
        print(f"  {label:>17}  {count:>10,}  {bar}", file=out)


def _tokenizer_for(dataset: IndexedDataset, given: str | None):
    """The processor to decode with (or None) and a note saying where it came from."""
    path = given or (dataset.sidecar or {}).get("tokenizer", {}).get("path")
    if path is None:
        return None, "no --tokenizer and no sidecar naming one"
    if given is None and not Path(path).is_file():
        return None, f"the sidecar's tokenizer {path} is not here; pass --tokenizer"
    processor = load_tokenizer(path)
    if given is None and processor.info.sha256 != dataset.tokenizer_sha256:
        return None, f"{path} is not the model the sidecar names (sha256 differs); pass --tokenizer"
    return processor, f"{path}"


Check = Callable[[], tuple[bool, str]]


def _checks(dataset: IndexedDataset, lengths: np.ndarray, vocab_size: int | None,
            given_tokenizer: str | None, tokenizer_note: str) -> list[tuple[str, Check]]:
    def index_and_bin() -> tuple[bool, str]:
        dataset.validate()
        return True, (f"{len(dataset):,} sequences back to back, .bin holds "
                      f"{dataset.num_tokens:,} tokens")

    def token_ids() -> tuple[bool, str]:
        if vocab_size is None:
            return False, "vocabulary size unknown (no sidecar, no --tokenizer)"
        highest = dataset.check_token_ids(vocab_size)
        return True, f"max id {highest} < vocabulary size {vocab_size}"

    def sidecar() -> tuple[bool, str]:
        if dataset.sidecar is None:
            return False, "no sidecar (datasets from other tools have none)"
        if given_tokenizer is not None:
            info = load_tokenizer(given_tokenizer).info
            if info.sha256 != dataset.tokenizer_sha256:
                raise DataError(f"{dataset.paths.sidecar}: made with tokenizer sha256 "
                                f"{dataset.tokenizer_sha256}, but {given_tokenizer} has sha256 "
                                f"{info.sha256}; use the model the dataset was made with")
        return True, ("documents, sequences, tokens and dtype agree with the index; tokenizer: "
                      + tokenizer_note)

    def end_with_eos() -> tuple[bool, str]:
        sidecar_fields = dataset.sidecar or {}
        eos = sidecar_fields.get("tokenizer", {}).get("eos_id")
        if not sidecar_fields.get("append_eos") or eos is None:
            return False, "the sidecar does not say EOS was appended"
        ends = np.cumsum(lengths)[lengths > 0] - 1
        wrong = np.flatnonzero(np.asarray(dataset.tokens[ends]) != eos)
        if wrong.size:
            first = int(np.flatnonzero(lengths > 0)[wrong[0]])
            raise DataError(f"{dataset.paths.bin}: {wrong.size} document(s) do not end with EOS "
                            f"{eos} (first: document {first}); the .bin does not match its index, "
                            "re-run tokenize")
        return True, f"all {ends.size:,} non-empty documents end with EOS id {eos}"

    def loss_mask() -> tuple[bool, str]:
        if not dataset.has_loss_mask:
            return False, "no loss mask"
        scored = dataset.check_loss_mask()
        where = "the sidecar's count and sha256" if (dataset.sidecar or {}).get("loss_mask") \
            else "no sidecar entry to compare"
        return True, f"{scored:,} scored tokens, only 0 and 1, {where}"

    return [("index and .bin agree", index_and_bin),
            ("token ids below the vocabulary size", token_ids),
            ("sidecar matches", sidecar),
            ("documents end with EOS", end_with_eos),
            ("loss mask matches the sidecar", loss_mask)]


def _print_samples(dataset: IndexedDataset, processor, config: InspectConfig,
                   out: TextIO) -> None:
    count = min(config.samples, dataset.num_documents)
    picks = np.unique(np.linspace(0, dataset.num_documents - 1, count).astype(np.int64)) \
        if count else []
    for document in picks:
        start, end = dataset.document_token_range(int(document), int(document) + 1)
        ids = [int(t) for t in dataset.tokens[start:min(end, start + config.sample_tokens)]]
        more = "" if end - start <= len(ids) else f" (first {len(ids)} of {end - start})"
        print(f"sample     document {int(document)}{more}", file=out)
        print(f"  ids      {ids}", file=out)
        print(f"  text     {processor.decode(ids)!r}", file=out)
        if dataset.has_loss_mask:
            mask = dataset.loss_masks[start:start + len(ids)]
            print(f"  mask     {''.join(map(str, mask.tolist()))}", file=out)
            print(f"  scored   {processor.decode([i for i, m in zip(ids, mask) if m])!r}",
                  file=out)
