"""The tokenizer files of a Hugging Face folder: what `AutoTokenizer.from_pretrained(DIR)` loads,
giving the ids megabeta's tokenizer gives.

A Hugging Face `tokenizer.json` travels as itself. A sentencepiece model travels as itself
(`tokenizer.model`, which megabeta reads back) and as a `tokenizer.json` converted from it with
Hugging Face `tokenizers` (`megabeta[hf]`): its pieces, scores and ids, the BPE merges (every
split of a piece into two pieces, ranked by the piece's score, which is the order sentencepiece
merges in) or the unigram scores, byte fallback, its normalizer (the precompiled character map,
the dummy prefix, whitespace as "▁"), its control and unknown pieces as special tokens and its
user-defined symbols (newline, tab) as tokens matched before the model, as sentencepiece matches
them. No pre-tokenizer: sentencepiece encodes the whole text at once. The conversion is checked
before it is written: sample texts (and every piece of the vocabulary) encode to the same ids
and decode to the same text with both, else the export fails naming the first difference.

Special tokens, as megabeta uses them: no BOS is ever added (`add_bos_token` false, no
post-processor: `tokenizer(text).input_ids` are megabeta's ids); the EOS is the end of a document
(megabeta's data appends it to every document) and, as in GPT-2, also the BOS: the token a
document starts after, which lm-evaluation-harness's `hf` model puts before a text it scores
from the start (`prefix_token_id`), as megabeta's own harness model does. A sentencepiece model
never matches its control pieces in text (`</s>` typed as text is four characters): the folder
says `split_special_tokens` so transformers does not either.
"""

from __future__ import annotations

import json
from pathlib import Path

from data_tools.tokenizer import SentencePieceTokenizer, Tokenizer
from megabeta.checkpoint.manager import CheckpointError
from megabeta.extras import require

SENTENCEPIECE_FILE = "tokenizer.model"
TOKENIZER_JSON = "tokenizer.json"

# sentencepiece's ModelProto enums (sentencepiece_model.proto).
_UNIGRAM, _BPE = 1, 2
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_UNREACHABLE = -1e4
"""A unigram score far below any piece's (log-probabilities, above -100 in practice)."""

SAMPLE_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces, and   three inside, trailing  ",
    "tabs\tand\nnewlines\n\n\tindented\n    four spaces",
    "digits 0123456789 and 3.14159, 1e-5, 2026-12-06",
    "def f(x):\n    return x ** 2  # comment\n",
    "Ünïcödé: café, naïve, Straße; 日本語のテキスト; Ελληνικά; русский",
    "emoji 🙂🚀 and symbols ∑∫√ ← → ™ ©",
    "",
    " ",
    "\n",
)
"""Texts every converted tokenizer is checked on, besides its own vocabulary."""

LITERAL_PIECES = "literal pieces <s> </s> <pad> <unk> <0x41> typed as text"
"""Checked on BPE models only: tokenizers' unigram lattice holds every piece of the vocabulary,
so where sentencepiece spells a control or byte piece typed as text out character by
character, the converted unigram tokenizer may take the piece (an accepted difference, on text
that spells out a tokenizer's own special pieces)."""


class TokenizerConversionError(CheckpointError):
    """A sentencepiece model that cannot be converted exactly; the message says why."""


def _model_proto(path: Path):
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(path.read_bytes())
    return proto


def _merges(proto) -> list[tuple[str, str]]:
    """Every split of a normal piece into two pieces of the vocabulary, the highest-scoring
    piece's first: sentencepiece's BPE merges the adjacent pair whose union scores highest."""
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    ranked = sorted((p for p in proto.pieces if p.type == _NORMAL),
                    key=lambda p: -p.score)
    merges = []
    for piece in ranked:
        text = piece.piece
        splits = [(text[:i], text[i:]) for i in range(1, len(text))
                  if text[:i] in vocab and text[i:] in vocab]
        merges += sorted(splits, key=lambda s: (vocab[s[0]], vocab[s[1]]))
    return merges


def convert_sentencepiece(path: str | Path):
    """The Hugging Face `tokenizers.Tokenizer` equivalent to the sentencepiece model at `path`;
    TokenizerConversionError for a model it cannot reproduce, MissingExtra without
    `tokenizers`."""
    tokenizers = require("tokenizers", "hf", f"converting the sentencepiece model {path} to "
                         "a tokenizer.json (megabeta export --format hf)")
    from tokenizers import AddedToken, Regex, decoders, models, normalizers

    path = Path(path)
    proto = _model_proto(path)
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    if spec.treat_whitespace_as_suffix:
        raise TokenizerConversionError(f"{path}: treat_whitespace_as_suffix has no tokenizers "
                                       "equivalent")
    unk = spec.unk_id if 0 <= spec.unk_id < len(proto.pieces) else None
    if spec.model_type == _BPE:
        vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
        model = models.BPE(vocab=vocab, merges=_merges(proto), byte_fallback=spec.byte_fallback,
                           unk_token=None if unk is None else proto.pieces[unk].piece,
                           fuse_unk=True)
    elif spec.model_type == _UNIGRAM:
        # sentencepiece's lattice holds normal and user-defined pieces only; tokenizers' holds
        # every piece, so the others (control, byte, unused) get a score no path takes.
        model = models.Unigram([(p.piece, p.score if p.type in (_NORMAL, _USER_DEFINED)
                                 else _UNREACHABLE) for p in proto.pieces],
                               unk_id=unk, byte_fallback=spec.byte_fallback)
    else:
        raise TokenizerConversionError(f"{path}: sentencepiece model type {spec.model_type} "
                                       "(word or char) is not converted; only bpe and unigram")
    tokenizer = tokenizers.Tokenizer(model)
    steps = []
    if norm.precompiled_charsmap:
        steps.append(normalizers.Precompiled(norm.precompiled_charsmap))
    if norm.remove_extra_whitespaces:
        steps += [normalizers.Strip(left=True, right=True),
                  normalizers.Replace(Regex(" {2,}"), " ")]
    if norm.add_dummy_prefix:
        steps.append(normalizers.Prepend(" "))
    if norm.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "▁"))
    if steps:
        tokenizer.normalizer = normalizers.Sequence(steps)
    unescape = [decoders.Replace("▁", " ")] if norm.escape_whitespaces else []
    prefix = [decoders.Strip(" ", 1, 0)] if norm.add_dummy_prefix else []
    tokenizer.decoder = decoders.Sequence([*unescape, decoders.ByteFallback(), decoders.Fuse(),
                                           *prefix])
    tokenizer.add_special_tokens([AddedToken(p.piece, special=True, normalized=False)
                                  for p in proto.pieces if p.type in (_CONTROL, _UNKNOWN)])
    tokenizer.add_tokens([AddedToken(p.piece, special=False, normalized=False)
                          for p in proto.pieces if p.type == _USER_DEFINED])
    _check_conversion(path, tokenizer, proto)
    return tokenizer


def _check_conversion(path: Path, converted, proto) -> None:
    """TokenizerConversionError unless `converted` encodes and decodes as sentencepiece does
    on SAMPLE_TEXTS and on the vocabulary's own pieces."""
    import sentencepiece as spm

    original = spm.SentencePieceProcessor(model_file=str(path))
    pieces = [p.piece.replace("▁", " ") for p in proto.pieces if p.type == _NORMAL]
    texts = list(SAMPLE_TEXTS) + [" ".join(pieces[i:i + 64]) for i in range(0, len(pieces), 64)]
    if proto.trainer_spec.model_type == _BPE:
        texts.append(LITERAL_PIECES)
    converted.encode_special_tokens = True  # sentencepiece never matches control pieces in text
    try:
        for text, encoding in zip(texts, converted.encode_batch(texts, add_special_tokens=False)):
            want = original.encode(text)
            if encoding.ids != want:
                raise TokenizerConversionError(
                    f"{path}: the converted tokenizer encodes {text[:60]!r} as "
                    f"{encoding.ids[:12]}..., sentencepiece as {want[:12]}...; it cannot be "
                    "exported as a tokenizer.json")
            decoded = converted.decode(want, skip_special_tokens=False)
            if decoded != original.decode(want):
                raise TokenizerConversionError(
                    f"{path}: the converted tokenizer decodes {want[:12]}... as "
                    f"{decoded[:60]!r}, sentencepiece as {original.decode(want)[:60]!r}")
    finally:
        converted.encode_special_tokens = False


def tokenizer_files(tokenizer: Tokenizer, max_length: int) -> dict[str, bytes]:
    """File name -> contents of the tokenizer files of a folder for `tokenizer` (a loaded
    megabeta tokenizer) in a model of `max_length` tokens' context."""
    info = tokenizer.info
    source = Path(info.path)
    sentencepiece = isinstance(tokenizer, SentencePieceTokenizer)
    files: dict[str, bytes] = {}
    if sentencepiece:
        files[SENTENCEPIECE_FILE] = source.read_bytes()
        files[TOKENIZER_JSON] = convert_sentencepiece(source).to_str().encode("utf-8")
    else:
        files[TOKENIZER_JSON] = source.read_bytes()
    specials = dict(info.special_tokens)
    if info.eos_id < 0 or not specials.get("eos"):
        raise TokenizerConversionError(f"{source}: has no end-of-text token, which megabeta "
                                       "appends to every document; export it with the "
                                       "tokenizer the model was trained with")
    roles = {"bos_token": specials["eos"], "eos_token": specials["eos"],
             "pad_token": specials.get("pad"),
             "unk_token": (tokenizer.processor.id_to_piece(info.unk_id)
                           if sentencepiece and info.unk_id >= 0 else None)}
    roles = {role: text for role, text in roles.items() if text}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **roles, "add_bos_token": False,
              "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "model_max_length": max_length, "split_special_tokens": sentencepiece}
    files["tokenizer_config.json"] = _json(config)
    files["special_tokens_map.json"] = _json(roles)
    return files


def _json(value: dict) -> bytes:
    return (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
