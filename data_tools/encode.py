"""Encoding chunks of documents to token ids, in this process or in a pool of worker processes.

The reading process cuts the input into chunks of raw records (about ``chunk_bytes`` each, never
spanning two files); workers (the reading process among them) decode, tokenize and append EOS;
results come back in input order.
Because each chunk's result depends only on its records, the output is the same for any number of
workers. At most a few chunks per worker are in flight, which bounds memory: ``Pool.imap`` would read
ahead without limit, so chunks are submitted with ``apply_async`` through a bounded queue and
collected oldest first (the same ordering ``imap`` gives).
"""

from __future__ import annotations

import multiprocessing
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import sentencepiece as spm

from data_tools.corpus import DocumentCounts, InputFile, ReadOptions, RecordReader, decode_document

_IN_FLIGHT_PER_WORKER = 2


@dataclass
class Chunk:
    """Consecutive raw records of one input file and the line where each starts."""

    file_index: int
    records: list[bytes]
    lines: Sequence[int]


@dataclass
class EncodedChunk:
    """Token ids of a chunk's documents (EOS after each), their lengths, and what was skipped."""

    tokens: np.ndarray
    lengths: np.ndarray
    counts: DocumentCounts


def read_chunks(files: list[InputFile], split: str, chunk_bytes: int,
                on_progress: Callable[[int], None]) -> Iterator[Chunk]:
    """Chunks of every file in order; ``on_progress`` gets the on-disk bytes read meanwhile."""
    for file_index, file in enumerate(files):
        reader = RecordReader(file, split)
        reported = 0
        for records, lines in reader.chunks(chunk_bytes):
            yield Chunk(file_index, records, lines)
            on_progress(reader.position - reported)
            reported = reader.position
        on_progress(file.size - reported)


@dataclass(frozen=True)
class EncoderSetup:
    """Everything a worker needs; sent once per worker process."""

    tokenizer_path: str
    eos_id: int
    dtype: np.dtype
    files: list[InputFile]
    options: ReadOptions


class _Encoder:
    def __init__(self, setup: EncoderSetup) -> None:
        self.processor = spm.SentencePieceProcessor(model_file=setup.tokenizer_path)
        self.setup = setup

    def encode(self, chunk: Chunk) -> EncodedChunk:
        file = self.setup.files[chunk.file_index]
        counts = DocumentCounts()
        # One small array per document: a chunk-long list of Python ints would cost ~36 bytes a
        # token where the array costs 2 or 4.
        documents: list[np.ndarray] = []
        for raw, line in zip(chunk.records, chunk.lines):
            text = decode_document(raw, file, line, self.setup.options, counts)
            if text is None:
                continue
            ids = self.processor.encode(text)
            ids.append(self.setup.eos_id)
            documents.append(np.array(ids, dtype=self.setup.dtype))
        tokens = np.concatenate(documents) if documents else np.empty(0, dtype=self.setup.dtype)
        return EncodedChunk(tokens, np.array([len(d) for d in documents], dtype=np.int64), counts)


_worker_encoder: _Encoder | None = None


def _start_worker(setup: EncoderSetup) -> None:
    global _worker_encoder
    _worker_encoder = _Encoder(setup)


def _encode_in_worker(chunk: Chunk) -> EncodedChunk:
    return _worker_encoder.encode(chunk)


def encode_chunks(chunks: Iterator[Chunk], setup: EncoderSetup,
                  workers: int) -> Iterator[EncodedChunk]:
    """Encoded chunks in input order, by ``workers`` processes: this one and ``workers - 1``
    pool processes.

    The reading process is one of the encoders: whenever the pool has its share of chunks in
    flight, it encodes the next chunk itself instead of waiting. It also reads and writes, so it
    takes fewer chunks than a pool worker, and on N cores N processes run, not N + 1.
    """
    encoder = _Encoder(setup)
    if workers <= 1:
        for chunk in chunks:
            yield encoder.encode(chunk)
        return
    # spawn, not fork: the parent may hold threads (torch, tqdm's monitor, MPI) that fork copies
    # in an undefined state.
    context = multiprocessing.get_context("spawn")
    in_flight = _IN_FLIGHT_PER_WORKER * (workers - 1)
    with context.Pool(workers - 1, initializer=_start_worker, initargs=(setup,)) as pool:
        # Oldest first: pool tasks (AsyncResult) and chunks encoded here (EncodedChunk).
        pending: deque = deque()
        submitted = 0
        for chunk in chunks:
            if submitted < in_flight:
                pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
                submitted += 1
            else:
                pending.append(encoder.encode(chunk))
            # Hand out what is done, in order; wait only when too much is buffered.
            while pending and (_done(pending[0]) or len(pending) > 2 * in_flight):
                result = pending.popleft()
                if not isinstance(result, EncodedChunk):
                    submitted -= 1
                    result = result.get()
                yield result
        for result in pending:
            yield result if isinstance(result, EncodedChunk) else result.get()


def _done(result: object) -> bool:
    return isinstance(result, EncodedChunk) or result.ready()
