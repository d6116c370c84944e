"""Inputs beyond .txt/.jsonl(.gz): parquet and zstd give the same dataset as the same texts in
JSONL; directories and globs of mixed files; bad records as one error naming file and row, or
--skip-bad with a count; --keep-empty writes empty documents as Megatron does; missing extras."""

from __future__ import annotations

import gzip
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
from support.corpus import documents, tokenize, train_tiny_tokenizer, write_jsonl

from data_tools.cli import main
from data_tools.corpus import ReadOptions, input_files
from data_tools.progress import ByteProgress
from data_tools.train_tokenizer import sample_sentences
from megabeta.data import IndexedDataset

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    docs = documents(90)
    reference = write_jsonl(root / "all.jsonl", docs)
    return root, docs, reference, train_tiny_tokenizer(root, [reference], vocab_size=300)


def dataset_bytes(prefix: Path) -> list[bytes]:
    return [Path(f"{prefix}{suffix}").read_bytes() for suffix in (".bin", ".idx")]


def write_parquet(path: Path, texts: list, row_group_size: int = 7, column: str = "text") -> Path:
    pq.write_table(pa.table({column: texts, "n": list(range(len(texts)))}), path,
                   row_group_size=row_group_size)
    return path


def write_zst(path: Path, jsonl: Path) -> Path:
    path.write_bytes(zstandard.ZstdCompressor().compress(jsonl.read_bytes()))
    return path


def test_parquet_zst_directory_and_glob_match_the_same_texts_in_jsonl(base, tmp_path):
    root, docs, reference, model = base
    assert tokenize(model, [reference], tmp_path / "ref") == 0
    expected = dataset_bytes(tmp_path / "ref")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    # Sorted by name: a (parquet, several row groups), b (.jsonl.zst), c (.zst), d (.jsonl.gz).
    write_parquet(mixed / "a.parquet", docs[:40])
    write_zst(mixed / "b.jsonl.zst", write_jsonl(tmp_path / "b.jsonl", docs[40:60]))
    write_zst(mixed / "c.zst", write_jsonl(tmp_path / "c.jsonl", docs[60:75]))
    with gzip.open(mixed / "d.jsonl.gz", "wt", encoding="utf-8") as stream:
        stream.write((write_jsonl(tmp_path / "d.jsonl", docs[75:])).read_text())
    (mixed / "README.md").write_text("not an input: left out of a directory")
    for name, inputs in (("dir", [mixed]), ("glob", [f"{mixed}/*"]),
                         ("chunks", [mixed, "--chunk-mb", "0.0005", "--workers", "2"])):
        assert tokenize(model, inputs, tmp_path / name) == 0, name
        assert dataset_bytes(tmp_path / name) == expected, name


def test_bad_parquet_rows_and_columns_name_file_and_row(base, tmp_path, capsys):
    _, _, _, model = base
    nulls = write_parquet(tmp_path / "n.parquet", ["one", None, "three", None])
    assert tokenize(model, [nulls], tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert f"{nulls} row 2: null in column 'text'" in err and "--skip-bad" in err
    assert main(["tokenize", "--tokenizer", str(model), "--inputs", str(nulls),
                 "--output-prefix", str(tmp_path / "skip"), "--skip-bad"]) == 0
    err = capsys.readouterr().err
    assert f"2 bad record(s) skipped (first at {nulls} row 2)" in err
    sidecar = IndexedDataset(tmp_path / "skip").sidecar
    assert sidecar["num_documents"] == 2 and sidecar["report"]["bad_records_skipped"] == 2
    assert tokenize(model, [nulls], tmp_path / "out", "--text-key", "body") == 2
    err = capsys.readouterr().err
    assert f"{nulls}: no column 'body' (columns: ['text', 'n'])" in err
    assert tokenize(model, [nulls], tmp_path / "out", "--text-key", "n") == 2
    assert f"{nulls}: column 'n' holds int64, not text" in capsys.readouterr().err
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 this is not parquet")
    assert tokenize(model, [broken], tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert f"{broken}: not a readable parquet file" in err and "Traceback" not in err


def test_bad_jsonl_records_skip_bad_and_corrupt_zst(base, tmp_path, capsys):
    _, _, _, model = base
    lines = tmp_path / "bad.jsonl"
    lines.write_text('{"text": "good"}\n{"text": 3}\nnot json\n{"body": "x"}\n{"text": "ok"}\n')
    assert tokenize(model, [lines], tmp_path / "out") == 2
    assert f"{lines}:2: no string field 'text'" in capsys.readouterr().err
    assert main(["tokenize", "--tokenizer", str(model), "--inputs", str(lines),
                 "--output-prefix", str(tmp_path / "skip"), "--skip-bad"]) == 0
    assert f"3 bad record(s) skipped (first at {lines}:2)" in capsys.readouterr().err
    assert IndexedDataset(tmp_path / "skip").sidecar["num_documents"] == 2
    corrupt = tmp_path / "corrupt.jsonl.zst"
    good = zstandard.ZstdCompressor().compress(b'{"text": "a"}\n' * 1000)
    corrupt.write_bytes(good[:len(good) // 2] + b"\x00" * 64)
    assert tokenize(model, [corrupt], tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert f"{corrupt}: not a readable zstd file" in err and "Traceback" not in err


def test_keep_empty_writes_empty_documents_as_megatron_does(base, tmp_path, capsys):
    _, _, _, model = base
    texts = ["first", "", "third", "", ""]
    corpus = write_jsonl(tmp_path / "e.jsonl", texts)
    assert tokenize(model, [corpus], tmp_path / "skip") == 0
    assert IndexedDataset(tmp_path / "skip").num_documents == 2
    assert tokenize(model, [corpus], tmp_path / "keep", "--keep-empty") == 0
    kept = IndexedDataset(tmp_path / "keep")
    # One document per input line; an empty one has no sequence (no tokens, not even the EOS):
    # Megatron's document index repeats the previous end.
    assert kept.num_documents == 5 and len(kept) == 2
    assert kept.document_indices.tolist() == [0, 1, 1, 2, 2, 2]
    assert kept.sidecar["report"]["empty_documents_kept"] == 3
    skipped = IndexedDataset(tmp_path / "skip")
    assert [kept[i].tolist() for i in range(2)] == [skipped[i].tolist() for i in range(2)]


@pytest.mark.parametrize("module, extra, name", [("zstandard", "zstd", "x.jsonl.zst"),
                                                  ("pyarrow.parquet", "parquet", "x.parquet")])
def test_missing_extra_is_named(base, tmp_path, monkeypatch, capsys, module, extra, name):
    _, _, _, model = base
    path = tmp_path / name
    path.write_bytes(b"something")
    monkeypatch.setitem(sys.modules, module, None)  # importing it now fails
    assert tokenize(model, [path], tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert f"pip install 'megabeta[{extra}]'" in err and str(path) in err


def test_sentencepiece_output_is_megatrons_format_built_by_hand(base, tmp_path):
    """The sentencepiece path writes what it always has: sentencepiece's ids with the EOS, uint16,
    and an index packed here independently of the writer, in Megatron's MMIDIDX layout."""
    _, docs, reference, model = base
    assert tokenize(model, [reference], tmp_path / "ds", "--workers", "2") == 0
    processor = spm.SentencePieceProcessor(model_file=str(model))
    ids = [processor.encode(doc) + [processor.eos_id()] for doc in docs]
    sizes = np.array([len(i) for i in ids], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(sizes[:-1].astype(np.int64) * 2)])
    index = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
             + struct.pack("<Q", len(ids)) + struct.pack("<Q", len(ids) + 1) + sizes.tobytes()
             + pointers.astype(np.int64).tobytes()
             + np.arange(len(ids) + 1, dtype=np.int64).tobytes())
    assert (tmp_path / "ds.idx").read_bytes() == index
    assert (tmp_path / "ds.bin").read_bytes() == \
        np.concatenate([np.array(i, dtype=np.uint16) for i in ids]).tobytes()


def test_corrupt_files_stop_with_one_error_or_are_read_up_to_the_damage(base, tmp_path,
                                                                         capsys):
    """A .zst whose second frame is garbage, a .gz cut in half, a parquet that is not one: one
    error naming the file; with --skip-bad each is read up to the damage (the record the damage
    cut is left out), counted, and the output is the same for any chunking and worker count."""
    _, docs, _, model = base
    texts = docs[:40]
    zst = tmp_path / "a.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(
        write_jsonl(tmp_path / "frame.jsonl", texts[:25]).read_bytes()) + bytes(range(64)) * 2)
    whole = gzip.compress(write_jsonl(tmp_path / "all.jsonl", texts).read_bytes())
    gz = tmp_path / "b.jsonl.gz"
    gz.write_bytes(whole[:len(whole) // 2])
    not_parquet = tmp_path / "c.parquet"
    not_parquet.write_bytes(b"PAR1 this is not parquet")
    inputs = [zst, gz, not_parquet]
    for bad in inputs:
        assert tokenize(model, [bad], tmp_path / "out") == 2
        err = capsys.readouterr().err
        assert f"{bad}: not a readable" in err and "--skip-bad" in err and "Traceback" not in err
    outputs = []
    for extra in ([], ["--chunk-mb", "0.0002", "--workers", "2"]):
        prefix = tmp_path / f"skip{len(outputs)}"
        assert main(["tokenize", "--tokenizer", str(model), "--inputs", *map(str, inputs),
                     "--output-prefix", str(prefix), "--skip-bad", *extra]) == 0
        outputs.append(dataset_bytes(prefix))
        err = capsys.readouterr().err
        assert f"3 unreadable file(s) read only up to the damage, the rest skipped (first: {zst}: " \
               f"not a readable zstd file after the record at line 25" in err, err
    assert outputs[0] == outputs[1]
    report = IndexedDataset(tmp_path / "skip0").sidecar["report"]
    assert report["bad_files_cut"] == 3 and "bad_records_skipped" not in report
    # What was kept: the zst's first frame, then the gz's whole lines before the cut.
    from_gz = IndexedDataset(tmp_path / "skip0").num_documents - 25
    assert 0 < from_gz < len(texts)
    reference = write_jsonl(tmp_path / "kept.jsonl", texts[:25] + texts[:from_gz])
    assert tokenize(model, [reference], tmp_path / "kept") == 0
    assert outputs[0] == dataset_bytes(tmp_path / "kept")
    # train-tokenizer's sample reads the same way.
    options = ReadOptions(skip_bad=True)
    with ByteProgress(1, "sample", quiet=True) as progress:
        sample = sample_sentences(input_files(inputs), options, 10_000, 0, progress)
    assert sample.counts.bad_files == 3 and sample.counts.documents == 25 + from_gz
