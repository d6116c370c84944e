"""``train-tokenizer``: a tokenizer that gives text back exactly, from a bounded sample.

``--kind sentencepiece`` (default) trains a sentencepiece model; ``--kind bpe`` a byte-level BPE
with Hugging Face ``tokenizers`` (``megabeta[hf]``), saved as a ``tokenizer.json``: GPT-2's
byte-level pre-tokenizer (every byte encodes, so no unknown token and no normalization), digits
split one per token as sentencepiece's ``split_digits`` does, special tokens pad 0, bos 1, eos 2.

Settings that make text survive encode → decode, source code included: no normalization
(``identity``: no NFKC folding), no collapsing or trimming of spaces, byte fallback (any character
encodes, as UTF-8 bytes if need be), newline and tab as pieces of their own, whitespace-only pieces
allowed (runs of indentation become single tokens), no dummy prefix space. Special ids are fixed:
pad 0, bos 1, eos 2, unk 3.

The training sample is at most ``--max-sentences`` lines (long lines cut into pieces), drawn by
reservoir sampling with a seeded generator while streaming the inputs: memory stays bounded by the
sample, and the same inputs, seed and ``--num-threads`` give a byte-identical model.
"""

from __future__ import annotations

import json
import random
import io
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import sentencepiece as spm

from data_tools.corpus import (
    InputFile,
    ReadOptions,
    RecordReader,
    decode_document,
    input_files,
)
from data_tools.extras import require_extra
from data_tools.progress import ByteProgress
from data_tools.report import DocumentCounts
from megabeta.data.errors import DataError, refuse_existing
from megabeta.data.format import file_sha256
from megabeta.storage.durable import AtomicFiles

MODEL_TYPES = ("bpe", "unigram")
TOKENIZER_KINDS = ("sentencepiece", "bpe")
BPE_SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
"""The byte-level BPE's special tokens, ids 0, 1, 2: the roles sentencepiece's ids have here."""
SPECIAL_IDS = {"pad_id": 0, "bos_id": 1, "eos_id": 2, "unk_id": 3}
USER_DEFINED_SYMBOLS = ("\n", "\t")
# A training "sentence" is a line cut to at most this many characters: sentencepiece drops
# sentences longer than max_sentence_length bytes (4 bytes per character at most in UTF-8).
_MAX_PIECE_CHARS = 4096
_MAX_SENTENCE_BYTES = 4 * _MAX_PIECE_CHARS
TOKENIZER_SIDECAR_FORMAT = "megabeta.tokenizer"


@dataclass(frozen=True)
class TokenizerTrainingConfig:
    """What ``megabeta-data train-tokenizer`` does."""

    inputs: list[str]
    """Training text: files, directories or globs of any accepted input (data_tools.corpus)."""
    output: str
    """Writes OUTPUT.model, OUTPUT.vocab and OUTPUT.model.json (--kind bpe: OUTPUT.tokenizer.json
    and OUTPUT.tokenizer.meta.json)."""
    vocab_size: int = 32000
    """Pieces in the vocabulary, specials and 256 byte pieces included."""
    model_type: str = "bpe"
    """bpe or unigram (sentencepiece's algorithm)."""
    kind: str = "sentencepiece"
    """sentencepiece (OUTPUT.model) or bpe (byte-level BPE, OUTPUT.tokenizer.json)."""
    max_sentences: int = 1_000_000
    """Lines sampled for training at most (bounds memory)."""
    seed: int = 0
    """Seed of the line sample."""
    character_coverage: float = 0.9995
    """Share of characters covered by pieces; the rare rest falls back to bytes."""
    num_threads: int = 1
    """sentencepiece training threads; the model depends on this number too."""
    read: ReadOptions = field(default_factory=ReadOptions)
    """How files become documents."""
    overwrite: bool = False
    """Replace an existing model at OUTPUT."""
    quiet: bool = False
    """No progress bar or summary."""


@dataclass
class TrainingSample:
    """The lines to train on, how many lines the corpus had, what reading it skipped."""

    sentences: list[str]
    lines_seen: int
    counts: DocumentCounts


def training_pieces(text: str) -> Iterator[str]:
    """Lines of ``text`` with their newline, cut to at most ``_MAX_PIECE_CHARS`` characters."""
    for match in re.finditer(r"[^\n]*\n|[^\n]+$", text):
        line = match.group()
        for start in range(0, len(line), _MAX_PIECE_CHARS):
            yield line[start:start + _MAX_PIECE_CHARS]


def sample_sentences(files: list[InputFile], options: ReadOptions, max_sentences: int, seed: int,
                     progress: ByteProgress) -> TrainingSample:
    """Uniform sample of at most ``max_sentences`` lines of the corpus (reservoir sampling)."""
    rng = random.Random(seed)
    reservoir: list[str] = []
    seen = 0
    counts = DocumentCounts()
    for file in files:
        reader = RecordReader(file, options)
        position = 0
        for raw, line in reader:
            text = decode_document(raw, file, line, options, counts)
            for piece in training_pieces(text or ""):
                if seen < max_sentences:
                    reservoir.append(piece)
                else:
                    slot = rng.randrange(seen + 1)
                    if slot < max_sentences:
                        reservoir[slot] = piece
                seen += 1
            progress.advance(reader.position - position, 1 if text is not None else 0)
            position = reader.position
        if reader.bad_file is not None:
            counts.cut_files.append(reader.bad_file)
    return TrainingSample(reservoir, seen, counts)


def train_tokenizer(config: TokenizerTrainingConfig) -> dict:
    """Train and write the model, its vocabulary and its sidecar; returns the sidecar."""
    _check(config)
    files = input_files(config.inputs)
    output = Path(config.output)
    if config.kind == "bpe":
        return _train_bpe(config, files, output)
    model, vocab, sidecar_path = (Path(f"{output}{suffix}")
                                  for suffix in (".model", ".vocab", ".model.json"))
    refuse_existing([model, vocab, sidecar_path], config.overwrite)
    with AtomicFiles([model, vocab, sidecar_path]) as outputs:
        sample = _sample(config, files)
        outputs.temp(model).write_bytes(_run_sentencepiece(config, sample.sentences))
        processor = spm.SentencePieceProcessor(model_file=str(outputs.temp(model)))
        outputs.temp(vocab).write_text(vocabulary_listing(processor), encoding="utf-8")
        sidecar = _sidecar(config, files, sample, outputs.temp(model), processor)
        outputs.temp(sidecar_path).write_text(json.dumps(sidecar, indent=2) + "\n",
                                              encoding="utf-8")
        outputs.commit()
    return sidecar


def _sample(config: TokenizerTrainingConfig, files: list[InputFile]) -> TrainingSample:
    with ByteProgress(sum(f.size for f in files), "sample", config.quiet) as progress:
        sample = sample_sentences(files, config.read, config.max_sentences, config.seed,
                                  progress)
    if not sample.sentences:
        raise DataError(f"no text to train on in {', '.join(str(f.path) for f in files)}; "
                        "check --text-key, --split and --on-bad-utf8")
    return sample


def _train_bpe(config: TokenizerTrainingConfig, files: list[InputFile], output: Path) -> dict:
    """Train the byte-level BPE; writes OUTPUT.tokenizer.json and its sidecar
    OUTPUT.tokenizer.meta.json, returns the sidecar."""
    tokenizers = require_extra("tokenizers", "hf", "train-tokenizer --kind bpe")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    model, sidecar_path = Path(f"{output}.tokenizer.json"), Path(f"{output}.tokenizer.meta.json")
    refuse_existing([model, sidecar_path], config.overwrite)
    with AtomicFiles([model, sidecar_path]) as outputs:
        sample = _sample(config, files)
        bpe = tokenizers.Tokenizer(models.BPE())
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        bpe.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
        bpe.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=config.vocab_size, show_progress=False,
                                      special_tokens=list(BPE_SPECIAL_TOKENS),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        bpe.train_from_iterator(sample.sentences, trainer)
        bpe.save(str(outputs.temp(model)))
        sidecar = {
            "format": TOKENIZER_SIDECAR_FORMAT,
            "sha256": file_sha256(outputs.temp(model)),
            "kind": "bpe",
            "vocab_size": bpe.get_vocab_size(with_added_tokens=True),
            **{f"{role}_id": i for i, role in enumerate(("pad", "bos", "eos"))},
            "unk_id": -1,
            "special_tokens": dict(zip(("pad", "bos", "eos"), BPE_SPECIAL_TOKENS)),
            "pre_tokenizer": "digits one by one, then GPT-2 byte-level",
            **_sample_record(config, files, sample),
            "tokenizers_version": tokenizers.__version__,
        }
        outputs.temp(sidecar_path).write_text(json.dumps(sidecar, indent=2) + "\n",
                                              encoding="utf-8")
        outputs.commit()
    return sidecar


def _sample_record(config: TokenizerTrainingConfig, files: list[InputFile],
                   sample: TrainingSample) -> dict:
    """The sidecar's account of the sample, the same for both kinds."""
    return {
        "seed": config.seed,
        "max_sentences": config.max_sentences,
        "sentences_sampled": len(sample.sentences),
        "lines_seen": sample.lines_seen,
        "inputs": [{"path": str(f.path), "bytes": f.size} for f in files],
        "arguments": {"text_key": config.read.text_key, "split": config.read.split,
                      "on_bad_utf8": config.read.on_bad_utf8},
        "report": sample.counts.as_report(config.read.on_bad_utf8),
    }


def _check(config: TokenizerTrainingConfig) -> None:
    if config.kind not in TOKENIZER_KINDS:
        raise DataError(f"--kind {config.kind}: choose one of {', '.join(TOKENIZER_KINDS)}")
    if config.kind == "bpe":
        fixed = len(BPE_SPECIAL_TOKENS) + 256
        if config.vocab_size <= fixed:
            raise DataError(f"--vocab-size {config.vocab_size}: the {len(BPE_SPECIAL_TOKENS)} "
                            f"special tokens and 256 bytes take {fixed}; raise --vocab-size "
                            f"above {fixed}")
    if config.model_type not in MODEL_TYPES:
        raise DataError(f"--model-type {config.model_type}: choose one of {', '.join(MODEL_TYPES)}")
    if config.max_sentences < 1:
        raise DataError(f"--max-sentences {config.max_sentences}: must be at least 1")
    if not 0 < config.character_coverage <= 1:
        raise DataError(f"--character-coverage {config.character_coverage}: must be in (0, 1]")
    if config.num_threads < 1:
        raise DataError(f"--num-threads {config.num_threads}: must be at least 1")
    fixed = len(SPECIAL_IDS) + len(USER_DEFINED_SYMBOLS) + 256
    if config.kind == "sentencepiece" and config.vocab_size <= fixed:
        raise DataError(f"--vocab-size {config.vocab_size}: the {len(SPECIAL_IDS)} special, "
                        f"{len(USER_DEFINED_SYMBOLS)} whitespace and 256 byte pieces take {fixed}; "
                        f"raise --vocab-size above {fixed}")


def vocabulary_listing(processor: spm.SentencePieceProcessor) -> str:
    """The ``.vocab`` text: ``piece<TAB>score`` per line, in id order.

    As sentencepiece lists it, except that a backslash and unprintable characters in a piece are
    escaped as in a Python literal: the newline and tab pieces would break the line format.
    """
    lines = []
    for piece_id in range(processor.vocab_size()):
        piece = "".join(char if char.isprintable() and char != "\\"
                        else char.encode("unicode_escape").decode("ascii")
                        for char in processor.id_to_piece(piece_id))
        lines.append(f"{piece}\t{processor.get_score(piece_id):g}\n")
    return "".join(lines)


def _run_sentencepiece(config: TokenizerTrainingConfig, sentences: list[str]) -> bytes:
    """The trained model's bytes."""
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=model,
            model_type=config.model_type,
            vocab_size=config.vocab_size,
            character_coverage=config.character_coverage,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_by_whitespace=True,
            split_digits=True,
            user_defined_symbols=list(USER_DEFINED_SYMBOLS),
            max_sentence_length=_MAX_SENTENCE_BYTES,
            # The sample is already drawn; sentencepiece must take it whole and in order.
            input_sentence_size=0,
            shuffle_input_sentence=False,
            num_threads=config.num_threads,
            minloglevel=2,  # errors only; they come back as exceptions
            **SPECIAL_IDS,
        )
    except RuntimeError as err:
        message = str(err).splitlines()[-1] if str(err) else repr(err)
        hint = ("lower --vocab-size, or give more text (more --inputs, a larger --max-sentences)"
                if "too high" in message else "check --vocab-size, --model-type and the inputs")
        raise DataError(f"sentencepiece could not train --vocab-size {config.vocab_size} "
                        f"--model-type {config.model_type}: {message}; {hint}") from None
    return model.getvalue()


def _sidecar(config: TokenizerTrainingConfig, files: list[InputFile], sample: TrainingSample,
             model: Path, processor: spm.SentencePieceProcessor) -> dict:
    return {
        "format": TOKENIZER_SIDECAR_FORMAT,
        "sha256": file_sha256(model),
        "model_type": config.model_type,
        "vocab_size": processor.vocab_size(),
        **{key: getattr(processor, key)() for key in SPECIAL_IDS},
        "user_defined_symbols": list(USER_DEFINED_SYMBOLS),
        "byte_fallback": True,
        "normalization_rule_name": "identity",
        "character_coverage": config.character_coverage,
        **_sample_record(config, files, sample),
        "num_threads": config.num_threads,
        "sentencepiece_version": spm.__version__,
    }
