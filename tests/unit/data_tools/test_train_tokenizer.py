"""train-tokenizer: exact round trip of whitespace and code, fixed specials, determinism."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import sentencepiece as spm
from support.corpus import TRICKY_TEXTS, documents, train_tiny_tokenizer, write_jsonl

from data_tools.cli import main
from data_tools.corpus import ReadOptions, input_files
from data_tools.progress import ByteProgress
from data_tools.train_tokenizer import sample_sentences, training_pieces
from megabeta.data import file_sha256


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("tok") / "docs.jsonl", documents(120))


# unigram keeps fewer candidate pieces on a tiny corpus, hence its smaller vocabulary.
@pytest.mark.parametrize("model_type, vocab_size", [("bpe", 400), ("unigram", 340)])
def test_text_survives_the_round_trip(corpus_file, tmp_path, model_type, vocab_size):
    model = train_tiny_tokenizer(tmp_path, [corpus_file], vocab_size, model_type)
    processor = spm.SentencePieceProcessor(model_file=str(model))
    unseen = "class A:\n\tdef g(self):\n\t\treturn {'k':  [1,  2]}\n\n\n# 終わり  \r\n"
    for text in [*TRICKY_TEXTS, unseen, " ", "\n", "\t\t", "    "]:
        assert processor.decode(processor.encode(text)) == text


def test_whitespace_is_kept_as_pieces_not_bytes(corpus_file, tmp_path):
    processor = spm.SentencePieceProcessor(model_file=str(train_tiny_tokenizer(tmp_path,
                                                                               [corpus_file])))
    pieces = [processor.id_to_piece(i) for i in processor.encode("a\n\tb\n        c")]
    assert "\n" in pieces and "\t" in pieces
    assert not any(piece.startswith("<0x") for piece in pieces)
    assert any(set(piece) == {"▁"} and len(piece) > 1 for piece in pieces)  # indentation runs


def test_specials_are_fixed_and_recorded(corpus_file, tmp_path):
    model = train_tiny_tokenizer(tmp_path, [corpus_file], vocab_size=420)
    processor = spm.SentencePieceProcessor(model_file=str(model))
    assert (processor.pad_id(), processor.bos_id(), processor.eos_id(), processor.unk_id()) == \
        (0, 1, 2, 3)
    assert processor.vocab_size() == 420
    sidecar = json.loads(Path(f"{str(model)[:-6]}.model.json").read_text())
    assert (sidecar["pad_id"], sidecar["bos_id"], sidecar["eos_id"], sidecar["unk_id"]) == \
        (0, 1, 2, 3)
    assert sidecar["sha256"] == file_sha256(model)
    assert sidecar["vocab_size"] == 420 and sidecar["model_type"] == "bpe"
    vocab = Path(f"{str(model)[:-6]}.vocab").read_text(encoding="utf-8").splitlines()
    assert len(vocab) == 420  # the newline and tab pieces are escaped, one piece per line
    assert vocab[4].split("\t")[0] == "\\n" and vocab[5].split("\t")[0] == "\\t"


def test_same_seed_gives_the_same_model(corpus_file, tmp_path):
    first = train_tiny_tokenizer(tmp_path / "one", [corpus_file], seed=7)
    second = train_tiny_tokenizer(tmp_path / "two", [corpus_file], seed=7)
    assert first.read_bytes() == second.read_bytes()


def test_sample_is_bounded_seeded_and_uniform(corpus_file):
    files = input_files([corpus_file])
    options = ReadOptions()

    def sample(limit: int, seed: int) -> list[str]:
        with ByteProgress(1, "", quiet=True) as progress:
            return sample_sentences(files, options, limit, seed, progress).sentences

    everything = sample(10**9, 0)
    assert len(sample(50, 1)) == 50
    assert sample(50, 1) == sample(50, 1)
    assert sample(50, 1) != sample(50, 2)
    assert set(sample(50, 1)) <= set(everything)
    # Uniform: the second half of the corpus is as likely to be picked as the first.
    picked = sample(len(everything) // 2, 3)
    late = set(everything[len(everything) // 2:])
    assert 0.3 < sum(line in late for line in picked) / len(picked) < 0.7


def test_long_lines_are_cut_for_training():
    text = "a" * 10000 + "\nshort\n" + "tail"
    pieces = list(training_pieces(text))
    assert "".join(pieces) == text
    assert max(map(len, pieces)) <= 4096
    assert pieces[-2:] == ["short\n", "tail"]


def test_reads_gzip_and_a_custom_text_key(tmp_path):
    docs = documents(60, seed=5)
    plain = write_jsonl(tmp_path / "plain.jsonl", docs, key="content")
    packed = tmp_path / "packed.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    outputs = []
    for source in (plain, packed):
        prefix = tmp_path / source.name.split(".")[0]
        assert main(["train-tokenizer", "--inputs", str(source), "--vocab-size", "380",
                     "--output", str(prefix), "--text-key", "content", "--quiet"]) == 0
        outputs.append(Path(f"{prefix}.model").read_bytes())
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("vocab_size, expected", [(100000, "lower --vocab-size"),
                                                   (200, "raise --vocab-size above 262")])
def test_impossible_vocab_sizes_are_refused(corpus_file, tmp_path, capsys, vocab_size, expected):
    status = main(["train-tokenizer", "--inputs", str(corpus_file), "--vocab-size",
                   str(vocab_size), "--output", str(tmp_path / "m"), "--quiet"])
    assert status == 2
    assert expected in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing half-written, no temporaries left
