"""Every bad input of issue 3 §5 gets a clear error (or a counted warning) naming the file and the
fix, and no failed run leaves a dataset that looks valid."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
from support.corpus import documents, tokenize, train_tiny_tokenizer, write_jsonl

from data_tools.cli import main
from data_tools.writer import IndexedDatasetWriter
from megabeta.data import DataError, IndexedDataset, PackedDataset, build_train_val, file_sha256
from support import REPO


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    source = write_jsonl(root / "good.jsonl", documents(80))
    model = train_tiny_tokenizer(root, [source])
    assert tokenize(model, [source], root / "good") == 0
    return root, source, model


def run(capsys, *argv: str) -> tuple[int, str]:
    """Exit status and stderr; stdout stays readable through ``capsys.readouterr().out``."""
    status = main(list(argv))
    captured = capsys.readouterr()
    print(captured.out, end="")
    return status, captured.err


def tokenize_cli(capsys, model: Path, inputs: list[Path], prefix: Path, *extra: str):
    return run(capsys, "tokenize", "--tokenizer", str(model), "--inputs", *map(str, inputs),
               "--output-prefix", str(prefix), *extra)


def copy_dataset(source: Path, target: Path) -> Path:
    for suffix in (".bin", ".idx", ".json"):
        shutil.copy(f"{source}{suffix}", f"{target}{suffix}")
    return target


def test_missing_input_file(base, tmp_path, capsys):
    _, _, model = base
    status, err = tokenize_cli(capsys, model, [tmp_path / "nope.jsonl"], tmp_path / "out")
    assert status == 2
    assert f"error: {tmp_path / 'nope.jsonl'}: no such file" in err and "--inputs" in err
    assert "Traceback" not in err


def test_empty_input_file(base, tmp_path, capsys):
    _, _, model = base
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    status, err = tokenize_cli(capsys, model, [empty], tmp_path / "out")
    assert status == 2 and f"{empty}: empty file; remove it from --inputs" in err


def test_gzip_without_text_and_broken_gzip(base, tmp_path, capsys):
    _, _, model = base
    hollow = tmp_path / "hollow.jsonl.gz"
    hollow.write_bytes(gzip.compress(b""))
    status, err = tokenize_cli(capsys, model, [hollow], tmp_path / "out")
    assert status == 2 and f"{hollow}: contains no text" in err
    broken = tmp_path / "broken.txt.gz"
    broken.write_bytes(b"this is not gzip data")
    status, err = tokenize_cli(capsys, model, [broken], tmp_path / "out")
    assert status == 2 and f"{broken}: not a readable gzip file" in err


def test_unsupported_file_type_and_directory(base, tmp_path, capsys):
    _, _, model = base
    odd = tmp_path / "data.csv"
    odd.write_text("a,b\n")
    status, err = tokenize_cli(capsys, model, [odd], tmp_path / "out")
    assert status == 2 and f"{odd}: unsupported file type" in err and ".jsonl" in err
    status, err = tokenize_cli(capsys, model, [tmp_path], tmp_path / "out")
    assert status == 2 and "a directory without input files" in err


@pytest.fixture
def bad_utf8(tmp_path) -> Path:
    source = tmp_path / "mixed.txt"
    source.write_bytes(b"good line\nbad \xff\xfe byte\nalso good\n")
    return source


def test_undecodable_utf8_replaced_and_counted(base, bad_utf8, tmp_path, capsys):
    _, _, model = base
    status, err = tokenize_cli(capsys, model, [bad_utf8], tmp_path / "out", "--split", "line")
    assert status == 0
    assert f"warning: 1 document(s) with undecodable UTF-8, bad bytes replaced by U+FFFD " \
           f"(first at {bad_utf8}:2)" in err
    processor = spm.SentencePieceProcessor(model_file=str(model))
    dataset = IndexedDataset(tmp_path / "out")
    assert processor.decode(dataset[1].tolist()[:-1]) == "bad \ufffd\ufffd byte"
    assert dataset.sidecar["report"]["undecodable_documents"] == 1


def test_undecodable_utf8_skipped_and_counted(base, bad_utf8, tmp_path, capsys):
    _, _, model = base
    status, err = tokenize_cli(capsys, model, [bad_utf8], tmp_path / "out", "--split", "line",
                               "--on-bad-utf8", "skip")
    assert status == 0 and "1 document(s) with undecodable UTF-8, skipped" in err
    assert IndexedDataset(tmp_path / "out").num_documents == 2


def test_undecodable_utf8_as_an_error(base, bad_utf8, tmp_path, capsys):
    _, _, model = base
    status, err = tokenize_cli(capsys, model, [bad_utf8], tmp_path / "out", "--split", "line",
                               "--on-bad-utf8", "error")
    assert status == 2 and f"{bad_utf8}:2: invalid UTF-8" in err and "--on-bad-utf8" in err
    assert not Path(f"{tmp_path}/out.bin").exists()


def test_lone_surrogate_in_json_counts_as_undecodable(base, tmp_path, capsys):
    _, _, model = base
    source = tmp_path / "s.jsonl"
    source.write_text('{"text": "ok"}\n{"text": "half \\ud800 pair"}\n')
    status, err = tokenize_cli(capsys, model, [source], tmp_path / "out")
    assert status == 0 and f"(first at {source}:2)" in err
    assert IndexedDataset(tmp_path / "out").sidecar["report"]["undecodable_documents"] == 1


def test_empty_documents_are_skipped_with_a_counted_warning(base, tmp_path, capsys):
    _, _, model = base
    source = write_jsonl(tmp_path / "e.jsonl", ["one", "", "two", ""])
    status, err = tokenize_cli(capsys, model, [source], tmp_path / "out")
    assert status == 0 and f"warning: 2 empty document(s) skipped (first at {source}:2)" in err
    assert IndexedDataset(tmp_path / "out").num_documents == 2


def test_a_corpus_of_only_empty_documents_is_an_error(base, tmp_path, capsys):
    _, _, model = base
    source = write_jsonl(tmp_path / "e.jsonl", ["", ""])
    status, err = tokenize_cli(capsys, model, [source], tmp_path / "out")
    assert status == 2 and "no documents in" in err and "--text-key" in err
    assert not list(tmp_path.glob("out*"))


def test_invalid_json_and_missing_text_key(base, tmp_path, capsys):
    _, _, model = base
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": oops}\n')
    status, err = tokenize_cli(capsys, model, [broken], tmp_path / "out")
    assert status == 2 and f"{broken}:2: invalid JSON" in err
    keyed = write_jsonl(tmp_path / "keyed.jsonl", ["a"], key="body")
    status, err = tokenize_cli(capsys, model, [keyed], tmp_path / "out")
    assert status == 2 and f"{keyed}:1: no string field 'text'" in err and "--text-key" in err
    assert "'body'" in err


def test_a_failed_run_leaves_no_dataset_and_no_temporaries(base, tmp_path, capsys):
    _, source, model = base
    # Many chunks are written before the bad line at the end is reached.
    lines = source.read_text().splitlines() * 20 + ["{not json"]
    big = tmp_path / "big.jsonl"
    big.write_text("\n".join(lines) + "\n")
    for workers in ("1", "2"):
        status, err = tokenize_cli(capsys, model, [big], tmp_path / "out", "--workers", workers,
                                   "--chunk-mb", "0.001")
        assert status == 2 and f"{big}:{len(lines)}: invalid JSON" in err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["big.jsonl"]


def test_existing_output_needs_overwrite(base, tmp_path, capsys):
    root, source, model = base
    prefix = copy_dataset(root / "good", tmp_path / "kept")
    before = Path(f"{prefix}.bin").read_bytes()
    status, err = tokenize_cli(capsys, model, [source], prefix)
    assert status == 2 and "already exists; pass --overwrite" in err
    assert Path(f"{prefix}.bin").read_bytes() == before
    status, _ = tokenize_cli(capsys, model, [source], prefix, "--overwrite")
    assert status == 0


def test_truncated_bin(base, tmp_path, capsys):
    root, _, _ = base
    prefix = copy_dataset(root / "good", tmp_path / "cut")
    data = Path(f"{prefix}.bin").read_bytes()
    Path(f"{prefix}.bin").write_bytes(data[:-10])
    with pytest.raises(DataError, match=r"cut\.bin: .* truncated or come from different runs"):
        IndexedDataset(prefix)
    status, err = run(capsys, "inspect", str(prefix))
    assert status == 2 and "cut.bin" in err and "re-run megabeta-data tokenize" in err


def test_truncated_idx_and_bad_magic(base, tmp_path):
    root, _, _ = base
    prefix = copy_dataset(root / "good", tmp_path / "cut")
    index = Path(f"{prefix}.idx")
    whole = index.read_bytes()
    index.write_bytes(whole[:-8])
    with pytest.raises(DataError, match=r"cut\.idx: .* truncated or damaged"):
        IndexedDataset(prefix)
    index.write_bytes(whole[:20])
    with pytest.raises(DataError, match=r"shorter than the 34-byte MMIDIDX header"):
        IndexedDataset(prefix)
    index.write_bytes(b"NOTMMIDX!" + whole[9:])
    with pytest.raises(DataError, match=r"not an MMIDIDX index"):
        IndexedDataset(prefix)


def _other_dataset(model, tmp_path) -> None:
    """Tokenize a different corpus to `tmp_path/other` (its files replace a good dataset's)."""
    other = write_jsonl(tmp_path / "other.jsonl", documents(30, seed=9))
    assert tokenize(model, [other], tmp_path / "other") == 0


def test_bin_and_idx_of_different_runs(base, tmp_path):
    root, _, model = base
    _other_dataset(model, tmp_path)
    prefix = copy_dataset(root / "good", tmp_path / "mixed")
    shutil.copy(f"{tmp_path}/other.idx", f"{prefix}.idx")
    with pytest.raises(DataError, match=r"mixed\.(bin|idx|json)"):
        IndexedDataset(prefix)
    Path(f"{prefix}.json").unlink()  # without the sidecar the size check still catches it
    with pytest.raises(DataError, match=r"mixed\.bin: .* come from different runs"):
        IndexedDataset(prefix)


def test_sidecar_of_another_dataset(base, tmp_path):
    root, _, model = base
    _other_dataset(model, tmp_path)
    prefix = copy_dataset(root / "good", tmp_path / "ds")
    shutil.copy(f"{tmp_path}/other.json", f"{prefix}.json")
    with pytest.raises(DataError, match=r"ds\.json: does not match .*ds\.idx \(num_documents"):
        IndexedDataset(prefix)


def test_damaged_pointer_is_found_by_inspect(base, tmp_path, capsys):
    root, _, _ = base
    prefix = copy_dataset(root / "good", tmp_path / "ds")
    dataset = IndexedDataset(prefix)
    pointer_at = 34 + 4 * len(dataset) + 8 * 5  # sequence 5's pointer
    raw = bytearray(Path(f"{prefix}.idx").read_bytes())
    raw[pointer_at:pointer_at + 8] = np.int64(3).tobytes()
    Path(f"{prefix}.idx").write_bytes(bytes(raw))
    status, err = run(capsys, "inspect", str(prefix))
    assert status == 2 and "1 check(s) failed" in err
    out = capsys.readouterr().out
    assert "FAIL  index and .bin agree: " in out and "sequence 5 starts at byte 3" in out


def test_token_ids_at_or_above_the_vocabulary(base, tmp_path, capsys):
    _, _, model = base
    prefix = tmp_path / "wild"
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        writer.add_documents(np.array([5, 6, 2, 7, 400, 2], dtype=np.uint16), np.array([3, 3]))
        writer.commit({"tokenizer": {"sha256": file_sha256(model), "vocab_size": 400,
                                     "eos_id": 2, "path": str(model)}, "append_eos": True})
    with pytest.raises(DataError, match=r"wild\.bin: token 4 \(document 1\) has id 400, outside "
                                        r"the vocabulary \[0, 400\)"):
        IndexedDataset(prefix).check_token_ids()
    with pytest.raises(DataError, match=r"has id 400"):
        build_train_val([prefix], seq_len=2, verify_token_ids=True)
    status = main(["inspect", str(prefix)])
    out = capsys.readouterr().out
    assert status == 2
    assert "FAIL  token ids below the vocabulary size" in out and "re-tokenize" in out


def test_dataset_of_another_tokenizer(base, tmp_path, capsys):
    root, source, model = base
    other = train_tiny_tokenizer(tmp_path, [source], vocab_size=420)
    with pytest.raises(DataError, match=r"tokenized with a model of sha256 .* but this run names "
                                        r"one of sha256 .*re-tokenize"):
        build_train_val([root / "good"], seq_len=8, expected_tokenizer_hash=file_sha256(other))
    data = build_train_val([root / "good"], seq_len=8, expected_tokenizer_hash=file_sha256(model))
    assert data.tokenizer_sha256 == file_sha256(model)
    status = main(["inspect", str(root / "good"), "--tokenizer", str(other)])
    assert status == 2
    assert f"but {other} has sha256" in capsys.readouterr().out


def test_sequence_length_longer_than_any_sample(base):
    root, _, _ = base
    dataset = IndexedDataset(root / "good")
    with pytest.raises(DataError, match=rf"good\.bin: {dataset.num_tokens} tokens, fewer than one "
                                        rf"sample .* use a seq_len of at most "
                                        rf"{dataset.num_tokens - 1}"):
        PackedDataset(dataset, seq_len=dataset.num_tokens)
    assert len(PackedDataset(dataset, seq_len=dataset.num_tokens - 1)) == 1
    with pytest.raises(DataError, match=r"validation split"):
        build_train_val([root / "good"], seq_len=200, val_fraction=0.02)


def test_missing_dataset_files(tmp_path):
    with pytest.raises(DataError, match=r"nothing\.idx: missing; a dataset prefix names"):
        IndexedDataset(tmp_path / "nothing")
    Path(f"{tmp_path}/half.idx").write_bytes(b"")
    with pytest.raises(DataError, match=r"half\.bin: missing"):
        IndexedDataset(tmp_path / "half")


def test_unusable_tokenizer_model(base, tmp_path, capsys):
    _, source, _ = base
    fake = tmp_path / "fake.model"
    fake.write_text("not a model")
    status, err = tokenize_cli(capsys, fake, [source], tmp_path / "out")
    assert status == 2 and f"{fake}: not a sentencepiece model" in err
    status, err = tokenize_cli(capsys, tmp_path / "absent.model", [source], tmp_path / "out")
    assert status == 2 and "no such tokenizer file" in err and "--tokenizer" in err


def test_sidecar_that_is_not_json(base, tmp_path):
    root, _, _ = base
    prefix = copy_dataset(root / "good", tmp_path / "ds")
    Path(f"{prefix}.json").write_text("{broken")
    with pytest.raises(DataError, match=r"ds\.json: sidecar is not valid JSON"):
        IndexedDataset(prefix)
    Path(f"{prefix}.json").write_text(json.dumps({"something": "else"}))
    with pytest.raises(DataError, match=r"not a megabeta dataset sidecar"):
        IndexedDataset(prefix)


@pytest.mark.slow
def test_an_error_on_one_mpi_rank_stops_every_rank_and_leaves_nothing(base, tmp_path):
    mpirun = Path(sys.executable).parent / "mpirun"
    if not mpirun.exists():
        pytest.skip("no mpirun next to the interpreter")
    _, source, model = base
    broken = tmp_path / "zz-broken.jsonl"  # the last file: rank 1's share
    broken.write_text('{"text": "fine"}\n{"text": oops}\n')
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    done = subprocess.run(
        [str(mpirun), "-n", "2", "--oversubscribe", sys.executable, "-m", "data_tools",
         "tokenize", "--tokenizer", str(model), "--inputs", str(source), str(broken),
         "--output-prefix", str(tmp_path / "out"), "--quiet"],
        env=env, capture_output=True, text=True, timeout=120,
        cwd=REPO)
    assert done.returncode != 0
    assert done.stderr.count(f"error: {broken}:2: invalid JSON") == 1  # said once, by rank 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["zz-broken.jsonl"]
