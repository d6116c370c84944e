"""Hugging Face tokenizer.json in the data tools: train-tokenizer --kind bpe, tokenize against the
tokenizers library itself, the sidecar, int32 datasets past uint16, the same output for any thread
count and chunking, segments, the one tokenizer interface, and the extra named when missing."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.corpus import documents, tokenize, write_jsonl

from data_tools.cli import main
from data_tools.encode import encode_segments
from data_tools.tokenizer import HuggingFaceTokenizer, SentencePieceTokenizer, load_tokenizer
from megabeta.data import IndexedDataset
from support import REPO

tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    docs = documents(120)
    corpus = write_jsonl(root / "corpus.jsonl", docs)
    assert main(["train-tokenizer", "--kind", "bpe", "--inputs", str(corpus), "--vocab-size",
                 "400", "--output", str(root / "bpe"), "--quiet"]) == 0
    return root, docs, corpus, root / "bpe.tokenizer.json"


def reference_ids(tokenizer_json: Path, docs: list[str], eos: int) -> list[list[int]]:
    """What the tokenizers library itself gives, EOS appended: the independent reference."""
    library = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    return [library.encode(doc, add_special_tokens=False).ids + [eos] for doc in docs]


def test_trained_bpe_round_trips_and_records_its_specials(bpe):
    root, docs, _, tokenizer_json = bpe
    meta = json.loads((root / "bpe.tokenizer.meta.json").read_text())
    assert meta["kind"] == "bpe" and meta["vocab_size"] == 400
    assert meta["sha256"] == hashlib.sha256(tokenizer_json.read_bytes()).hexdigest()
    tokenizer = load_tokenizer(tokenizer_json)
    assert isinstance(tokenizer, HuggingFaceTokenizer)
    info = tokenizer.info
    assert (info.pad_id, info.bos_id, info.eos_id, info.unk_id) == (0, 1, 2, -1)
    assert info.special_tokens == {"bos": "<s>", "eos": "</s>", "pad": "<pad>"}
    for doc in docs:  # byte-level: every text comes back exactly, tabs, CRLF and emoji included
        assert tokenizer.decode(tokenizer.encode(doc).tolist()) == doc
    # Digits one per token, as the sentencepiece models here split them (the tasks rely on it).
    assert len(tokenizer.encode("12345")) == 5


def test_tokenize_matches_the_library_and_the_sidecar_names_the_tokenizer(bpe, tmp_path):
    _, docs, corpus, tokenizer_json = bpe
    assert tokenize(tokenizer_json, [corpus], tmp_path / "ds") == 0
    dataset = IndexedDataset(tmp_path / "ds")
    assert [dataset[i].tolist() for i in range(len(dataset))] == \
        reference_ids(tokenizer_json, docs, eos=2)
    sidecar = dataset.sidecar["tokenizer"]
    assert sidecar["type"] == "huggingface" and sidecar["vocab_size"] == 400
    assert sidecar["sha256"] == hashlib.sha256(tokenizer_json.read_bytes()).hexdigest()
    assert sidecar["special_tokens"]["eos"] == "</s>" and sidecar["eos_id"] == 2


def test_same_output_for_any_thread_count_and_chunking(bpe, tmp_path, monkeypatch):
    _, _, corpus, tokenizer_json = bpe
    monkeypatch.setenv("RAYON_NUM_THREADS", "2")  # --workers sets it; restored after the test
    outputs = []
    for extra in ([], ["--workers", "1"], ["--workers", "3", "--chunk-mb", "0.001"]):
        prefix = tmp_path / f"ds{len(outputs)}"
        assert tokenize(tokenizer_json, [corpus], prefix, *extra) == 0
        outputs.append([Path(f"{prefix}{s}").read_bytes() for s in (".bin", ".idx")])
    assert outputs[0] == outputs[1] == outputs[2]


def test_eos_comes_from_tokenizer_config_json(tmp_path):
    """A tokenizer.json does not say which token ends a document; tokenizer_config.json does."""
    library = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "<END>": 2},
                                                               unk_token="a"))
    library.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    library.add_special_tokens(["<END>"])
    path = tmp_path / "tokenizer.json"
    library.save(str(path))
    corpus = write_jsonl(tmp_path / "c.jsonl", ["a b", "b"])
    assert tokenize(path, [corpus], tmp_path / "none") == 2  # no EOS known: refused
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<END>"}))
    assert load_tokenizer(path).eos_id == 2
    assert tokenize(path, [corpus], tmp_path / "ds") == 0
    dataset = IndexedDataset(tmp_path / "ds")
    assert [dataset[i].tolist() for i in range(2)] == [[0, 1, 2], [1, 2]]


def test_vocabulary_past_uint16_is_stored_as_int32(tmp_path):
    size = 70_000
    vocab = {f"w{i}": i for i in range(size)}
    library = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    library.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    library.add_special_tokens(["</s>"])
    path = tmp_path / "big.json"
    library.save(str(path))
    corpus = write_jsonl(tmp_path / "c.jsonl", ["w69999 w3 w65536", "w1"])
    assert tokenize(path, [corpus], tmp_path / "ds") == 0
    dataset = IndexedDataset(tmp_path / "ds")
    assert dataset.dtype == np.int32 and dataset.sidecar["dtype_code"] == 4
    # MMIDIDX: 9-byte magic, 8-byte version, then the dtype code (4 = int32, as in Megatron).
    assert dataset.paths.idx.read_bytes()[17] == 4
    assert [dataset[i].tolist() for i in range(2)] == [[69999, 3, 65536, size], [1, size]]


def test_segments_encode_each_segment_with_either_kind(bpe):
    _, _, _, tokenizer_json = bpe
    tokenizer = load_tokenizer(tokenizer_json)
    segments = [("question: 12 + 3 = ", False), ("15", True), (" done", False)]
    tokens, mask = encode_segments(tokenizer, segments)
    library = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    pieces = [library.encode(text, add_special_tokens=False).ids for text, _ in segments]
    assert tokens.tolist() == [*pieces[0], *pieces[1], *pieces[2], 2]
    assert mask.tolist() == [0] * len(pieces[0]) + [1] * len(pieces[1]) + \
        [0] * (len(pieces[2]) + 1)


def test_sentencepiece_model_is_chosen_for_a_model_file(tmp_path):
    from support.corpus import train_tiny_tokenizer

    corpus = write_jsonl(tmp_path / "c.jsonl", documents(40))
    model = train_tiny_tokenizer(tmp_path, [corpus], vocab_size=300)
    tokenizer = load_tokenizer(model)
    assert isinstance(tokenizer, SentencePieceTokenizer) and not tokenizer.threaded
    assert tokenizer.info.special_tokens == {"bos": "<s>", "eos": "</s>", "pad": "<pad>"}


def test_missing_tokenizers_names_the_extra(bpe, tmp_path, monkeypatch, capsys):
    _, _, corpus, tokenizer_json = bpe
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers now fails
    status = tokenize(tokenizer_json, [corpus], tmp_path / "ds")
    err = capsys.readouterr().err
    assert status == 2 and "pip install 'megabeta[hf]'" in err and "Traceback" not in err
    assert str(tokenizer_json) in err


def test_not_a_tokenizer_json_is_one_clear_error(tmp_path, capsys):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"not": "a tokenizer"}')
    corpus = write_jsonl(tmp_path / "c.jsonl", ["x"])
    assert tokenize(bad, [corpus], tmp_path / "ds") == 2
    err = capsys.readouterr().err
    assert f"{bad}: not a Hugging Face tokenizer.json" in err and "Traceback" not in err


@pytest.mark.slow
def test_same_output_for_two_mpi_ranks_over_mixed_inputs(bpe, tmp_path):
    """tokenizer.json, a parquet file and a .jsonl.zst under 2 ranks: the single-process
    dataset, byte for byte (each rank's threads encode its share; rank 0 merges)."""
    from test_tokenize_corpus import _mpirun, files_of

    if _mpirun() is None:
        pytest.skip("no mpirun next to the interpreter or on PATH")
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    zstandard = pytest.importorskip("zstandard")
    _, docs, _, tokenizer_json = bpe
    pq.write_table(pa.table({"text": docs[:60]}), tmp_path / "a.parquet", row_group_size=16)
    jsonl = write_jsonl(tmp_path / "b.jsonl", docs[60:])
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        jsonl.read_bytes()))
    inputs = [tmp_path / "a.parquet", tmp_path / "b.jsonl.zst"]
    out = tmp_path / "out"
    out.mkdir()
    assert tokenize(tokenizer_json, inputs, out / "single") == 0
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    done = subprocess.run([_mpirun(), "-n", "2", "--oversubscribe", sys.executable, "-m",
                           "data_tools", "tokenize", "--tokenizer", str(tokenizer_json),
                           "--inputs", *map(str, inputs), "--output-prefix", str(out / "ranks"),
                           "--quiet"], env=env, capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert files_of(out / "single") == files_of(out / "ranks")
    single = IndexedDataset(out / "single")
    assert [single[i].tolist() for i in range(len(single))] == \
        reference_ids(tokenizer_json, docs, eos=2)


def test_a_bpe_smaller_than_asked_for_is_said(bpe, tmp_path, capsys):
    """tokenizers' BPE stops where no pair is left to merge, below --vocab-size and silently
    (sentencepiece refuses such a size): the difference is said."""
    _, _, corpus, _ = bpe
    assert main(["train-tokenizer", "--kind", "bpe", "--inputs", str(corpus), "--vocab-size",
                 "5000", "--output", str(tmp_path / "big"), "--quiet"]) == 0
    size = json.loads((tmp_path / "big.tokenizer.meta.json").read_text())["vocab_size"]
    assert size < 5000
    assert f"warning: --vocab-size 5000 asked for, but the sample has no pair left to merge at " \
           f"{size} tokens" in capsys.readouterr().err
