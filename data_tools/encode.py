"""Encoding chunks of documents to token ids, in this process or in a pool of worker processes.

The reading process cuts the input into chunks of raw records (about ``chunk_bytes`` each, never
spanning two files); workers (the reading process among them) decode, tokenize and append EOS (and,
for segmented documents, build the loss mask: :func:`encode_segments`); results come back in input
order.
A tokenizer with threads of its own (a ``tokenizer.json``) gets no pool: a thread decodes chunks
ahead while it encodes them in batches (:meth:`Encoders._encode_threaded`).
Because each chunk's result depends only on its records, the output is the same for any number of
workers. At most a few chunks per process are held, which bounds memory: ``Pool.imap`` would read
ahead without limit, so chunks are submitted with ``apply_async`` and collected oldest first (the
same ordering ``imap`` gives).
"""

from __future__ import annotations

import multiprocessing
import queue
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.pool import Pool

import numpy as np

from data_tools.corpus import (
    InputFile,
    ReadOptions,
    RecordReader,
    Segment,
    decode_document,
    decode_segments,
)
from data_tools.report import CutFile, DocumentCounts
from data_tools.tokenizer import Tokenizer, load_tokenizer

_QUEUED_PER_WORKER = 2
"""Chunks handed to each pool worker and not yet finished: one running, one waiting."""
_DECODED_AHEAD = 4
"""Decoded chunks waiting for a threaded tokenizer (bounds memory like the pool's queues)."""
_BUFFERED_PER_WORKER = 8
"""Finished chunks held for in-order output, per encoding process, before the reader waits."""


@dataclass
class Chunk:
    """Consecutive raw records of one input file and the line where each starts."""

    file_index: int
    records: list
    lines: Sequence[int]
    bad_file: CutFile | None = None
    """--skip-bad: the file turned out unreadable after the records of its chunks before (a last
    chunk of its own, with no records)."""


@dataclass
class EncodedChunk:
    """Token ids of a chunk's documents (EOS after each), their lengths, and what was skipped;
    with segmented input, the loss mask of the tokens (uint8, 1 = scored target)."""

    tokens: np.ndarray
    lengths: np.ndarray
    counts: DocumentCounts
    mask: np.ndarray | None = None


def read_chunks(files: list[InputFile], options: ReadOptions, chunk_bytes: int,
                on_progress: Callable[[int], None]) -> Iterator[Chunk]:
    """Chunks of every file in order; ``on_progress`` gets the on-disk bytes read meanwhile."""
    for file_index, file in enumerate(files):
        reader = RecordReader(file, options)
        reported = 0
        for records, lines in reader.chunks(chunk_bytes):
            yield Chunk(file_index, records, lines)
            on_progress(reader.position - reported)
            reported = reader.position
        if reader.bad_file is not None:  # counted by whoever decodes it, in input order
            yield Chunk(file_index, [], [], reader.bad_file)
        on_progress(file.size - reported)


@dataclass(frozen=True)
class EncoderSetup:
    """Everything a worker needs; sent once per worker process."""

    tokenizer_path: str
    dtype: np.dtype
    files: list[InputFile]
    options: ReadOptions


@dataclass
class DecodedChunk:
    """A chunk's documents as text (or segments); an empty one (``--keep-empty``) is "" or []."""

    documents: list
    counts: DocumentCounts


class _Encoder:
    def __init__(self, setup: EncoderSetup) -> None:
        self.tokenizer = load_tokenizer(setup.tokenizer_path)
        self.setup = setup

    def encode(self, chunk: Chunk) -> EncodedChunk:
        return self.encode_decoded(self.decode(chunk))

    def decode(self, chunk: Chunk) -> DecodedChunk:
        """Records to documents (UTF-8, JSON, the policies); the part that needs no tokenizer."""
        file = self.setup.files[chunk.file_index]
        counts = DocumentCounts()
        if chunk.bad_file is not None:
            counts.cut_files.append(chunk.bad_file)
        decode = decode_segments if self.setup.options.segments_key is not None \
            else decode_document
        documents = []
        for raw, line in zip(chunk.records, chunk.lines):
            document = decode(raw, file, line, self.setup.options, counts)
            if document is not None:
                documents.append(document)
        return DecodedChunk(documents, counts)

    def encode_decoded(self, decoded: DecodedChunk) -> EncodedChunk:
        if self.setup.options.segments_key is not None:
            return self._encode_segmented(decoded)
        texts = [text for text in decoded.documents if text]
        encoded = iter(self.tokenizer.encode_documents(texts))
        # An empty document kept (--keep-empty) has no tokens, not even the EOS, as in Megatron.
        documents = [next(encoded) if text else _NO_TOKENS for text in decoded.documents]
        return EncodedChunk(self._concatenate(documents), _lengths(documents), decoded.counts)

    def _encode_segmented(self, decoded: DecodedChunk) -> EncodedChunk:
        documents: list[np.ndarray] = []
        masks: list[np.ndarray] = []
        for segments in decoded.documents:
            tokens, mask = (encode_segments(self.tokenizer, segments) if segments
                            else (_NO_TOKENS, np.empty(0, dtype=np.uint8)))
            documents.append(tokens)
            masks.append(mask)
        mask = np.concatenate(masks) if masks else np.empty(0, dtype=np.uint8)
        return EncodedChunk(self._concatenate(documents), _lengths(documents), decoded.counts,
                            mask)

    def _concatenate(self, documents: list[np.ndarray]) -> np.ndarray:
        if not documents:
            return np.empty(0, dtype=self.setup.dtype)
        # The dataset's dtype holds every id of the vocabulary (token_dtype_for_vocab).
        return np.concatenate(documents).astype(self.setup.dtype)


_NO_TOKENS = np.empty(0, dtype=np.int32)


def _lengths(documents: list[np.ndarray]) -> np.ndarray:
    return np.array([len(d) for d in documents], dtype=np.int64)


_worker_encoder: _Encoder | None = None


def _start_worker(setup: EncoderSetup) -> None:
    global _worker_encoder
    _worker_encoder = _Encoder(setup)


def _encode_in_worker(chunk: Chunk) -> EncodedChunk:
    return _worker_encoder.encode(chunk)


class Encoders:
    """``workers`` encoding processes: this one and a pool of ``workers - 1``; a context manager.
    A tokenizer with threads of its own (:attr:`Tokenizer.threaded`) gets no pool.

    Enter it before starting threads (the progress bar's monitor): a single-threaded process
    outside MPI forks its pool workers, which start in milliseconds; otherwise they are spawned
    (fork would copy other threads' locks in whatever state they are, and MPI libraries forbid
    it), each paying a fresh interpreter (~0.4 s of a core, 3 % of a 2-worker run on 48 MB).
    """

    def __init__(self, setup: EncoderSetup, workers: int) -> None:
        self.encoder = _Encoder(setup)
        self.setup, self.workers = setup, workers
        self.pool: Pool | None = None

    def __enter__(self) -> Encoders:
        if self.workers > 1 and not self.encoder.tokenizer.threaded:
            self.pool = _start_method().Pool(self.workers - 1, initializer=_start_worker,
                                             initargs=(self.setup,))
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()

    def encode(self, chunks: Iterator[Chunk]) -> Iterator[EncodedChunk]:
        """Encoded chunks in input order.

        The reading process is one of the encoders: it keeps every pool worker busy (a chunk
        running and one queued) and encodes the next chunk itself whenever they are. Neither side
        waits for the other except at the end, or when finished chunks pile up behind a slow one
        beyond a memory bound.
        """
        if self.encoder.tokenizer.threaded:
            yield from self._encode_threaded(chunks)
            return
        if self.pool is None:
            for chunk in chunks:
                yield self.encoder.encode(chunk)
            return
        queued = _QUEUED_PER_WORKER * (self.workers - 1)
        buffered = _BUFFERED_PER_WORKER * self.workers
        # Oldest first: pool tasks (AsyncResult) and chunks encoded here (EncodedChunk).
        pending: deque = deque()
        for chunk in chunks:
            # Counted by readiness, not by what has been handed out: a worker that finished
            # behind a slower chunk gets new work at once.
            if sum(not _done(result) for result in pending) < queued:
                pending.append(self.pool.apply_async(_encode_in_worker, (chunk,)))
            else:
                pending.append(self.encoder.encode(chunk))
            while pending and (_done(pending[0]) or len(pending) > buffered):
                yield _result(pending.popleft())
        for result in pending:
            yield _result(result)


    def _encode_threaded(self, chunks: Iterator[Chunk]) -> Iterator[EncodedChunk]:
        """Encoded chunks in input order, for a tokenizer that runs its own threads.

        A process pool would only fight those threads for the cores. What is left to overlap
        is the Python side, reading and decoding records, which runs in a thread of its own,
        a bounded queue ahead of the encoder (the tokenizer releases the GIL while it encodes).
        """
        decoded: queue.Queue = queue.Queue(maxsize=_DECODED_AHEAD)
        stop = threading.Event()

        def decode_all() -> None:
            try:
                for chunk in chunks:
                    if not _put(decoded, self.encoder.decode(chunk), stop):
                        return
            except BaseException as err:  # noqa: BLE001 -- re-raised in the encoding thread
                _put(decoded, err, stop)
                return
            _put(decoded, None, stop)

        reader = threading.Thread(target=decode_all, name="decode", daemon=True)
        reader.start()
        try:
            while (item := decoded.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield self.encoder.encode_decoded(item)
        finally:
            stop.set()
            reader.join()


def _put(decoded: queue.Queue, item: object, stop: threading.Event) -> bool:
    """Queue ``item``; False when the consumer has gone (``stop``) instead."""
    while not stop.is_set():
        try:
            decoded.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _start_method() -> multiprocessing.context.BaseContext:
    mpi = sys.modules.get("mpi4py.MPI")
    forkable = (threading.active_count() == 1 and "fork" in multiprocessing.get_all_start_methods()
                and not (mpi is not None and mpi.Is_initialized()))
    return multiprocessing.get_context("fork" if forkable else "spawn")


def _result(result: object) -> EncodedChunk:
    return result if isinstance(result, EncodedChunk) else result.get()


def _done(result: object) -> bool:
    return isinstance(result, EncodedChunk) or result.ready()


def encode_segments(tokenizer: Tokenizer, segments: Sequence[Segment]
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of a segmented document (EOS appended) and its loss mask (1 = scored target).

    Each segment is encoded on its own, so a token never straddles a scored and an unscored
    span and the mask is exact; the EOS is not scored. The same function serves tokenizing and
    the task evaluator, so both see the same token boundaries."""
    pieces = tokenizer.encode_batch([text for text, _ in segments])
    masks = [np.full(len(p), int(scored), dtype=np.uint8)
             for p, (_, scored) in zip(pieces, segments)]
    tokens = np.concatenate([*pieces, np.array([tokenizer.eos_id], dtype=np.int32)])
    mask = np.concatenate([*masks, np.zeros(1, dtype=np.uint8)])
    return tokens.astype(np.int32), mask
