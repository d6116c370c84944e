"""``merge``: concatenate datasets made separately (other machines, other days) into one, in order.

All inputs must hold the same token type and, where they have sidecars, come from the same
tokenizer model. The output's sidecar sums their counts (every count of their reports: what
was skipped, repaired or cut stays counted) and lists what was merged. When any input
has a loss mask the output has one too, in which the inputs without a mask score every target
(what no mask means).
"""

from __future__ import annotations

from dataclasses import dataclass

from data_tools.report import merged_report
from data_tools.writer import IndexedDatasetWriter
from megabeta.data.errors import DataError
from megabeta.data.indexed import IndexedDataset


@dataclass(frozen=True)
class MergeConfig:
    """What ``megabeta-data merge`` does."""

    inputs: list[str]
    """Dataset prefixes, concatenated in this order."""
    output_prefix: str
    """Writes OUTPUT_PREFIX.bin, .idx and .json."""
    overwrite: bool = False
    """Replace an existing dataset at OUTPUT_PREFIX."""


def merge(config: MergeConfig) -> dict:
    """Merge the datasets; returns the output sidecar."""
    if not config.inputs:
        raise DataError("no datasets to merge; pass their prefixes to --inputs")
    sources = [IndexedDataset(prefix) for prefix in config.inputs]
    tokenizer = _common_tokenizer(sources)
    with IndexedDatasetWriter(config.output_prefix, sources[0].dtype, overwrite=config.overwrite,
                              loss_mask=any(s.has_loss_mask for s in sources)) as writer:
        for source in sources:
            writer.add_dataset(source)
        return writer.commit({
            "tokenizer": tokenizer,
            "add_bos": False,
            "append_eos": all((s.sidecar or {}).get("append_eos", False) for s in sources),
            "inputs": [entry for s in sources for entry in (s.sidecar or {}).get("inputs", [])],
            "merged_from": [{"prefix": str(s.paths.prefix), "num_documents": s.num_documents,
                             "num_tokens": s.num_tokens} for s in sources],
            "report": merged_report([(s.sidecar or {}).get("report", {}) for s in sources]),
        })


def _common_tokenizer(sources: list[IndexedDataset]) -> dict | None:
    """The tokenizer all sidecars name; DataError naming the dataset that differs."""
    first = sources[0]
    for source in sources:
        if source.dtype != first.dtype:
            raise DataError(f"{source.paths.idx}: holds {source.dtype} tokens but "
                            f"{first.paths.idx} holds {first.dtype}; merge only datasets made by "
                            "the same tokenizer")
        if source.tokenizer_sha256 != first.tokenizer_sha256:
            raise DataError(f"{source.paths.prefix} ({_describe(source)}) and {first.paths.prefix} "
                            f"({_describe(first)}) were not made by the same tokenizer; merge only "
                            "datasets of one model (re-tokenize the odd one out)")
    return None if first.sidecar is None else first.sidecar.get("tokenizer")


def _describe(source: IndexedDataset) -> str:
    if source.sidecar is None:
        return "no sidecar, tokenizer unknown"
    return f"tokenizer sha256 {source.tokenizer_sha256}"
