"""One call from dataset prefixes to the training and validation sample datasets of a run.

``build_train_val`` opens each prefix, checks that every dataset was made by the same tokenizer (the
one the run names, when it names one), splits each into train/validation document ranges, cuts
each range into ``seq_len + 1``-token samples (packed across documents, packed with each document
at a multiple of the model's block size, or aligned to document starts), with each input's
document id when asked, and blends several datasets by weight.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from megabeta.data.blend import BlendedDataset, SampleDataset
from megabeta.data.errors import DataError
from megabeta.data.format import file_sha256
from megabeta.data.indexed import IndexedDataset
from megabeta.data.packed import BlockAlignedDataset, DocumentDataset, PackedDataset
from megabeta.data.sampler import GlobalSampler
from megabeta.data.split import split_documents

log = logging.getLogger("megabeta")

ALIGN_MODES = ("packed", "block", "document")
"""How samples are cut: across document boundaries (PackedDataset), the same with every document
starting at a multiple of the block size (BlockAlignedDataset), or one per document start
(DocumentDataset)."""


@dataclass
class TrainValData:
    """The sample datasets of a run and what the model needs to know about their tokens."""

    train: SampleDataset
    val: SampleDataset | None
    """None when ``val_fraction`` is 0."""
    sources: list[IndexedDataset]
    vocab_size: int | None
    """From the sidecars (None when the datasets have none)."""
    tokenizer_sha256: str | None
    special_ids: dict[str, int]
    """``pad_id``, ``bos_id``, ``eos_id``, ``unk_id`` from the sidecars (empty without them)."""

    def train_sampler(self, world_size: int, rank: int, seed: int) -> GlobalSampler:
        """Endless shuffled stream over ``train``, keyed to its fingerprint for safe resumes."""
        return GlobalSampler(len(self.train), world_size, rank, seed,
                             fingerprint=self.train.fingerprint)

    def val_sampler(self, world_size: int, rank: int) -> GlobalSampler:
        """One pass over ``val`` in order, so every evaluation sees the same samples. Build one per
        evaluation: a :class:`StatefulLoader` advances it to the end."""
        if self.val is None:
            raise DataError("no validation data: build with val_fraction > 0")
        return GlobalSampler(len(self.val), world_size, rank, shuffle=False, num_epochs=1,
                             fingerprint=self.val.fingerprint)

    def require_vocab_size(self, setting: str) -> int:
        """The sidecars' vocabulary size; DataError naming the missing (or silent) sidecar file
        and how to make it when there is none. ``setting`` says what needs it."""
        if self.vocab_size is not None:
            return self.vocab_size
        sidecar = self.sources[0].paths.sidecar
        if self.sources[0].sidecar is None:
            raise DataError(f"{sidecar}: missing; {setting} takes the vocabulary size from this "
                            "sidecar, which `megabeta-data tokenize` writes next to the .bin and "
                            ".idx: re-run megabeta-data tokenize on the corpus, or set "
                            "--model.vocab_size to the tokenizer's vocabulary size")
        raise DataError(f"{sidecar}: records no tokenizer.vocab_size; {setting} takes the "
                        "vocabulary size from it: re-run megabeta-data tokenize to rewrite it, or "
                        "set --model.vocab_size to the tokenizer's vocabulary size")

    def tokenizer_record(self, named: str | os.PathLike = "") -> dict[str, str]:
        """The tokenizer to record with a model trained on this data: ``path`` and ``sha256`` of
        ``named`` (the run's data.tokenizer, which ``build_train_val`` checked against the
        datasets), else of the one the sidecars name; ``{}`` when neither is known."""
        if named:
            return {"path": str(Path(named).resolve()),
                    "sha256": self.tokenizer_sha256 or file_sha256(named)}
        if self.tokenizer_sha256 is None:
            return {}
        return {"path": _tokenizer_path(self.sources[0]), "sha256": self.tokenizer_sha256}


def build_train_val(prefixes: Sequence[str | os.PathLike], weights: Sequence[float] | None = None,
                    seq_len: int = 2048, val_fraction: float = 0.0,
                    expected_tokenizer_hash: str | None = None,
                    verify_token_ids: bool = False, align: str = "packed",
                    document_mask: bool = False, block_size: int = 0) -> TrainValData:
    """Train and validation datasets of ``seq_len + 1``-token samples.

    ``weights`` (one per prefix, default: proportional to size) blend several datasets;
    ``val_fraction`` of each dataset's documents (its last ones) become validation data;
    ``expected_tokenizer_hash`` (``megabeta.data.file_sha256`` of the run's tokenizer model) makes
    a dataset made by another tokenizer an error; ``verify_token_ids`` scans every token against
    the vocabulary size, and every loss mask against its sidecar (O(tokens), off by default);
    ``align`` is ``"packed"`` (samples cut across documents), ``"block"`` (the same, each document
    starting at a multiple of ``block_size``, padded: :class:`BlockAlignedDataset`) or
    ``"document"`` (one sample per document, padded and masked past its end; documents longer
    than a sample are left out, and their count is logged: :class:`DocumentDataset`); ``document_mask`` adds each input's document id to the samples
    (``"block"`` needs it: the alignment only makes documents independent under the mask).
    """
    if align not in ALIGN_MODES:
        raise DataError(f"align {align!r}: must be one of {', '.join(ALIGN_MODES)}")
    if align == "block" and not document_mask:
        raise DataError("align 'block' without document_mask: block alignment only makes a "
                        "document's logits those of the document alone under the document "
                        "mask (spec §7); set data.document_mask = true, or use align 'packed'")
    if not prefixes:
        raise DataError("no dataset prefixes given; pass at least one PREFIX (of PREFIX.bin/.idx)")
    if weights is not None and len(weights) != len(prefixes):
        raise DataError(f"{len(weights)} weights for {len(prefixes)} datasets; give one weight "
                        "per dataset prefix")
    sources = [IndexedDataset(prefix) for prefix in prefixes]
    for source in sources:
        source.validate()  # the index's consistency: O(sequences), the tokens are not read
    tokenizer_hash = _common_tokenizer(sources, expected_tokenizer_hash)
    vocab_size = sources[0].vocab_size
    if verify_token_ids:
        for source in sources:
            source.check_token_ids()
            if source.has_loss_mask:
                source.check_loss_mask()
    special = (sources[0].sidecar or {}).get("tokenizer", {})

    pad_id = max(special.get("pad_id", 0), 0)

    def samples(source: IndexedDataset, documents: range, name: str) -> SampleDataset:
        if align == "document":
            dataset = DocumentDataset(source, seq_len, documents, name=name, pad_id=pad_id,
                                      document_ids=document_mask)
            if dataset.dropped:
                log.info("data.align = document: %d of %d documents of %s (%s) are longer "
                            "than a sample (data.seq_len + 1 = %d tokens; the longest %d) and "
                            "are left out", dataset.dropped, len(documents),
                            source.paths.prefix, name, seq_len + 1, dataset.longest)
            return dataset
        if align == "block":
            return BlockAlignedDataset(source, seq_len, block_size, documents, name=name,
                                       pad_id=pad_id)
        return PackedDataset(source, seq_len, source.document_token_range(
            documents.start, documents.stop), name=name, document_ids=document_mask)

    train_parts, val_parts = [], []
    for source in sources:
        train_docs, val_docs = split_documents(source.num_documents, val_fraction,
                                               str(source.paths.prefix))
        train_parts.append(samples(source, train_docs, "training split"))
        if val_docs:
            val_parts.append(samples(source, val_docs,
                                     f"validation split, val_fraction {val_fraction}"))
    return TrainValData(
        train=_combine(train_parts, weights),
        val=_combine(val_parts, weights) if val_parts else None,
        sources=sources,
        vocab_size=vocab_size,
        tokenizer_sha256=tokenizer_hash,
        special_ids={key: special[key] for key in ("pad_id", "bos_id", "eos_id", "unk_id")
                     if key in special},
    )


class DataSettings(Protocol):
    """What `build_run_data` reads of a run's [data] section (megabeta.config.DataConfig; named
    here by shape: the data package does not import the run config)."""

    path: list[str]
    weights: list[float]
    seq_len: int
    val_fraction: float
    tokenizer: str
    verify_token_ids: bool
    align: str
    document_mask: bool


def build_run_data(settings: DataSettings, *, block_size: int,
                   tokenizer: str | os.PathLike = "") -> TrainValData:
    """The data of a run's [data] settings, exactly as the trainer builds it: `megabeta-data
    inspect --run` rebuilds a run's samples through this too, so it shows what the run read.
    ``block_size``: the model's (``data.align = "block"`` aligns documents to it).
    ``tokenizer`` (default: ``settings.tokenizer``) must be the one the datasets were made with."""
    tokenizer = tokenizer or settings.tokenizer
    return build_train_val(settings.path, settings.weights or None, seq_len=settings.seq_len,
                           val_fraction=settings.val_fraction,
                           expected_tokenizer_hash=file_sha256(tokenizer) if tokenizer else None,
                           verify_token_ids=settings.verify_token_ids, align=settings.align,
                           document_mask=settings.document_mask, block_size=block_size)


def _combine(parts: list[SampleDataset], weights: Sequence[float] | None) -> SampleDataset:
    if len(parts) == 1:
        return parts[0]
    return BlendedDataset(parts, weights)


def _common_tokenizer(sources: list[IndexedDataset], expected: str | None) -> str | None:
    """The tokenizer hash shared by all datasets; DataError naming the odd one out."""
    first = sources[0]
    for source in sources:
        if expected is not None and source.tokenizer_sha256 != expected:
            if source.sidecar is None:
                raise DataError(f"{source.paths.sidecar}: missing, so the dataset's tokenizer "
                                "cannot be checked against the run's; re-run megabeta-data "
                                "tokenize to write it, or do not name a tokenizer to check")
            raise DataError(f"{source.paths.prefix}: tokenized with a model of sha256 "
                            f"{source.tokenizer_sha256} ({_tokenizer_path(source)}), but this run "
                            f"names one of sha256 {expected}; re-tokenize the data with the run's "
                            "tokenizer or point the run at the tokenizer the data was made with")
        if (source.sidecar is None) != (first.sidecar is None):
            missing, other = (source, first) if source.sidecar is None else (first, source)
            raise DataError(f"{missing.paths.sidecar}: missing, while {other.paths.sidecar} "
                            "names its tokenizer, so the blend's tokenizers cannot be compared; "
                            "re-run megabeta-data tokenize on that dataset's corpus to write it")
        if (source.tokenizer_sha256, source.vocab_size) != (first.tokenizer_sha256,
                                                            first.vocab_size):
            raise DataError(f"{source.paths.prefix} and {first.paths.prefix}: made by different "
                            f"tokenizers (sha256 {source.tokenizer_sha256} vs "
                            f"{first.tokenizer_sha256}); a blend needs one tokenizer, re-tokenize "
                            "one of them")
    return first.tokenizer_sha256


def _tokenizer_path(source: IndexedDataset) -> str:
    return str((source.sidecar or {}).get("tokenizer", {}).get("path", "unknown path"))
