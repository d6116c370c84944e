"""Document ids (data.document_mask) and block-aligned packing (data.align = "block", spec §7)
through splits, blends, the loader and a resume at another world size. Expected values come from
a naive recomputation over the raw .bin: documents are found by scanning for EOS (every document
ends with one and no other token is EOS), the block-aligned stream is built token by token."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from data_tools.writer import IndexedDatasetWriter
from megabeta.config import load_config
from megabeta.data import (
    BlendedDataset,
    DataError,
    GlobalSampler,
    MaskedBatch,
    StatefulLoader,
    build_train_val,
)
from megabeta.model import ConfigError
from megabeta.model.loss import IGNORE_INDEX

EOS, PAD = 2, 0
SEQ, BLOCK = 32, 8


def write_dataset(prefix: Path, seed: int, count: int, longest: int) -> Path:
    """`count` documents of 1 to `longest` tokens, each ending with EOS (ids 4-99 otherwise)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, longest + 1, count)
    lengths[:3] = (1, SEQ + 1, 3 * SEQ)  # a one-token document, one of a whole sample, a long one
    docs = [np.append(rng.integers(4, 100, n - 1), EOS) for n in lengths]
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        writer.add_documents(np.concatenate(docs).astype(np.uint16), lengths)
        writer.commit({"tokenizer": {"vocab_size": 100, "eos_id": EOS, "pad_id": PAD}})
    return prefix


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("documents")
    return [write_dataset(root / "a", 1, 60, 40), write_dataset(root / "b", 2, 40, 70)]


def raw_documents(prefix: Path, val_fraction: float) -> list[np.ndarray]:
    """The training split's documents, cut at EOS in the raw .bin."""
    tokens = np.fromfile(f"{prefix}.bin", dtype=np.uint16).astype(np.int64)
    ends = np.flatnonzero(tokens == EOS) + 1
    docs = np.split(tokens, ends[:-1])
    return docs[:len(docs) - math.ceil(val_fraction * len(docs))]


def naive_packed(docs: list[np.ndarray], index: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [SEQ + 1], ids [SEQ]) of packed sample `index`: an input's id is the number of
    EOS before it in the sample."""
    sample = np.concatenate(docs)[index * SEQ:index * SEQ + SEQ + 1]
    return sample, np.concatenate(([0], np.cumsum(sample[:-1] == EOS)))[:SEQ]


def naive_block_stream(docs: list[np.ndarray], block: int) -> tuple[list, list, list]:
    """(tokens, is_document_token, segment number) of the block-aligned stream, built one token
    at a time: pad until the stream's length is a multiple of `block`, then the document."""
    tokens, real, segment = [], [], []
    for doc in docs:
        if len(tokens) % block:
            gap = block - len(tokens) % block
            tokens += [PAD] * gap
            real += [False] * gap
            segment += [segment[-1] + 1] * gap
        segment += [(segment[-1] + 1) if segment else 0] * len(doc)
        tokens += doc.tolist()
        real += [True] * len(doc)
    return tokens, real, segment


def naive_block(docs: list[np.ndarray], index: int,
                block: int = BLOCK) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, mask, ids) of block-aligned sample `index`."""
    tokens, real, segment = (np.array(x) for x in naive_block_stream(docs, block))
    window = slice(index * SEQ, index * SEQ + SEQ + 1)
    real = real[window]
    mask = real & np.concatenate(([True], real[:-1]))
    ids = segment[window][:SEQ] - segment[window][0]
    return tokens[window], mask.astype(np.uint8), ids


def build(prefixes, align: str, **kwargs):
    return build_train_val(prefixes, [2.0, 1.0][:len(prefixes)], seq_len=SEQ, val_fraction=0.1,
                           align=align, document_mask=True, block_size=BLOCK, **kwargs)


def blend_parts(dataset) -> list[tuple[int, int]]:
    """(dataset, its sample) of each blended sample."""
    assert isinstance(dataset, BlendedDataset)
    return list(zip(dataset.dataset_index.tolist(), dataset.dataset_sample_index.tolist()))


def test_packed_ids_match_the_documents_through_a_split_and_a_blend(prefixes):
    data = build(prefixes, "packed")
    docs = [raw_documents(p, 0.1) for p in prefixes]
    for k, (part, local) in enumerate(blend_parts(data.train)):
        sample = data.train[k]
        tokens, ids = naive_packed(docs[part], local)
        np.testing.assert_array_equal(sample.tokens, tokens)
        np.testing.assert_array_equal(sample.documents, ids)
        assert sample.documents.dtype == np.int32 and sample.mask.all()
        assert np.all(np.diff(sample.documents) >= 0)


def test_block_alignment_matches_a_naive_layout(prefixes):
    data = build(prefixes, "block")
    docs = [raw_documents(p, 0.1) for p in prefixes]
    for k, (part, local) in enumerate(blend_parts(data.train)):
        sample = data.train[k]
        tokens, mask, ids = naive_block(docs[part], local)
        np.testing.assert_array_equal(sample.tokens, tokens)
        np.testing.assert_array_equal(sample.mask, mask)
        np.testing.assert_array_equal(sample.documents, ids)


@pytest.mark.parametrize("block", [4, BLOCK, SEQ // 2])
def test_the_padding_share_counts_the_samples_pad_inputs(prefixes, block):
    dataset = build_train_val(prefixes[1:], seq_len=SEQ, val_fraction=0.1, align="block",
                              document_mask=True, block_size=block).train
    _, real, _ = naive_block_stream(raw_documents(prefixes[1], 0.1), block)
    inputs = np.array(real[:len(dataset) * SEQ])
    assert dataset.padding_share == pytest.approx(1.0 - inputs.mean(), abs=1e-12)


def test_every_document_starts_at_a_multiple_of_the_block_and_pads_are_masked(prefixes):
    data = build(prefixes[:1], "block")
    pads_seen = 0
    for k in range(len(data.train)):
        sample = data.train[k]
        ids, tokens = sample.documents, sample.tokens
        pad = tokens == PAD  # documents hold EOS and ids 4-99 only
        starts = np.r_[0, np.flatnonzero(np.diff(ids)) + 1]
        ends = np.r_[starts[1:], SEQ]
        for start, end in zip(starts, ends):
            segment = pad[start:end]
            assert segment.all() or not segment.any()  # a pad run or a document, never both
            if not segment.any() and start > 0:
                assert start % BLOCK == 0 and tokens[start - 1] in (EOS, PAD), (k, start)
            if segment.any():
                assert tokens[start - 1] == EOS and end % BLOCK == 0
        assert not sample.mask[pad].any()  # a pad is no target
        assert not sample.mask[1:][pad[:-1]].any()  # and predicts none
        pads_seen += int(pad[:SEQ].sum())
    assert pads_seen > 0


def test_block_alignment_adds_no_padding_when_documents_fill_blocks(tmp_path):
    lengths = np.full(60, BLOCK)
    tokens = np.tile(np.r_[np.arange(4, 4 + BLOCK - 1), EOS], 60).astype(np.uint16)
    with IndexedDatasetWriter(tmp_path / "d", np.uint16) as writer:
        writer.add_documents(tokens, lengths)
        writer.commit({"tokenizer": {"vocab_size": 100, "eos_id": EOS, "pad_id": PAD}})
    block = build([tmp_path / "d"], "block").train
    packed = build([tmp_path / "d"], "packed").train
    assert block.padding_share == 0.0 and len(block) == len(packed)
    for k in range(len(block)):
        np.testing.assert_array_equal(block[k].documents, packed[k].documents)
        np.testing.assert_array_equal(block[k].tokens, packed[k].tokens)


def test_document_aligned_samples_give_the_padding_its_own_id(prefixes, caplog):
    with caplog.at_level("INFO", logger="megabeta"):
        data = build(prefixes[:1], "document")
    expected = []
    documents = raw_documents(prefixes[0], 0.1)
    for doc in documents:
        if 2 <= len(doc) <= SEQ + 1:  # longer ones are left out: no continuation samples
            expected.append((doc, (np.arange(SEQ) >= len(doc)).astype(np.int32)))
    assert len(data.train) == len(expected)
    assert data.train.dropped == sum(len(doc) > SEQ + 1 for doc in documents) > 0
    assert f"{data.train.dropped} of {len(documents)} documents" in caplog.text
    assert "left out" in caplog.text
    real = sum(min(len(chunk), SEQ) for chunk, _ in expected)
    assert data.train.padding_share == pytest.approx(1.0 - real / (len(expected) * SEQ))
    for k, (chunk, ids) in enumerate(expected):
        sample = data.train[k]
        np.testing.assert_array_equal(sample.tokens[:len(chunk)], chunk)
        np.testing.assert_array_equal(sample.documents, ids)


def test_batches_carry_ids_and_the_loss_mask(prefixes):
    data = build(prefixes, "block")
    batch = next(iter(StatefulLoader(data.train, GlobalSampler(len(data.train), seed=3), 4)))
    assert isinstance(batch, MaskedBatch) and batch.documents.shape == (4, SEQ)
    for row in range(4):
        sample = data.train[int(GlobalSampler(len(data.train), seed=3).sample_at(row))]
        np.testing.assert_array_equal(batch.documents[row].numpy(), sample.documents)
        scored = sample.mask[1:] != 0
        np.testing.assert_array_equal(batch.targets[row].numpy(),
                                      np.where(scored, sample.tokens[1:], IGNORE_INDEX))
    moved = batch.to("cpu")
    assert moved.documents is not None and moved.documents.dtype.is_floating_point is False


def test_resume_at_another_world_size_continues_the_same_stream(prefixes):
    data = build(prefixes, "block")
    dataset = data.train
    reference = []
    loader = StatefulLoader(dataset, GlobalSampler(len(dataset), seed=7,
                                                   fingerprint=dataset.fingerprint), 6)
    batches = iter(loader)
    for _ in range(4):
        b = next(batches)
        reference += [(b.inputs[j].numpy().tobytes(), b.documents[j].numpy().tobytes())
                      for j in range(6)]
    # Two steps on 2 ranks of 3, then resume on 3 ranks of 2: the same 24 samples.
    first = [StatefulLoader(dataset, GlobalSampler(len(dataset), 2, rank, seed=7,
                                                   fingerprint=dataset.fingerprint), 3)
             for rank in range(2)]
    seen = interleave([iter(loader) for loader in first], 2, 3)
    state = first[0].state_dict()
    assert state == first[1].state_dict() and state["samples_consumed"] == 12
    second = []
    for rank in range(3):
        loader = StatefulLoader(dataset, GlobalSampler(len(dataset), 3, rank, seed=7,
                                                       fingerprint=dataset.fingerprint), 2)
        loader.load_state_dict(state)
        second.append(iter(loader))
    seen += interleave(second, 2, 2)
    assert seen == reference


def interleave(iterators: list, steps: int, batch: int) -> list[tuple[bytes, bytes]]:
    """(inputs, ids) of `steps` steps of the ranks' iterators in global stream order: rank r's
    row j is position r + W·j of its step."""
    out = []
    for _ in range(steps):
        batches = [next(it) for it in iterators]
        for j in range(batch):
            for b in batches:
                out.append((b.inputs[j].numpy().tobytes(), b.documents[j].numpy().tobytes()))
    return out


def test_a_source_loss_mask_is_kept_under_block_alignment(tmp_path):
    lengths = np.array([5, 11, 3, 20, 9, 14, 7, 30])
    rng = np.random.default_rng(4)
    docs = [np.append(rng.integers(4, 100, n - 1), EOS) for n in lengths]
    source_mask = (rng.random(int(lengths.sum())) < 0.7).astype(np.uint8)
    with IndexedDatasetWriter(tmp_path / "m", np.uint16, loss_mask=True) as writer:
        writer.add_documents(np.concatenate(docs).astype(np.uint16), lengths, source_mask)
        writer.commit({"tokenizer": {"vocab_size": 100, "eos_id": EOS, "pad_id": PAD}})
    dataset = build_train_val([tmp_path / "m"], seq_len=SEQ, align="block", document_mask=True,
                              block_size=BLOCK).train
    _, real, _ = naive_block_stream(docs, BLOCK)
    stream_mask = np.zeros(len(real), dtype=np.uint8)
    stream_mask[np.array(real)] = source_mask
    for k in range(len(dataset)):
        _, mask, _ = naive_block(docs, k)
        window = stream_mask[k * SEQ:k * SEQ + SEQ + 1]
        np.testing.assert_array_equal(dataset[k].mask, mask & window)


def test_blends_of_datasets_with_and_without_ids_are_refused(prefixes):
    with_ids = build(prefixes[:1], "packed").train
    without = build_train_val(prefixes[1:], seq_len=SEQ).train
    with pytest.raises(DataError, match="document_mask"):
        BlendedDataset([with_ids, without])


@pytest.mark.parametrize("overrides, key", [
    (["--data.align=blocks"], "data.align"),
    (["--data.align=block"], "data.document_mask"),
    (["--data.align=block", "--data.document_mask=true", "--model.arch=standard"],
     "model.arch"),
    (["--data.align=block", "--data.document_mask=true", "--model.block_size=256",
      "--data.seq_len=256"], "model.block_size"),
    (["--data.align=block", "--data.document_mask=true", "--model.block_size=32",
      "--data.seq_len=100"], "data.seq_len"),
])
def test_bad_settings_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


def test_block_align_without_the_mask_is_refused_by_the_data_too(prefixes):
    with pytest.raises(DataError, match="document_mask"):
        build_train_val(prefixes, seq_len=SEQ, align="block", block_size=BLOCK)


def test_new_options_are_documented_in_help_config():
    from megabeta.config import describe_fields

    text = describe_fields()
    assert "data.document_mask" in text and "`block`" in text


def test_document_alignment_refuses_data_whose_documents_are_all_longer(tmp_path):
    with IndexedDatasetWriter(tmp_path / "long", np.uint16) as writer:
        writer.add_documents(np.full(3 * 50, 7, dtype=np.uint16), np.array([50, 50, 50]))
        writer.commit({"tokenizer": {"vocab_size": 100}})
    with pytest.raises(DataError, match=r"no document of 2 to seq_len \+ 1 = 33 tokens \(3 "
                                        r"longer, the longest 50\).*data\.seq_len"):
        build_train_val([tmp_path / "long"], seq_len=SEQ, align="document")
