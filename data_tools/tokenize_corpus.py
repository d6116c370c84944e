"""``tokenize``: a corpus to one token dataset, with worker processes and optionally MPI ranks.

Single process: read → encode (``--workers`` processes) → write, streaming. Under MPI each rank
takes a contiguous, size-balanced share of the input files, writes it as a part dataset next to
the output (``PREFIX.part-RRRRR-of-WWWWW``), and rank 0 concatenates the parts in rank order, which
is input order. Neither workers nor ranks change a byte of the result: the ``.bin``, ``.idx``,
``.mask`` (``--segments-key``) and sidecar are identical for any ``--workers`` and any number of
ranks.
"""

from __future__ import annotations

import os
import time
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field

from data_tools.corpus import InputFile, ReadOptions, input_files
from data_tools.encode import Encoders, EncoderSetup, read_chunks
from data_tools.mpi import FailedElsewhere, World, mpi_world
from data_tools.progress import ByteProgress
from data_tools.report import DocumentCounts, report_lines
from data_tools.tokenizer import TokenizerInfo, load_tokenizer
from data_tools.writer import IndexedDatasetWriter
from megabeta.data.errors import DataError, refuse_existing
from megabeta.data.format import dataset_paths, token_dtype_for_vocab
from megabeta.data.indexed import IndexedDataset


@dataclass(frozen=True)
class TokenizeConfig:
    """What ``megabeta-data tokenize`` does."""

    tokenizer: str
    """sentencepiece .model or Hugging Face tokenizer.json (data_tools.tokenizer)."""
    inputs: list[str]
    """Input files, directories or globs (data_tools.corpus.input_files)."""
    output_prefix: str
    """Writes OUTPUT_PREFIX.bin, .idx and .json."""
    workers: int | None = None
    """sentencepiece: encoding processes (None: 1, in the reading process). tokenizer.json:
    tokenizers' threads (None: its default, every core)."""
    chunk_bytes: int = 250_000
    """Raw input bytes per unit of work sent to a worker."""
    read: ReadOptions = field(default_factory=ReadOptions)
    """How files become documents."""
    mpi: str = "auto"
    """auto: use MPI when started by mpirun/srun; on: require it; off: never."""
    overwrite: bool = False
    """Replace an existing dataset at OUTPUT_PREFIX."""
    quiet: bool = False
    """No progress bar (the CLI also drops its summary)."""


@dataclass
class TokenizeResult:
    """What a finished run reports (on rank 0 under MPI)."""

    sidecar: dict | None
    """None on ranks other than 0."""
    input_bytes: int
    seconds: float
    rank: int


def tokenize(config: TokenizeConfig) -> TokenizeResult:
    """Tokenize ``config.inputs`` into the dataset at ``config.output_prefix``."""
    started = time.monotonic()
    world = mpi_world(config.mpi)
    try:
        files, tokenizer = _check_run(config)
    except DataError as err:
        # Every rank finds the same problem; rank 0 says it.
        if world.rank != 0:
            raise FailedElsewhere(str(err)) from None
        raise
    if world.size == 1:
        sidecar, _ = _tokenize_files(files, config.output_prefix, config, tokenizer, files,
                                     quiet=config.quiet, part=False)
    else:
        sidecar = _tokenize_with_ranks(world, files, config, tokenizer)
    return TokenizeResult(sidecar, sum(f.size for f in files),
                          time.monotonic() - started, world.rank)


def _check_run(config: TokenizeConfig) -> tuple[list[InputFile], TokenizerInfo]:
    """Everything that can be wrong before reading a byte: flags, inputs, model, existing output."""
    if config.workers is not None and config.workers < 1:
        raise DataError(f"--workers {config.workers}: must be at least 1")
    files = input_files(config.inputs)
    if config.read.segments_key is not None:
        for file in files:
            if file.kind != "jsonl":
                raise DataError(f"{file.path}: --segments-key reads JSONL records, and this is a "
                                ".txt file; convert it to JSONL with the segments, or tokenize "
                                "it without --segments-key")
    tokenizer = load_tokenizer(config.tokenizer).info
    if tokenizer.eos_id < 0:
        raise DataError(f"{config.tokenizer}: the tokenizer has no EOS token, which separates "
                        "documents; for a tokenizer.json name it as eos_token in a "
                        "tokenizer_config.json beside it, or train one with megabeta-data "
                        "train-tokenizer")
    refuse_existing(dataset_paths(config.output_prefix).files, config.overwrite,
                    "another --output-prefix")
    return files, tokenizer


def _sidecar(tokenizer: TokenizerInfo, files: list[InputFile], options: ReadOptions,
             counts: DocumentCounts) -> dict:
    return {
        "tokenizer": tokenizer.as_sidecar(),
        "add_bos": False,
        "append_eos": True,
        "inputs": [{"path": str(f.path), "bytes": f.size} for f in files],
        "arguments": {"text_key": options.text_key, "split": options.split,
                      "on_bad_utf8": options.on_bad_utf8,
                      # Only when given: sidecars of plain-text runs stay as they were.
                      **({"segments_key": options.segments_key}
                         if options.segments_key is not None else {}),
                      **{flag: True for flag in ("keep_empty", "skip_bad")
                         if getattr(options, flag)}},
        "report": counts.as_report(options.on_bad_utf8),
    }


def _tokenize_files(files: list[InputFile], prefix: str, config: TokenizeConfig,
                    tokenizer: TokenizerInfo, corpus: list[InputFile], quiet: bool,
                    part: bool) -> tuple[dict, DocumentCounts]:
    """Write ``files`` as the dataset at ``prefix``; its sidecar lists ``corpus`` as the inputs.

    A ``part`` (one rank's share) may be empty and replaces a stale part of a failed run.
    """
    counts = DocumentCounts()
    dtype = token_dtype_for_vocab(tokenizer.vocab_size)
    setup = EncoderSetup(config.tokenizer, dtype, files, config.read)
    workers = config.workers or 1
    if tokenizer.kind == "huggingface" and config.workers is not None:
        # tokenizers sizes its thread pool (rayon's) from this when it first encodes a batch.
        os.environ["RAYON_NUM_THREADS"] = str(config.workers)
        workers = 1
    # The encoders first: their pool starts before the progress bar's thread (see Encoders).
    with Encoders(setup, workers) as encoders, \
            ByteProgress(sum(f.size for f in files), "tokenize", quiet) as progress, \
            IndexedDatasetWriter(prefix, dtype, overwrite=config.overwrite or part,
                                 loss_mask=config.read.segments_key is not None) as writer:
        chunks = read_chunks(files, config.read, config.chunk_bytes, progress.advance)
        for encoded in encoders.encode(chunks):
            writer.add_documents(encoded.tokens, encoded.lengths, encoded.mask)
            counts.add(encoded.counts)
            progress.advance(0, encoded.counts.documents)
        if not counts.documents and not part:
            raise _no_documents(files, counts, config.read.on_bad_utf8)
        sidecar = writer.commit(_sidecar(tokenizer, corpus, config.read, counts))
    return sidecar, counts


def _no_documents(files: list[InputFile], counts: DocumentCounts, policy: str) -> DataError:
    """No document to write: what was dropped, and why, as the report counts it."""
    names = ", ".join(str(f.path) for f in files)
    dropped = "; ".join(line.split(":", 1)[1].strip().rstrip(":")
                        for line in report_lines(counts.as_report(policy)))
    hint = ("" if counts.bad_files else "; check --text-key (or --segments-key), --split and "
            "--on-bad-utf8")
    return DataError(f"no documents in {names}: nothing was kept ({dropped or 'nothing read'})"
                     f"{hint}")


def contiguous_shares(sizes: list[int], parts: int) -> list[range]:
    """Split files (in order) into ``parts`` contiguous ranges of roughly equal total size.

    Contiguity keeps the merged output in input order; a file goes to the share its midpoint
    falls in. Shares may be empty when there are fewer files than parts.
    """
    total = max(sum(sizes), 1)
    owners, before = [], 0
    for size in sizes:
        owners.append(min(parts - 1, (2 * before + size) * parts // (2 * total)))
        before += size
    return [range(bisect_left(owners, rank), bisect_right(owners, rank)) for rank in range(parts)]


def _tokenize_with_ranks(world: World, files: list[InputFile], config: TokenizeConfig,
                         tokenizer: TokenizerInfo) -> dict | None:
    """Each rank writes its share as a part, rank 0 merges; returns the sidecar on rank 0."""
    share = contiguous_shares([f.size for f in files], world.size)[world.rank]
    parts = [f"{config.output_prefix}.part-{rank:05d}-of-{world.size:05d}"
             for rank in range(world.size)]
    counts, failure = None, None
    try:
        _, counts = _tokenize_files(files[share.start:share.stop], parts[world.rank], config,
                                    tokenizer, files, quiet=config.quiet or world.rank != 0,
                                    part=True)
    except Exception as err:  # noqa: BLE001 -- every failure must reach the other ranks
        failure = _describe(err, world.rank)
    outcomes = world.comm.allgather((counts, failure))
    sidecar = None
    if world.rank == 0:
        try:
            sidecar = _merge_parts(parts, outcomes, config, tokenizer, files)
        except Exception as err:  # noqa: BLE001 -- the other ranks wait for the outcome
            failure = _describe(err, world.rank)
        finally:
            for part in parts:
                for path in dataset_paths(part).files:
                    path.unlink(missing_ok=True)
    failure = world.comm.bcast(failure, root=0)
    if failure is not None:
        raise DataError(failure) if world.rank == 0 else FailedElsewhere(failure)
    return sidecar


def _describe(err: Exception, rank: int) -> str:
    """A DataError already names the file and the fix; anything else also says where it happened."""
    return str(err) if isinstance(err, DataError) else f"rank {rank}: {type(err).__name__}: {err}"


def _merge_parts(parts: list[str], outcomes: list[tuple[DocumentCounts | None, str | None]],
                 config: TokenizeConfig, tokenizer: TokenizerInfo, files: list[InputFile]) -> dict:
    """Concatenate the ranks' parts into the output (rank 0), or raise every rank's error."""
    errors = [failure for _, failure in outcomes if failure is not None]
    if errors:
        raise DataError("\n".join(dict.fromkeys(errors)))
    total = DocumentCounts()
    for counts, _ in outcomes:
        total.add(counts)
    if not total.documents:
        raise _no_documents(files, total, config.read.on_bad_utf8)
    with IndexedDatasetWriter(config.output_prefix, token_dtype_for_vocab(tokenizer.vocab_size),
                              overwrite=config.overwrite,
                              loss_mask=config.read.segments_key is not None) as writer:
        for part in parts:
            writer.add_dataset(IndexedDataset(part))
        return writer.commit(_sidecar(tokenizer, files, config.read, total))
