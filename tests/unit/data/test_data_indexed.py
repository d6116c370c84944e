"""An index whose sizes, pointers or document indices disagree is refused when a run opens the
dataset (issue 19 §5): `build_train_val` (train and eval) checks the whole index, O(sequences),
and names the .idx file, the first offending entry and what to do; `inspect` still opens such a
dataset and reports the same check as FAIL."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from data_tools.cli import main as data_main
from data_tools.writer import IndexedDatasetWriter
from megabeta.data import DataError, IndexedDataset, build_train_val
from megabeta.data.format import INDEX_HEADER
from support.train_helpers import TINY, launch

SEQUENCES = 12


@pytest.fixture()
def prefix(tmp_path: Path) -> Path:
    """12 one-sequence documents of 5-19 uint16 tokens, with a sidecar."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 20, SEQUENCES)
    tokens = rng.integers(3, 100, int(lengths.sum())).astype(np.uint16)
    prefix = tmp_path / "ds"
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        writer.add_documents(tokens, lengths)
        writer.commit({"tokenizer": {"vocab_size": 100}})
    return prefix


def edit_index(prefix: Path, change) -> None:
    """Apply `change(sizes, pointers, docs)` (writable copies) to PREFIX.idx in place."""
    index = Path(f"{prefix}.idx")
    raw = bytearray(index.read_bytes())
    count = SEQUENCES
    sizes_at = INDEX_HEADER.size
    pointers_at = sizes_at + 4 * count
    docs_at = pointers_at + 8 * count
    sizes = np.frombuffer(bytes(raw[sizes_at:pointers_at]), "<i4").copy()
    pointers = np.frombuffer(bytes(raw[pointers_at:docs_at]), "<i8").copy()
    docs = np.frombuffer(bytes(raw[docs_at:]), "<i8").copy()
    change(sizes, pointers, docs)
    raw[sizes_at:pointers_at] = sizes.tobytes()
    raw[pointers_at:docs_at] = pointers.tobytes()
    raw[docs_at:] = docs.tobytes()
    index.write_bytes(bytes(raw))


def two_sizes_sum_kept(sizes, pointers, docs):
    sizes[2] += 3
    sizes[6] -= 3


def pointer_moved(sizes, pointers, docs):
    pointers[4] += 2


def pointers_swapped(sizes, pointers, docs):
    pointers[[7, 8]] = pointers[[8, 7]]


def negative_size(sizes, pointers, docs):
    sizes[2] += sizes[1] + 1
    sizes[1] = -1


def documents_decrease(sizes, pointers, docs):
    docs[4] = 2


def document_out_of_range(sizes, pointers, docs):
    docs[5] = SEQUENCES + 7


# Corruptions the open checks (header, file sizes, the arrays' ends) cannot see: the dataset
# opens, so `inspect` can report it, and a run refuses it.
@pytest.mark.parametrize("change,message", [
    (two_sizes_sum_kept, r"sequence 3 starts at byte \d+, but sequence 2 \(\d+ tokens from byte "
                         r"\d+\) ends at byte \d+: its sizes and pointers disagree"),
    (pointer_moved, r"sequence 4 starts at byte \d+, but sequence 3 .* disagree"),
    (pointers_swapped, r"sequence 7 starts at byte"),
    (negative_size, r"sequence 1 has size -1, a negative number of tokens"),
    (documents_decrease, r"document index 4 is 2, less than document index 3 \(3\)"),
    (document_out_of_range, rf"document index 5 is {SEQUENCES + 7}, outside \[0, {SEQUENCES}\]"),
], ids=["two_sizes_sum_kept", "pointer_moved", "pointers_swapped", "negative_size",
        "documents_decrease", "document_out_of_range"])
def test_inconsistent_index_is_refused_by_a_run(prefix: Path, change, message: str) -> None:
    build_train_val([prefix], seq_len=4)  # the good dataset passes
    edit_index(prefix, change)
    IndexedDataset(prefix)  # opens (what inspect needs) ...
    with pytest.raises(DataError, match=message) as caught:
        build_train_val([prefix], seq_len=4, val_fraction=0.1)  # ... but no run reads it
    text = str(caught.value)
    assert text.startswith(f"{prefix}.idx: ")
    assert "megabeta-data tokenize" in text and "megabeta-data inspect" in text


def test_the_second_dataset_of_a_blend_is_named(prefix: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    for suffix in (".bin", ".idx", ".json"):
        shutil.copy(f"{prefix}{suffix}", f"{other}{suffix}")
    edit_index(other, two_sizes_sum_kept)
    with pytest.raises(DataError, match=r"other\.idx: sequence 3 starts"):
        build_train_val([prefix, other], seq_len=4)


@pytest.mark.parametrize("change,message", [
    (lambda s, p, d: s.__setitem__(4, s[4] + 1), r"sequence 5 starts at byte \d+, but sequence 4"),
    (lambda s, p, d: d.__setitem__(0, 1), r"document indices run from 1 to"),
    (lambda s, p, d: d.__setitem__(-1, SEQUENCES - 1), rf"run from 0 to {SEQUENCES - 1}"),
], ids=["one_size", "documents_start", "documents_end"])
def test_damage_the_open_sees_names_the_first_offending_entry(prefix: Path, change,
                                                              message: str) -> None:
    edit_index(prefix, change)
    with pytest.raises(DataError, match=message):
        IndexedDataset(prefix)


def test_inspect_reports_the_same_check(prefix: Path, capsys) -> None:
    edit_index(prefix, two_sizes_sum_kept)
    assert data_main(["inspect", str(prefix)]) == 2
    out = capsys.readouterr().out
    assert "FAIL  index and .bin agree: " in out and "sequence 3 starts at byte" in out


@pytest.mark.slow
def test_train_refuses_an_inconsistent_index(tiny_data, tmp_path: Path) -> None:
    source, _ = tiny_data
    prefix = tmp_path / "corpus"
    for suffix in (".bin", ".idx", ".json"):
        shutil.copy(f"{source}{suffix}", f"{prefix}{suffix}")
    dataset = IndexedDataset(prefix)
    index = Path(f"{prefix}.idx")
    raw = bytearray(index.read_bytes())
    sizes = np.frombuffer(bytes(raw[INDEX_HEADER.size:INDEX_HEADER.size + 4 * len(dataset)]),
                          "<i4").copy()
    sizes[10] += 5
    sizes[20] -= 5
    raw[INDEX_HEADER.size:INDEX_HEADER.size + sizes.nbytes] = sizes.tobytes()
    index.write_bytes(bytes(raw))
    done = launch([*TINY, f"--data.path={prefix}", f"--run_dir={tmp_path / 'run'}"], check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"error: {index}: sequence 11 starts at byte" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
