"""Tokenizers of the three kinds a folder carries, trained once per session on the same corpus:
sentencepiece BPE and unigram (.model, converted to a tokenizer.json) and a byte-level BPE
tokenizer.json (which travels as itself)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.corpus import documents, train_tiny_tokenizer, write_jsonl

from data_tools.cli import main


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """The models here are tiny: a second intra-op thread only spins against the first."""


@pytest.fixture(scope="session")
def corpus_texts() -> list[str]:
    return documents(300, seed=5)


@pytest.fixture(scope="session")
def tokenizer_files(tmp_path_factory, corpus_texts) -> dict[str, Path]:
    """kind -> tokenizer file: `sp_bpe`, `sp_unigram`, `hf_bpe`."""
    root = tmp_path_factory.mktemp("hf_tokenizers")
    corpus = write_jsonl(root / "corpus.jsonl", corpus_texts)
    files = {"sp_bpe": train_tiny_tokenizer(root, [corpus], vocab_size=320, model_type="bpe"),
             "sp_unigram": train_tiny_tokenizer(root, [corpus], vocab_size=320,
                                                model_type="unigram")}
    assert main(["train-tokenizer", "--kind", "bpe", "--inputs", str(corpus), "--vocab-size",
                 "400", "--output", str(root / "bpe"), "--quiet"]) == 0
    files["hf_bpe"] = root / "bpe.tokenizer.json"
    return files
