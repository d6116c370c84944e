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
        assert "warning: 3 damaged file(s) read only up to the damage" in err, err
        assert f"warning:   {zst}: not a readable zstd file after the record at line 25: " in err
        assert "(25 record(s) read, the rest of the file unread, its length unknown)" in err
    assert outputs[0] == outputs[1]
    report = IndexedDataset(tmp_path / "skip0").sidecar["report"]
    assert report["bad_files_cut"] == 3 and "bad_records_skipped" not in report
    # What was kept: the zst's first frame, then the gz's whole lines before the cut.
    from_gz = IndexedDataset(tmp_path / "skip0").num_documents - 25
    assert 0 < from_gz < len(texts)
    assert [(cut["path"], cut["records_read"], cut["records_not_read"])
            for cut in report["cut_files"]] == [(str(zst), 25, None), (str(gz), from_gz, None),
                                                (str(not_parquet), 0, None)]
    reference = write_jsonl(tmp_path / "kept.jsonl", texts[:25] + texts[:from_gz])
    assert tokenize(model, [reference], tmp_path / "kept") == 0
    assert outputs[0] == dataset_bytes(tmp_path / "kept")
    # train-tokenizer's sample reads the same way.
    options = ReadOptions(skip_bad=True)
    with ByteProgress(1, "sample", quiet=True) as progress:
        sample = sample_sentences(input_files(inputs), options, 10_000, 0, progress)
    assert sample.counts.bad_files == 3 and sample.counts.documents == 25 + from_gz


def _cut(path: Path, share: float, source: bytes) -> Path:
    path.write_bytes(source[:int(len(source) * share)])
    return path


@pytest.fixture(scope="module")
def long_corpus(base, tmp_path_factory):
    """3,000 documents as JSONL, .jsonl.zst (one frame of many blocks), .jsonl.gz and parquet
    (row groups of 500), each of about 100 kB compressed."""
    root = tmp_path_factory.mktemp("long")
    docs = documents(3000, seed=1)
    jsonl = write_jsonl(root / "long.jsonl", docs)
    zst = write_zst(root / "long.jsonl.zst", jsonl)
    gz = root / "long.jsonl.gz"
    gz.write_bytes(gzip.compress(jsonl.read_bytes()))
    return docs, jsonl, zst, gz, write_parquet(root / "long.parquet", docs, row_group_size=500)


@pytest.mark.parametrize("suffix, share", [(".jsonl.zst", 0.6), (".jsonl.zst", 0.5),
                                           (".jsonl.gz", 0.6)])
def test_a_compressed_file_cut_short_is_a_damaged_file_not_bad_json(base, long_corpus, tmp_path,
                                                                    capsys, suffix, share):
    """zstandard's stream reader ends a frame cut short as if the data ended there: the line it
    cut read as invalid JSON, and with --skip-bad as 1 bad record, the rest of the file dropped
    uncounted. The damaged file is named, with the line the damage follows; with --skip-bad
    the records read from it are counted, on stderr and in the sidecar."""
    _, _, _, model = base
    docs, _, zst, gz, _ = long_corpus
    cut = _cut(tmp_path / f"cut{suffix}", share, (zst if suffix.endswith("zst") else gz)
               .read_bytes())
    assert tokenize(model, [cut], tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert f"error: {cut}: not a readable {'zstd' if 'zst' in suffix else 'gzip'} file after " \
           "the record at line " in err, err
    assert "invalid JSON" not in err and "contains no text" not in err
    line = int(err.split("after the record at line ")[1].split(":")[0])
    assert 0 < line < len(docs)
    assert main(["tokenize", "--tokenizer", str(model), "--inputs", str(cut),
                 "--output-prefix", str(tmp_path / "skip"), "--skip-bad", "--quiet"]) == 0
    err = capsys.readouterr().err  # said despite --quiet
    assert "warning: 1 damaged file(s) read only up to the damage" in err, err
    assert f"{cut}: not a readable" in err and f"({line:,} record(s) read, the rest of the " \
           "file unread, its length unknown)" in err
    dataset = IndexedDataset(tmp_path / "skip")
    report = dataset.sidecar["report"]
    assert "bad_records_skipped" not in report and report["bad_files_cut"] == 1
    assert report["cut_files"][0]["records_read"] == line == dataset.num_documents
    # The records before the damage are kept, as the same texts in a whole file give them.
    assert tokenize(model, [write_jsonl(tmp_path / "head.jsonl", docs[:line])],
                    tmp_path / "head") == 0
    assert dataset_bytes(tmp_path / "skip") == dataset_bytes(tmp_path / "head")


def test_a_zst_cut_inside_its_first_block_is_damaged_from_its_start(base, long_corpus, tmp_path,
                                                                    capsys):
    _, _, _, model = base
    cut = _cut(tmp_path / "small.jsonl.zst", 0.1, long_corpus[2].read_bytes())
    assert tokenize(model, [cut], tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert f"{cut}: not a readable zstd file from its start: the file ends " in err, err
    assert "contains no text" not in err and "invalid JSON" not in err


def test_zst_frames_whole_or_cut_anywhere(tmp_path):
    """The frame walk against zstandard's own frames: many frames of every block kind (raw,
    RLE, compressed), with and without checksums and content sizes, and skippable frames, are
    whole; the same bytes cut at any byte are not (a cut at a frame boundary is a whole file)."""
    import random

    from data_tools.corpus import zstd_cut_short

    rng = random.Random(5)
    text = "".join(documents(300, seed=2)).encode()
    for trial in range(60):
        frames, boundaries = b"", {0}
        for _ in range(rng.randint(1, 3)):
            body = rng.choice([text[:rng.randint(0, len(text))], bytes(rng.randint(0, 300_000)),
                               rng.randbytes(rng.randint(0, 150_000))])
            frames += zstandard.ZstdCompressor(
                level=rng.choice([1, 3, 19]), write_checksum=rng.random() < 0.5,
                write_content_size=rng.random() < 0.5).compress(body)
            if rng.random() < 0.3:
                skip = rng.randint(0, 40)
                frames += (0x184D2A5A).to_bytes(4, "little") + skip.to_bytes(4, "little") + \
                    bytes(skip)
            boundaries.add(len(frames))
        path = tmp_path / "t.zst"
        path.write_bytes(frames)
        assert zstd_cut_short(path) is None, trial
        for cut in rng.sample(range(1, len(frames)), 5):
            path.write_bytes(frames[:cut])
            assert (zstd_cut_short(path) is None) == (cut in boundaries), (trial, cut)
    path.write_bytes(zstandard.ZstdCompressor().compress(text) + b"\x00" * 9)
    assert zstd_cut_short(path) == f"bytes {len(path.read_bytes()) - 9:,}-" \
                                   f"{len(path.read_bytes()):,} are not a zstd frame"


def test_a_damaged_parquet_file_counts_the_rows_not_read(base, long_corpus, tmp_path, capsys):
    """A parquet file cut short (its footer gone) is damaged from its start, alone an error
    that says so (not a hint about --text-key); one damaged inside a row group says the row the
    damage follows and, its footer intact, how many rows were not read."""
    _, _, _, model = base
    docs, jsonl, _, _, parquet = long_corpus
    whole = parquet.read_bytes()
    cut = _cut(tmp_path / "cut.parquet", 0.6, whole)
    assert tokenize(model, [cut], tmp_path / "out") == 2
    assert f"{cut}: not a readable parquet file from its start" in capsys.readouterr().err
    assert tokenize(model, [cut], tmp_path / "out", "--skip-bad") == 2
    err = capsys.readouterr().err
    assert f"error: no documents in {cut}: nothing was kept (1 damaged file(s)" in err, err
    assert "--text-key" not in err
    damaged = bytearray(whole)
    damaged[len(whole) // 2:len(whole) // 2 + 200] = bytes(200)
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(bytes(damaged))
    assert tokenize(model, [bad], tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert f"{bad}: not a readable parquet file after row " in err, err
    row = int(err.split("after row ")[1].split(":")[0])
    assert 0 < row < len(docs)
    assert main(["tokenize", "--tokenizer", str(model), "--inputs", str(cut), str(bad),
                 str(jsonl), "--output-prefix", str(tmp_path / "skip"), "--skip-bad"]) == 0
    err = capsys.readouterr().err
    assert f"({row:,} record(s) read, {len(docs) - row:,} not read)" in err, err
    dataset = IndexedDataset(tmp_path / "skip")
    assert dataset.num_documents == row + len(docs)
    assert [(c["records_read"], c["records_not_read"])
            for c in dataset.sidecar["report"]["cut_files"]] == [(0, None), (row, len(docs) - row)]


def test_inspect_and_merge_keep_what_was_skipped_or_cut(base, long_corpus, tmp_path, capsys):
    """The sidecar's report is shown by inspect, and merge sums every count of it (the damaged
    files listed in order), not only the empty and undecodable documents."""
    _, _, _, model = base
    docs, jsonl, zst, _, _ = long_corpus
    cut = _cut(tmp_path / "cut.jsonl.zst", 0.5, zst.read_bytes())
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\nnot json\n\n')
    assert tokenize(model, [cut, broken], tmp_path / "a", "--skip-bad") == 0
    assert tokenize(model, [broken], tmp_path / "b", "--skip-bad") == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    read = IndexedDataset(tmp_path / "a").sidecar["report"]["cut_files"][0]["records_read"]
    assert f"input      1 empty document(s) skipped (first at {broken}:3)" in out, out
    assert f"1 bad record(s) skipped (first at {broken}:2)" in out
    assert f"{cut}: not a readable zstd file after the record at line {read}" in out
    assert main(["merge", "--inputs", str(tmp_path / "a"), str(tmp_path / "b"),
                 "--output-prefix", str(tmp_path / "ab")]) == 0
    report = IndexedDataset(tmp_path / "ab").sidecar["report"]
    assert report["empty_documents_skipped"] == 2 and report["bad_records_skipped"] == 2
    assert report["first_bad_record"] == f"{broken}:2" and report["bad_files_cut"] == 1
    assert report["cut_files"][0]["path"] == str(cut)
    assert report["cut_files"][0]["records_read"] == read


def test_the_summary_gives_small_inputs_in_kilobytes(base, tmp_path, capsys):
    _, _, _, model = base
    corpus = write_jsonl(tmp_path / "small.jsonl", documents(40))
    assert main(["tokenize", "--tokenizer", str(model), "--inputs", str(corpus),
                 "--output-prefix", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    size = corpus.stat().st_size
    assert f"from {size / 1e3:,.1f} kB in " in err and "0.0 MB" not in err, err
