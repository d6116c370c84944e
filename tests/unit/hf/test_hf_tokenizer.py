"""Issue 45, item 3: the tokenizer travels with the folder (megabeta/hf/tokenizer.py).

A sentencepiece model (BPE or unigram) is converted to a tokenizer.json whose ids are
sentencepiece's on a corpus and on texts that stress whitespace, newlines, tabs, digits and
bytes (the independent reference is the sentencepiece library itself, which megabeta's
tokenizer calls); a tokenizer.json travels as itself. `AutoTokenizer.from_pretrained(DIR)` gives
megabeta's ids with no special token added, the end-of-document token as EOS (and BOS, the
token a document starts after), and decodes as megabeta does; megabeta reads the folder's
tokenizer back.
"""

from __future__ import annotations

import json

import pytest
import sentencepiece as spm
import torch

pytest.importorskip("tokenizers")

from support.corpus import TRICKY_TEXTS
from support.hf_helpers import export_folder
from support.model_helpers import tiny_model

from data_tools.tokenizer import load_tokenizer
from megabeta.checkpoint import CheckpointError
from megabeta.checkpoint.export import read_source
from megabeta.hf import tokenizer as hf_tokenizer
from megabeta.hf.tokenizer import SAMPLE_TEXTS, convert_sentencepiece

EXTRA_TEXTS = [*TRICKY_TEXTS, *SAMPLE_TEXTS, "1234567890 " * 5, "    \n\t\t  \n",
               "zebra quokka xylophone", "mixed123digits456", "ü" * 7]


@pytest.mark.parametrize("kind", ["sp_bpe", "sp_unigram"])
def test_sentencepiece_converts_to_the_same_ids(kind, tokenizer_files, corpus_texts):
    path = tokenizer_files[kind]
    original = spm.SentencePieceProcessor(model_file=str(path))
    converted = convert_sentencepiece(path)
    converted.encode_special_tokens = True  # as transformers runs it (split_special_tokens)
    texts = corpus_texts + EXTRA_TEXTS
    for text, encoding in zip(texts, converted.encode_batch(texts, add_special_tokens=False)):
        assert encoding.ids == original.encode(text), text
        assert converted.decode(encoding.ids, skip_special_tokens=False) == original.decode(
            encoding.ids)


def test_a_conversion_that_differs_is_refused(tokenizer_files, monkeypatch):
    """The conversion checks itself: BPE merges in the wrong order give other ids, and the
    export says so instead of writing a tokenizer that disagrees with the model's."""
    monkeypatch.setattr(hf_tokenizer, "_merges", _reversed_merges)
    with pytest.raises(CheckpointError, match="cannot be exported as a tokenizer.json"):
        convert_sentencepiece(tokenizer_files["sp_bpe"])


def _reversed_merges(proto):
    """Every split of every normal piece, the lowest-scoring piece's first."""
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    merges = []
    for piece in proto.pieces:
        text = piece.piece
        if piece.type == 1:
            merges += [(text[:i], text[i:]) for i in range(1, len(text))
                       if text[:i] in vocab and text[i:] in vocab]
    return merges[::-1]


@pytest.fixture(scope="module")
def folders(tokenizer_files, tmp_path_factory) -> dict:
    """kind -> (folder, megabeta tokenizer)."""
    model = tiny_model(torch.float32, vocab_size=400, max_seq_len=64)
    root = tmp_path_factory.mktemp("hf_tokenizer_folders")
    return {kind: (export_folder(model, path, root / kind), load_tokenizer(path))
            for kind, path in tokenizer_files.items()}


@pytest.mark.parametrize("kind", ["sp_bpe", "sp_unigram", "hf_bpe"])
def test_autotokenizer_gives_megabetas_ids(kind, folders, corpus_texts):
    from transformers import AutoTokenizer

    folder, megabeta = folders[kind]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    for text in corpus_texts[:100] + EXTRA_TEXTS:
        ids = megabeta.encode(text).tolist()
        assert tokenizer(text).input_ids == ids, text
        assert tokenizer.encode(text) == ids
        assert tokenizer.decode(ids) == megabeta.decode(ids)
    info = megabeta.info
    assert tokenizer.eos_token_id == info.eos_id >= 0
    assert tokenizer.bos_token_id == info.eos_id  # a document starts after the previous EOS
    assert tokenizer.pad_token_id == info.pad_id
    # The end-of-document token as megabeta's data writes it: appended, and decoded away.
    document = megabeta.encode_documents(["alpha beta"])[0].tolist()
    assert document[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(document, skip_special_tokens=True) == "alpha beta"


def test_sentencepiece_control_pieces_typed_as_text_are_text(folders):
    """sentencepiece spells `</s>` typed in a text out as characters; so does the folder's
    tokenizer (split_special_tokens), not the EOS id."""
    from transformers import AutoTokenizer

    folder, megabeta = folders["sp_bpe"]
    text = "a line that mentions </s> and <s> and <pad>"
    ids = AutoTokenizer.from_pretrained(folder)(text).input_ids
    assert ids == megabeta.encode(text).tolist()
    assert megabeta.eos_id not in ids


def test_tokenizer_files_travel_and_megabeta_reads_them_back(folders, tokenizer_files):
    for kind, (folder, megabeta) in folders.items():
        original = tokenizer_files[kind]
        name = "tokenizer.json" if kind == "hf_bpe" else "tokenizer.model"
        assert (folder / name).read_bytes() == original.read_bytes()
        recorded = read_source(folder).tokenizer
        assert recorded == {"path": str(folder / name), "sha256": megabeta.info.sha256}
        back = load_tokenizer(recorded["path"])
        assert back.encode("alpha beta\n\tgamma").tolist() == megabeta.encode(
            "alpha beta\n\tgamma").tolist()
        assert back.eos_id == megabeta.eos_id
        config = json.loads((folder / "tokenizer_config.json").read_text())
        assert config["add_bos_token"] is False and config["tokenizer_class"] == (
            "PreTrainedTokenizerFast")
