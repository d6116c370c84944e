"""The tokenizer: one interface over a sentencepiece ``.model`` and a Hugging Face
``tokenizer.json``.

The kind is chosen once, from the file name (``*.json``: Hugging Face ``tokenizers``, in the
optional extra ``megabeta[hf]``; anything else: sentencepiece), by :func:`load_tokenizer`, which
every user of a tokenizer calls: ``megabeta-data tokenize`` and ``inspect``, the trainer's
tokenizer check, ``megabeta eval``/``generate``, ``megabeta tasks`` and the ablations. They see
only :class:`Tokenizer`: ids come back as int32 arrays, documents get the EOS appended (never a
BOS), and the special ids are -1 where the tokenizer has none.

A ``tokenizer.json`` does not say which of its special tokens is the end of a document; that comes
from ``tokenizer_config.json`` next to it when there is one (as Hugging Face model repositories
ship it: ``eos_token``, ``bos_token``, ``pad_token``), else from the usual names
(:data:`_SPECIAL_NAMES`) among its special tokens.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import sentencepiece as spm

from data_tools.extras import require_extra
from megabeta.data.errors import DataError
from megabeta.data.format import file_sha256

# Special tokens by role, most common spelling first: sentencepiece/Llama 2, GPT-2, Llama 3, Gemma.
_SPECIAL_NAMES = {
    "bos": ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"),
    "eos": ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>"),
    "pad": ("<pad>", "<|pad|>", "[PAD]"),
}


@dataclass(frozen=True)
class TokenizerInfo:
    """What a dataset sidecar records about the tokenizer that made it."""

    path: str
    sha256: str
    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int
    unk_id: int
    kind: str = "sentencepiece"
    special_tokens: dict[str, str | None] = field(default_factory=dict)
    """The text of the bos, eos and pad tokens (None where there is none)."""

    def as_sidecar(self) -> dict:
        # "type" is the kind: sidecars of sentencepiece datasets have always said it there.
        fields = asdict(self)
        return {"type": fields.pop("kind"), **fields}


class Tokenizer:
    """A loaded tokenizer: encode, decode, and its facts (:attr:`info`)."""

    info: TokenizerInfo
    threaded = False
    """True when encoding a batch already runs on several threads (no process pool needed)."""

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def eos_id(self) -> int:
        return self.info.eos_id

    @property
    def pad_id(self) -> int:
        return self.info.pad_id

    def encode(self, text: str) -> np.ndarray:
        """int32 ids of ``text``, no special tokens added."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """int32 ids of each text, no special tokens added."""
        raise NotImplementedError

    def encode_documents(self, texts: Sequence[str]) -> list[np.ndarray]:
        """int32 ids of each document with the EOS appended (what a dataset stores)."""
        eos = np.array([self.eos_id], dtype=np.int32)
        return [np.concatenate([ids, eos]) for ids in self.encode_batch(texts)]

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece ``.model``; encodes in the calling thread (``tokenize`` runs processes)."""

    def __init__(self, path: Path) -> None:
        try:
            self.processor = spm.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as err:
            raise DataError(f"{path}: not a sentencepiece model ({err}); pass the .model file "
                            "written by train-tokenizer, or a Hugging Face "
                            "tokenizer.json") from None
        p = self.processor
        pieces = {role: p.id_to_piece(getattr(p, f"{role}_id")())
                  if getattr(p, f"{role}_id")() >= 0 else None for role in _SPECIAL_NAMES}
        self.info = TokenizerInfo(str(path), file_sha256(path), p.vocab_size(), p.pad_id(),
                                  p.bos_id(), p.eos_id(), p.unk_id(), "sentencepiece", pieces)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.processor.encode(text, return_type="numpy") for text in texts]

    def encode_documents(self, texts: Sequence[str]) -> list[np.ndarray]:
        # sentencepiece appends EOS and returns an int32 buffer itself: no list of Python ints
        # per document (~36 bytes a token, and a tenth of the encoding time to build and convert).
        return [self.processor.encode(text, add_eos=True, return_type="numpy") for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return self.processor.decode(list(ids))


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` (``tokenizers``), which encodes a batch on its own
    threads (``RAYON_NUM_THREADS``, default every core)."""

    threaded = True

    def __init__(self, path: Path) -> None:
        tokenizers = require_extra("tokenizers", "hf", f"--tokenizer {path} (a Hugging Face "
                                                 "tokenizer.json)")
        try:
            self.tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as err:  # noqa: BLE001 -- tokenizers raises its own Exception type
            raise DataError(f"{path}: not a Hugging Face tokenizer.json ({err}); pass a "
                            "tokenizer.json saved by tokenizers/transformers or written by "
                            "train-tokenizer --kind bpe, or a sentencepiece .model") from None
        specials = _special_tokens(path, self.tokenizer)
        ids = {role: (self.tokenizer.token_to_id(token) if token is not None else None)
               for role, token in specials.items()}
        ids = {role: -1 if i is None else i for role, i in ids.items()}
        unk = _unk_token(self.tokenizer)
        unk_id = self.tokenizer.token_to_id(unk) if unk else None
        self.info = TokenizerInfo(str(path), file_sha256(path),
                                  self.tokenizer.get_vocab_size(with_added_tokens=True),
                                  ids["pad"], ids["bos"], ids["eos"],
                                  -1 if unk_id is None else unk_id, "huggingface", specials)
        # encode_batch_fast (tokenizers >= 0.21) skips the character offsets nobody here reads.
        self._encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.array(e.ids, dtype=np.int32) for e in self._ids(texts)]

    def encode_documents(self, texts: Sequence[str]) -> list[np.ndarray]:
        eos = self.eos_id
        # One conversion per batch: a list per document costs as much again as the arrays.
        return [np.array(e.ids + [eos], dtype=np.int32) for e in self._ids(texts)]

    def _ids(self, texts: Sequence[str]) -> list:
        # No post-processor specials (a BOS, for one): documents get the EOS only, as with
        # sentencepiece, and the sidecar says add_bos false.
        return self._encode(list(texts), add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


def tokenizer_kind(path: str | os.PathLike) -> str:
    """The kind of tokenizer in ``path``, from its name: a ``.json`` is Hugging Face's."""
    return "huggingface" if str(path).endswith(".json") else "sentencepiece"


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer in ``path``; DataError when the file is missing or not a tokenizer."""
    model = Path(path)
    if not model.is_file():
        raise DataError(f"{model}: no such tokenizer file; pass a sentencepiece .model or a "
                        "Hugging Face tokenizer.json (megabeta-data train-tokenizer writes "
                        "either), or fix --tokenizer")
    if tokenizer_kind(model) == "huggingface":
        return HuggingFaceTokenizer(model)
    return SentencePieceTokenizer(model)


def _special_tokens(path: Path, tokenizer) -> dict[str, str | None]:
    """bos, eos and pad token text: ``tokenizer_config.json`` beside ``path`` first, then the
    usual names among the special tokens."""
    config_path = path.parent / "tokenizer_config.json"
    config: dict = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise DataError(f"{config_path}: not readable JSON ({err}); it names the special "
                            f"tokens of {path}: fix or remove it") from None
    specials = {token.content for token in tokenizer.get_added_tokens_decoder().values()
                if token.special}
    found: dict[str, str | None] = {}
    for role, names in _SPECIAL_NAMES.items():
        given = config.get(f"{role}_token")
        if isinstance(given, dict):  # transformers' AddedToken, serialised
            given = given.get("content")
        if isinstance(given, str) and tokenizer.token_to_id(given) is not None:
            found[role] = given
        else:
            found[role] = next((name for name in names if name in specials), None)
    return found


def _unk_token(tokenizer) -> str | None:
    model = json.loads(tokenizer.to_str()).get("model", {})
    return model.get("unk_token")
