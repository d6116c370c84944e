"""A model and its tokenizer for inference (`megabeta eval`, `generate`, `tasks eval`, the
lm-evaluation-harness model): the checkpoint's recorded tokenizer found and checked, the model
loaded, and what can be wrong with either said as a `UsageError` naming the flag or file."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from data_tools.tokenizer import Tokenizer, load_tokenizer
from megabeta.checkpoint.export import ModelSource, load_model, read_source
from megabeta.data import DataError, file_sha256
from megabeta.model import DecoderLM


class UsageError(ValueError):
    """Bad input to `eval`, `generate` or the harness model; the message names the flag or file
    and what to do."""


def short_hash(sha256: str | None) -> str:
    """A sha256 as messages show it."""
    return f"sha256 {sha256[:16]}…" if sha256 else "sha256 unknown"


def resolve_tokenizer(source: ModelSource, given: str, force: bool,
                      need_file: bool) -> tuple[str, str | None]:
    """(path, sha256) of the tokenizer to use with `source`'s model: `given` (--tokenizer) when
    it is the one the model was trained with (or `force`), else the recorded one. `need_file`:
    the file itself is needed (generate), not only its hash (eval); path "" when not needed and
    not found. UsageError saying what to pass otherwise."""
    recorded_path = source.tokenizer.get("path", "")
    recorded_sha = source.tokenizer.get("sha256")
    recorded = f"{recorded_path} ({short_hash(recorded_sha)}, recorded with {source.path})"
    if given:
        if not Path(given).is_file():
            raise UsageError(f"--tokenizer {given}: no such file; pass the tokenizer file "
                             "(.model or tokenizer.json) the training data was tokenized with"
                             + (f", or leave it out to use {recorded}" if recorded_path else ""))
        sha = file_sha256(given)
        if recorded_sha and sha != recorded_sha and not force:
            raise UsageError(f"--tokenizer {given} ({short_hash(sha)}) is not the tokenizer the "
                             f"model was trained with, {recorded}: its token ids would stand for "
                             "other text. Leave out --tokenizer to use the recorded one, or pass "
                             "--force-tokenizer to use this one anyway")
        return given, sha
    if not recorded_path:
        if not need_file:
            return "", None
        raise UsageError(f"{source.path} records no tokenizer (its run named no data.tokenizer "
                         "and its data has no sidecar naming one); pass --tokenizer PATH "
                         "(.model or tokenizer.json), the tokenizer its training data was "
                         "tokenized with")
    if not Path(recorded_path).is_file():
        if not need_file:
            return "", recorded_sha
        raise UsageError(f"the model's tokenizer {recorded} is not found; pass --tokenizer "
                         "PATH (.model or tokenizer.json), a copy of that file"
                         + (f" (its {short_hash(recorded_sha)})" if recorded_sha else ""))
    sha = file_sha256(recorded_path)
    if recorded_sha and sha != recorded_sha and not force:
        raise UsageError(f"{recorded_path} has changed since the model was trained with it "
                         f"({short_hash(sha)} now, {short_hash(recorded_sha)} recorded with "
                         f"{source.path}); pass --tokenizer with the original model, or "
                         "--force-tokenizer to use the file as it is")
    return recorded_path, recorded_sha or sha


def warn_notes(source: ModelSource) -> None:
    """Print what `read_source` could not read (its notes) as warnings."""
    for note in source.notes:
        print(f"warning: {note}", file=sys.stderr)


def load_model_tokenizer(path: str) -> Tokenizer:
    """The tokenizer in `path`, a sentencepiece .model or a Hugging Face tokenizer.json
    (`data_tools.tokenizer.load_tokenizer`); UsageError when it is not one or its extra is
    missing."""
    try:
        return load_tokenizer(path)
    except DataError as err:
        raise UsageError(f"--tokenizer: {err}") from None


def check_vocabulary(tokenizer: Tokenizer, tokenizer_path: str, model) -> None:
    """UsageError when the tokenizer has ids beyond the model's vocabulary."""
    if tokenizer.vocab_size > model.config.vocab_size:
        raise UsageError(f"tokenizer {tokenizer_path} has {tokenizer.vocab_size} pieces, more "
                         f"than the model's vocabulary ({model.config.vocab_size}); pass the "
                         "tokenizer the model was trained with")


def load_checkpoint(checkpoint: str, *, tokenizer: str = "", force_tokenizer: bool = False,
                    device: str | torch.device = "cpu") -> tuple[DecoderLM, Tokenizer]:
    """The model of an export or checkpoint directory on `device` and its tokenizer: the one
    recorded with it, or `tokenizer` when that is the same file (or `force_tokenizer`)."""
    source = read_source(checkpoint)
    warn_notes(source)
    path, _ = resolve_tokenizer(source, tokenizer, force_tokenizer, need_file=True)
    processor = load_model_tokenizer(path)
    model = load_model(checkpoint, device=device)
    check_vocabulary(processor, path, model)
    return model, processor
