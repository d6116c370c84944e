"""tokenize: text → tokens → text round trip, document splitting, identical output for any number of
workers and MPI ranks, the sidecar, and inspect."""

from __future__ import annotations

import gzip
import multiprocessing
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import sentencepiece as spm
from support.corpus import documents, tokenize, train_tiny_tokenizer, write_jsonl

from data_tools.cli import main
from data_tools import encode
from data_tools.progress import ByteProgress
from data_tools.tokenize_corpus import contiguous_shares
from megabeta.data import IndexedDataset, file_sha256
from support import REPO


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenize")
    docs = documents(150)
    inputs = [write_jsonl(root / "part1.jsonl", docs[:70]),
              write_jsonl(root / "part2.jsonl", docs[70:120]),
              write_jsonl(root / "part3.jsonl", docs[120:])]
    return root, docs, inputs, train_tiny_tokenizer(root, inputs)


def decoded_documents(prefix: Path, model: Path) -> list[str]:
    """Decode every document, checking that each ends with EOS and none starts with BOS."""
    processor = spm.SentencePieceProcessor(model_file=str(model))
    dataset = IndexedDataset(prefix)
    texts = []
    for i in range(len(dataset)):
        ids = dataset[i].tolist()
        assert ids[-1] == processor.eos_id() and processor.bos_id() not in ids
        texts.append(processor.decode(ids[:-1]))
    return texts


def files_of(prefix: Path) -> list[bytes]:
    return [Path(f"{prefix}{suffix}").read_bytes() for suffix in (".bin", ".idx", ".json")]


def test_round_trip_of_a_multi_document_corpus(setup, tmp_path):
    _, docs, inputs, model = setup
    assert tokenize(model, inputs, tmp_path / "ds") == 0
    assert decoded_documents(tmp_path / "ds", model) == docs


def test_text_files_split_into_documents(setup, tmp_path):
    _, _, _, model = setup
    text = "first para\n  indented line\n\n\nsecond\tpara\r\n\r\nlast line without newline"
    source = tmp_path / "doc.txt"
    source.write_bytes(text.encode())
    expected = {
        "none": [text],
        "paragraph": ["first para\n  indented line", "second\tpara", "last line without newline"],
        "line": ["first para", "  indented line", "second\tpara", "last line without newline"],
    }
    for mode, docs in expected.items():
        assert tokenize(model, [source], tmp_path / mode, "--split", mode) == 0
        assert decoded_documents(tmp_path / mode, model) == docs
    # blank lines are empty documents in line mode: skipped and counted
    report = IndexedDataset(tmp_path / "line").sidecar["report"]
    assert report["empty_documents_skipped"] == 3
    assert report["first_empty_document"] == f"{source}:3"


def test_output_is_identical_for_one_and_two_workers(setup, tmp_path):
    _, _, inputs, model = setup
    # Tiny chunks: many chunks in flight, results must come back in order.
    assert tokenize(model, inputs, tmp_path / "w1", "--workers", "1", "--chunk-mb", "0.001") == 0
    assert tokenize(model, inputs, tmp_path / "w2", "--workers", "2", "--chunk-mb", "0.001") == 0
    assert tokenize(model, inputs, tmp_path / "w2big", "--workers", "2") == 0
    assert files_of(tmp_path / "w1") == files_of(tmp_path / "w2") == files_of(tmp_path / "w2big")


def test_pool_forks_only_from_a_single_threaded_process(monkeypatch):
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    assert encode._start_method().get_start_method() == "fork"
    monkeypatch.setattr(threading, "active_count", lambda: 2)
    assert encode._start_method().get_start_method() == "spawn"


def test_forked_and_spawned_pools_write_the_same_dataset(setup, tmp_path, monkeypatch):
    _, _, inputs, model = setup
    for method in ("fork", "spawn"):
        monkeypatch.setattr(encode, "_start_method",
                            lambda method=method: multiprocessing.get_context(method))
        assert tokenize(model, inputs, tmp_path / method, "--workers", "2", "--chunk-mb",
                        "0.001") == 0
    assert files_of(tmp_path / "fork") == files_of(tmp_path / "spawn")


def _mpirun() -> str | None:
    candidate = Path(sys.executable).parent / "mpirun"
    return str(candidate) if candidate.exists() else shutil.which("mpirun")


@pytest.mark.slow
@pytest.mark.skipif(_mpirun() is None, reason="no mpirun next to the interpreter or on PATH")
def test_output_is_identical_for_one_and_two_mpi_ranks(setup, tmp_path):
    _, _, inputs, model = setup
    assert tokenize(model, inputs, tmp_path / "single") == 0
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    command = [_mpirun(), "-n", "2", "--oversubscribe", sys.executable, "-m", "data_tools",
               "tokenize", "--tokenizer", str(model), "--inputs", *map(str, inputs),
               "--output-prefix", str(tmp_path / "ranks"), "--quiet"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert files_of(tmp_path / "single") == files_of(tmp_path / "ranks")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{name}{suffix}" for name in ("single", "ranks") for suffix in (".bin", ".idx", ".json"))


def test_shares_are_contiguous_balanced_and_complete():
    assert contiguous_shares([10, 10, 10, 10], 2) == [range(0, 2), range(2, 4)]
    assert contiguous_shares([100, 1, 1, 1], 2) == [range(0, 1), range(1, 4)]
    assert contiguous_shares([5], 3) == [range(0, 0), range(0, 1), range(1, 1)]
    shares = contiguous_shares([3, 9, 1, 4, 4, 7, 2], 3)
    assert [i for share in shares for i in share] == list(range(7))


def test_gzip_inputs_give_the_same_dataset(setup, tmp_path):
    _, _, inputs, model = setup
    packed = []
    for source in inputs:
        target = tmp_path / f"{source.name}.gz"
        target.write_bytes(gzip.compress(source.read_bytes()))
        packed.append(target)
    assert tokenize(model, inputs, tmp_path / "plain") == 0
    assert tokenize(model, packed, tmp_path / "packed") == 0
    assert files_of(tmp_path / "plain")[:2] == files_of(tmp_path / "packed")[:2]


def test_sidecar_records_tokenizer_counts_and_arguments(setup, tmp_path):
    _, docs, inputs, model = setup
    assert tokenize(model, inputs, tmp_path / "ds", "--text-key", "text") == 0
    dataset = IndexedDataset(tmp_path / "ds")
    sidecar = dataset.sidecar
    assert sidecar["format"] == "megabeta.token_dataset"
    assert sidecar["tokenizer"] == {"type": "sentencepiece", "path": str(model),
                                    "sha256": file_sha256(model), "vocab_size": 400,
                                    "pad_id": 0, "bos_id": 1, "eos_id": 2, "unk_id": 3,
                                    "special_tokens": {"bos": "<s>", "eos": "</s>",
                                                       "pad": "<pad>"}}
    assert (sidecar["dtype"], sidecar["dtype_code"]) == ("uint16", 8)
    assert sidecar["num_documents"] == sidecar["num_sequences"] == len(docs)
    assert sidecar["num_tokens"] == dataset.num_tokens == int(dataset.sequence_lengths.sum())
    assert sidecar["inputs"] == [{"path": str(p), "bytes": p.stat().st_size} for p in inputs]
    assert sidecar["arguments"] == {"text_key": "text", "split": "none", "on_bad_utf8": "replace"}
    assert (sidecar["add_bos"], sidecar["append_eos"]) == (False, True)
    assert dataset.vocab_size == 400 and dataset.tokenizer_sha256 == file_sha256(model)


def test_inspect_reports_counts_checks_and_a_sample(setup, tmp_path, capsys):
    _, docs, inputs, model = setup
    assert tokenize(model, inputs, tmp_path / "ds") == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "ds"), "--samples", "2", "--sample-tokens", "500"]) == 0
    out = capsys.readouterr().out
    assert f"documents  {len(docs)}" in out
    assert "histogram" in out
    assert out.count("  ok    ") == 4
    assert repr(docs[0]) in out and repr(docs[-1]) in out  # decoded samples: first and last


def test_progress_bar_only_on_a_terminal_and_not_when_quiet(monkeypatch):
    # pytest captures stderr, so it is not a TTY here.
    assert not ByteProgress(100, "x", quiet=False).shown
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert ByteProgress(100, "x", quiet=False).shown
    assert not ByteProgress(100, "x", quiet=True).shown
