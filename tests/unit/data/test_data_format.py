"""The .bin/.idx files follow Megatron-LM's MMIDIDX layout, checked by a reader written here from
the format description alone (struct and raw bytes, nothing from megabeta.data.format)."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
from support.corpus import documents, tokenize, train_tiny_tokenizer, write_jsonl

from data_tools.cli import main
from data_tools.writer import IndexedDatasetWriter
from megabeta.data import DataError, IndexedDataset
from megabeta.data.format import token_dtype_for_vocab

# From the description: code -> (struct letter, item size).
_CODES = {1: ("B", 1), 2: ("b", 1), 3: ("h", 2), 4: ("i", 4), 5: ("q", 8), 6: ("d", 8), 7: ("f", 4),
          8: ("H", 2)}


def read_mmidx(prefix: Path) -> dict:
    """Independent reader: header, version, dtype code, counts, lengths, pointers, doc indices."""
    raw = Path(f"{prefix}.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, sequences, doc_field = struct.unpack_from("<QBQQ", raw, 9)
    offset = 9 + 8 + 1 + 8 + 8
    lengths = list(struct.unpack_from(f"<{sequences}i", raw, offset))
    offset += 4 * sequences
    pointers = list(struct.unpack_from(f"<{sequences}q", raw, offset))
    offset += 8 * sequences
    doc_indices = list(struct.unpack_from(f"<{doc_field}q", raw, offset))
    offset += 8 * doc_field
    letter, size = _CODES[code]
    data = Path(f"{prefix}.bin").read_bytes()
    sequences_tokens = [list(struct.unpack_from(f"<{n}{letter}", data, p))
                        for n, p in zip(lengths, pointers)]
    return {"version": version, "code": code, "sequences": sequences, "doc_field": doc_field,
            "lengths": lengths, "pointers": pointers, "doc_indices": doc_indices,
            "tokens": sequences_tokens, "idx_bytes": len(raw), "end": offset,
            "bin_bytes": len(data), "item_size": size}


def write_mmidx(prefix: Path, code: int, sequences: list[list[int]],
                doc_indices: list[int]) -> None:
    """Independent writer (a Megatron-style dataset, possibly several sequences per document)."""
    letter, size = _CODES[code]
    pointers, position = [], 0
    for seq in sequences:
        pointers.append(position)
        position += size * len(seq)
    head = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(sequences), len(doc_indices))
    body = (struct.pack(f"<{len(sequences)}i", *map(len, sequences))
            + struct.pack(f"<{len(sequences)}q", *pointers)
            + struct.pack(f"<{len(doc_indices)}q", *doc_indices))
    Path(f"{prefix}.idx").write_bytes(head + body)
    Path(f"{prefix}.bin").write_bytes(b"".join(struct.pack(f"<{len(s)}{letter}", *s)
                                               for s in sequences))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("format")
    docs = documents(60)
    source = write_jsonl(root / "docs.jsonl", docs)
    model = train_tiny_tokenizer(root, [source])
    assert tokenize(model, [source], root / "ds") == 0
    return root, docs, model


def test_idx_layout_is_megatron_mmidx(corpus):
    root, docs, model = corpus
    found = read_mmidx(root / "ds")
    processor = spm.SentencePieceProcessor(model_file=str(model))
    expected = [processor.encode(doc) + [processor.eos_id()] for doc in docs]
    assert found["version"] == 1
    assert found["code"] == 8  # uint16: the 400-piece vocabulary fits
    assert found["sequences"] == len(docs)
    assert found["doc_field"] == len(docs) + 1  # Megatron stores the length of document_indices
    assert found["doc_indices"] == list(range(len(docs) + 1))
    assert found["lengths"] == [len(ids) for ids in expected]
    assert found["pointers"] == [2 * sum(map(len, expected[:i])) for i in range(len(docs))]
    assert found["idx_bytes"] == found["end"]  # nothing after the document indices
    assert found["bin_bytes"] == 2 * sum(map(len, expected))
    assert found["tokens"] == expected  # EOS after every document, no BOS


def test_reader_gives_zero_copy_views(corpus):
    root, docs, _ = corpus
    dataset = IndexedDataset(root / "ds")
    independent = read_mmidx(root / "ds")
    assert len(dataset) == dataset.num_documents == len(docs)
    assert isinstance(dataset.tokens, np.memmap)
    for i in (0, 7, len(docs) - 1, -1):
        view = dataset[i]
        assert np.shares_memory(view, dataset.tokens)
        assert view.tolist() == independent["tokens"][i]
    with pytest.raises(IndexError):
        dataset[len(docs)]


def test_reader_pickles_by_prefix(corpus):
    root, _, _ = corpus
    dataset = IndexedDataset(root / "ds")
    payload = pickle.dumps(dataset)
    assert len(payload) < 1000 < dataset.tokens.nbytes  # the tokens are reopened, not copied
    again = pickle.loads(payload)
    assert np.array_equal(again.tokens, dataset.tokens)


def test_int32_tokens_when_the_vocabulary_exceeds_uint16(tmp_path):
    assert token_dtype_for_vocab(65536) == np.uint16
    assert token_dtype_for_vocab(65537) == np.int32
    sequences = [[70000, 5, 2], [65536, 2]]
    with IndexedDatasetWriter(tmp_path / "wide", token_dtype_for_vocab(70001)) as writer:
        writer.add_documents(np.array(sum(sequences, []), dtype="<i4"), np.array([3, 2]))
        writer.commit({})
    found = read_mmidx(tmp_path / "wide")
    assert found["code"] == 4 and found["item_size"] == 4
    assert found["tokens"] == sequences
    assert found["pointers"] == [0, 12]
    assert IndexedDataset(tmp_path / "wide")[0].tolist() == sequences[0]


def test_reads_megatron_datasets_with_several_sequences_per_document(tmp_path):
    sequences = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], []]
    write_mmidx(tmp_path / "mega", 8, sequences, [0, 2, 3, 5])  # documents: 2, 1 and 2 sequences
    dataset = IndexedDataset(tmp_path / "mega")
    assert dataset.sidecar is None and dataset.vocab_size is None
    assert (len(dataset), dataset.num_documents, dataset.num_tokens) == (5, 3, 10)
    assert [dataset[i].tolist() for i in range(5)] == sequences
    assert dataset.document_token_range(0, 1) == (0, 5)
    assert dataset.document_token_range(1, 3) == (5, 10)
    dataset.validate()


def test_merge_equals_tokenizing_the_inputs_together(tmp_path):
    docs = documents(40, seed=3)
    first = write_jsonl(tmp_path / "a.jsonl", docs[:25])
    second = write_jsonl(tmp_path / "b.jsonl", docs[25:])
    model = train_tiny_tokenizer(tmp_path, [first, second])
    assert tokenize(model, [first], tmp_path / "a") == 0
    assert tokenize(model, [second], tmp_path / "b") == 0
    assert tokenize(model, [first, second], tmp_path / "ab") == 0
    assert main(["merge", "--inputs", str(tmp_path / "a"), str(tmp_path / "b"),
                 "--output-prefix", str(tmp_path / "merged"), "--quiet"]) == 0
    for suffix in (".bin", ".idx"):
        assert Path(f"{tmp_path}/merged{suffix}").read_bytes() == \
            Path(f"{tmp_path}/ab{suffix}").read_bytes()
    merged = IndexedDataset(tmp_path / "merged")
    assert [entry["prefix"] for entry in merged.sidecar["merged_from"]] == \
        [str(tmp_path / "a"), str(tmp_path / "b")]
    assert merged.tokenizer_sha256 == IndexedDataset(tmp_path / "ab").tokenizer_sha256


def test_merge_refuses_datasets_of_different_tokenizers(tmp_path, capsys):
    source = write_jsonl(tmp_path / "a.jsonl", documents(30))
    one = train_tiny_tokenizer(tmp_path, [source], vocab_size=400)
    other = train_tiny_tokenizer(tmp_path, [source], vocab_size=420)
    assert tokenize(one, [source], tmp_path / "one") == 0
    assert tokenize(other, [source], tmp_path / "other") == 0
    assert main(["merge", "--inputs", str(tmp_path / "one"), str(tmp_path / "other"),
                 "--output-prefix", str(tmp_path / "merged")]) == 2
    error = capsys.readouterr().err
    assert "not made by the same tokenizer" in error and str(tmp_path / "other") in error
    assert not Path(f"{tmp_path}/merged.bin").exists()


def test_writer_refuses_a_wrong_token_type(tmp_path):
    with IndexedDatasetWriter(tmp_path / "x", np.uint16) as writer:
        with pytest.raises(TypeError):
            writer.add_documents(np.array([1, 2], dtype=np.int64), np.array([2]))
    assert not Path(f"{tmp_path}/x.bin").exists()
    with pytest.raises(DataError):
        IndexedDataset(tmp_path / "x")
