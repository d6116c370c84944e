"""Loading a sentencepiece model and the facts about it that datasets record."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import sentencepiece as spm

from megabeta.data.errors import DataError
from megabeta.data.format import file_sha256


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

    def as_sidecar(self) -> dict:
        return {"type": "sentencepiece", **asdict(self)}


def load_tokenizer(path: str | Path) -> tuple[spm.SentencePieceProcessor, TokenizerInfo]:
    """The processor and its facts; DataError when the file is missing or not a model."""
    model = Path(path)
    if not model.is_file():
        raise DataError(f"{model}: no such tokenizer model; train one with megabeta-data "
                        "train-tokenizer, or fix --tokenizer")
    try:
        processor = spm.SentencePieceProcessor(model_file=str(model))
    except (RuntimeError, OSError) as err:
        raise DataError(f"{model}: not a sentencepiece model ({err}); pass the .model file "
                        "written by train-tokenizer") from None
    info = TokenizerInfo(str(path), file_sha256(model), processor.vocab_size(), processor.pad_id(),
                         processor.bos_id(), processor.eos_id(), processor.unk_id())
    return processor, info
