"""Loss masks through the data pipeline: `tokenize --segments-key` writes PREFIX.mask, the reader
maps it, packing, document-aligned samples, blends, merges and the sampler carry it, the loader
turns it into IGNORE_INDEX targets; sidecar and inspect describe it; damaged masks are clear
errors. Expected values are computed here from the JSONL and the raw files, not by the code."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from support.corpus import tokenize, train_tiny_tokenizer, write_jsonl
from support.segments import segmented_documents, write_plain_jsonl, write_segments_jsonl
from data_tools.cli import main
from megabeta.data import (
    BlendedDataset,
    DataError,
    GlobalSampler,
    IndexedDataset,
    MaskedBatch,
    StatefulLoader,
    build_train_val,
)
from megabeta.model.loss import IGNORE_INDEX
from support import REPO

SEQ = 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(root, segmented docs of two corpora, their JSONL files, tokenizer, processor, masked
    dataset prefixes a and b, an unmasked prefix c)."""
    root = tmp_path_factory.mktemp("masks")
    docs_a, docs_b = segmented_documents(80, seed=1), segmented_documents(50, seed=2)
    seg_a = write_segments_jsonl(root / "a.jsonl", docs_a)
    seg_b = write_segments_jsonl(root / "b.jsonl", docs_b)
    model = train_tiny_tokenizer(root, [write_plain_jsonl(root / "plain.jsonl", docs_a + docs_b)])
    for name, source in (("a", seg_a), ("b", seg_b)):
        assert tokenize(model, [source], root / name, "--segments-key", "segments") == 0
    plain = write_jsonl(root / "c.jsonl", ["".join(t for t, _ in d) for d in docs_b])
    assert tokenize(model, [plain], root / "c") == 0
    return {"root": root, "docs": {"a": docs_a, "b": docs_b}, "jsonl": {"a": seg_a, "b": seg_b},
            "model": model, "spm": spm.SentencePieceProcessor(model_file=str(model))}


def expected_document(processor: spm.SentencePieceProcessor,
                      segments: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """Each segment on its own, then EOS (not scored): what the mask must say."""
    ids, mask = [], []
    for text, loss in segments:
        piece = processor.encode(text)
        ids += piece
        mask += [int(loss)] * len(piece)
    return ids + [processor.eos_id()], mask + [0]


def raw_mask(prefix: Path) -> np.ndarray:
    return np.fromfile(f"{prefix}.mask", dtype=np.uint8)


def test_tokenize_writes_the_mask_of_the_scored_segments(corpus):
    root, processor = corpus["root"], corpus["spm"]
    dataset = IndexedDataset(root / "a")
    assert dataset.has_loss_mask and len(dataset) == len(corpus["docs"]["a"])
    for index, segments in enumerate(corpus["docs"]["a"]):
        ids, mask = expected_document(processor, segments)
        assert dataset[index].tolist() == ids
        assert dataset.loss_mask(index).dtype == np.uint8
        assert dataset.loss_mask(index).tolist() == mask
    flat = raw_mask(root / "a")
    assert flat.size == dataset.num_tokens and set(np.unique(flat)) == {0, 1}
    assert 0 < int(flat.sum()) < flat.size
    sidecar = json.loads((root / "a.json").read_text())
    assert sidecar["loss_mask"] == {
        "file": "a.mask", "sha256": hashlib.sha256((root / "a.mask").read_bytes()).hexdigest(),
        "scored_tokens": int(flat.sum())}
    assert sidecar["arguments"]["segments_key"] == "segments"
    # Without a mask: every target scored, and no mask file or sidecar entry.
    plain = IndexedDataset(root / "c")
    assert not plain.has_loss_mask and "loss_mask" not in plain.sidecar
    assert not (root / "c.mask").exists()
    assert plain.loss_mask(2).tolist() == [1] * len(plain[2])


@pytest.mark.slow
def test_mask_is_identical_for_any_workers_and_ranks(corpus, tmp_path):
    model, inputs = corpus["model"], [corpus["jsonl"]["a"], corpus["jsonl"]["b"]]
    flags = ["--segments-key", "segments"]
    # One prefix name in three directories: the sidecar names the mask file.
    for name in ("w1", "w2", "ranks"):
        (tmp_path / name).mkdir()
    assert tokenize(model, inputs, tmp_path / "w1" / "ds", *flags) == 0
    assert tokenize(model, inputs, tmp_path / "w2" / "ds", *flags, "--workers", "2",
                    "--chunk-mb", "0.001") == 0
    suffixes = (".bin", ".idx", ".mask", ".json")
    files = {name: [(tmp_path / name / f"ds{s}").read_bytes() for s in suffixes]
             for name in ("w1", "w2")}
    assert files["w1"] == files["w2"]
    mpirun = Path(sys.executable).parent / "mpirun"
    if not mpirun.exists():
        pytest.skip("no mpirun next to the interpreter")
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    done = subprocess.run(
        [str(mpirun), "-n", "2", "--oversubscribe", sys.executable, "-m", "data_tools",
         "tokenize", "--tokenizer", str(model), "--inputs", *map(str, inputs),
         "--output-prefix", str(tmp_path / "ranks" / "ds"), "--quiet", *flags],
        env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [(tmp_path / "ranks" / f"ds{s}").read_bytes() for s in suffixes] == files["w1"]
    # The parts (masks included) are gone.
    assert sorted(p.name for p in (tmp_path / "ranks").iterdir()) == sorted(
        f"ds{s}" for s in suffixes)


def test_sidecar_and_inspect_show_the_mask(corpus, capsys):
    root = corpus["root"]
    scored, total = int(raw_mask(root / "a").sum()), raw_mask(root / "a").size
    capsys.readouterr()
    assert main(["inspect", str(root / "a"), "--samples", "3"]) == 0
    out = capsys.readouterr().out
    assert f"loss mask  a.mask: {scored:,} of {total:,} tokens scored" in out
    assert f"ok    loss mask matches the sidecar: {scored:,} scored tokens" in out
    assert out.count("  ok    ") == 5 and "  mask     " in out
    assert main(["inspect", str(root / "c")]) == 0
    out = capsys.readouterr().out
    assert "loss mask  none (every target scored)" in out and "skip  loss mask" in out


def copy_dataset(prefix: Path, to: Path) -> Path:
    for suffix in (".bin", ".idx", ".json", ".mask"):
        if Path(f"{prefix}{suffix}").exists():
            shutil.copy(f"{prefix}{suffix}", f"{to}{suffix}")
    return to


def test_damaged_or_mismatched_masks_are_clear_errors(corpus, tmp_path, capsys):
    root = corpus["root"]
    # Truncated: refused on open, naming the file and both sizes.
    short = copy_dataset(root / "a", tmp_path / "short")
    data = Path(f"{short}.mask").read_bytes()
    Path(f"{short}.mask").write_bytes(data[:-3])
    with pytest.raises(DataError, match=rf"{short}\.mask: {len(data) - 3} bytes, but .* describes "
                                        rf"{len(data)} tokens"):
        IndexedDataset(short)
    # Missing while the sidecar lists it.
    missing = copy_dataset(root / "a", tmp_path / "missing")
    os.remove(f"{missing}.mask")
    with pytest.raises(DataError, match=rf"{missing}\.mask: missing, but .*missing\.json lists"):
        IndexedDataset(missing)
    # A stale mask next to a dataset whose sidecar does not list it.
    stale = copy_dataset(root / "c", tmp_path / "stale")
    shutil.copy(f"{root / 'a'}.mask", f"{stale}.mask")
    with pytest.raises(DataError, match=rf"{stale}\.mask: a loss mask that .*stale\.json does "
                                        "not list"):
        IndexedDataset(stale)
    # Same size, damaged contents: the inspect check (and verify_token_ids) fail naming the file.
    flipped = copy_dataset(root / "a", tmp_path / "flipped")
    damaged = bytearray(data)
    damaged[5] ^= 1
    Path(f"{flipped}.mask").write_bytes(bytes(damaged))
    capsys.readouterr()
    assert main(["inspect", str(flipped)]) == 2
    out = capsys.readouterr().out
    assert f"FAIL  loss mask matches the sidecar: {flipped}.mask:" in out
    assert "the mask was changed after it was written" in out
    with pytest.raises(DataError, match=r"flipped\.mask: .* scored tokens, sha256"):
        build_train_val([flipped], seq_len=SEQ, verify_token_ids=True)
    damaged[7] = 9
    Path(f"{flipped}.mask").write_bytes(bytes(damaged))
    with pytest.raises(DataError, match=r"flipped\.mask: byte 7 \(document 0\) is 9, not 0 or 1"):
        IndexedDataset(flipped).check_loss_mask()


@pytest.mark.parametrize("line,expected", [
    ({"text": "no segments here"}, r"no list field 'segments' \(found: \['text'\]\)"),
    ({"segments": "a string"}, r"no list field 'segments' \(it is str\)"),
    ({"segments": [{"text": "ok", "loss": True}, {"loss": False}]},
     r"segments\[1\] is \{\"loss\": false\}, not an object"),
    ({"segments": [{"text": "ok", "loss": 1}]}, r"segments\[0\] is .*, not an object"),
    ({"segments": ["plain"]}, r"segments\[0\] is \"plain\", not an object"),
])
def test_bad_segments_name_file_line_and_field(corpus, tmp_path, capsys, line, expected):
    source = tmp_path / "bad.jsonl"
    good = {"segments": [{"text": "fine", "loss": False}]}
    source.write_text(json.dumps(good) + "\n" + json.dumps(line) + "\n")
    capsys.readouterr()
    assert tokenize(corpus["model"], [source], tmp_path / "out", "--segments-key",
                    "segments") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {source}:2: ") and "Traceback" not in err
    assert re.search(expected, err), err
    assert not list(tmp_path.glob("out*"))


def test_segments_key_refuses_text_files(corpus, tmp_path, capsys):
    source = tmp_path / "doc.txt"
    source.write_text("some text\n")
    capsys.readouterr()
    assert tokenize(corpus["model"], [source], tmp_path / "out", "--segments-key", "s") == 2
    assert f"error: {source}: --segments-key reads JSONL records" in capsys.readouterr().err


def test_a_mask_left_under_the_output_name_is_refused_or_replaced(corpus, tmp_path, capsys):
    model, source = corpus["model"], corpus["jsonl"]["b"]
    plain = write_jsonl(tmp_path / "plain.jsonl", ["some text", "more"])
    assert tokenize(model, [source], tmp_path / "ds", "--segments-key", "segments") == 0
    for suffix in (".bin", ".idx", ".json"):
        os.remove(f"{tmp_path / 'ds'}{suffix}")
    capsys.readouterr()
    assert tokenize(model, [plain], tmp_path / "ds") == 2
    assert f"error: {tmp_path / 'ds'}.mask: already exists; pass --overwrite" in \
        capsys.readouterr().err
    assert tokenize(model, [source], tmp_path / "ds", "--segments-key", "segments",
                    "--overwrite") == 0
    assert tokenize(model, [plain], tmp_path / "ds", "--overwrite") == 0
    assert not (tmp_path / "ds.mask").exists() and not IndexedDataset(tmp_path / "ds").has_loss_mask


def test_merge_keeps_masks_and_scores_every_target_of_unmasked_inputs(corpus, tmp_path):
    root = corpus["root"]
    assert main(["merge", "--inputs", str(root / "a"), str(root / "c"), "--output-prefix",
                 str(tmp_path / "ac"), "--quiet"]) == 0
    merged = IndexedDataset(tmp_path / "ac")
    plain_tokens = IndexedDataset(root / "c").num_tokens
    expected = np.concatenate([raw_mask(root / "a"), np.ones(plain_tokens, dtype=np.uint8)])
    assert np.array_equal(raw_mask(tmp_path / "ac"), expected)
    assert merged.sidecar["loss_mask"]["scored_tokens"] == int(expected.sum())
    assert merged.check_loss_mask() == int(expected.sum())


def test_packed_samples_carry_the_mask_slice_and_collate_ignores_unscored(corpus):
    root = corpus["root"]
    data = build_train_val([root / "a"], seq_len=SEQ)
    tokens = np.fromfile(f"{root / 'a'}.bin", dtype=np.uint16)
    mask = raw_mask(root / "a")
    assert data.train.has_loss_mask
    for index in (0, 3, len(data.train) - 1):
        sample = data.train[index]
        start = index * SEQ
        assert sample.tokens.tolist() == tokens[start:start + SEQ + 1].tolist()
        assert sample.mask.tolist() == mask[start:start + SEQ + 1].tolist()
    sampler = GlobalSampler(len(data.train), shuffle=False, num_epochs=1)
    batch = next(iter(StatefulLoader(data.train, sampler, 2)))
    assert isinstance(batch, MaskedBatch)
    stream = tokens[:2 * SEQ + 1].astype(np.int64)
    scored = mask[:2 * SEQ + 1]
    assert batch.inputs.tolist() == [stream[:SEQ].tolist(), stream[SEQ:2 * SEQ].tolist()]
    want = [[int(t) if s else IGNORE_INDEX for t, s in zip(stream[k * SEQ + 1:(k + 1) * SEQ + 1],
                                                          scored[k * SEQ + 1:(k + 1) * SEQ + 1])]
            for k in range(2)]
    assert batch.targets.tolist() == want
    # Unmasked data keeps its plain [B, seq_len + 1] tensors.
    plain = build_train_val([root / "c"], seq_len=SEQ).train
    assert not plain.has_loss_mask
    assert isinstance(plain[0], np.ndarray) and plain[0].dtype == np.int64


def scored_rows(dataset, world_size: int, batch: int, steps: int) -> list[list[tuple]]:
    """Per global step, the sorted (inputs, targets) rows every rank's loader hands out."""
    loaders = [iter(StatefulLoader(dataset, GlobalSampler(len(dataset), world_size, rank, seed=5,
                                                          num_epochs=1), batch))
               for rank in range(world_size)]
    out = []
    for _ in range(steps):
        rows = []
        for loader in loaders:
            got = next(loader)
            rows += [(tuple(i), tuple(t)) for i, t in zip(got.inputs.tolist(),
                                                         got.targets.tolist())]
        out.append(sorted(rows))
    return out


def test_blend_and_resharded_sampler_see_the_same_scored_tokens(corpus):
    root = corpus["root"]
    data = build_train_val([root / "a", root / "b", root / "c"], weights=[2, 1, 1], seq_len=SEQ)
    blend = data.train
    assert isinstance(blend, BlendedDataset) and blend.has_loss_mask
    steps = len(blend) // 4
    one, two = scored_rows(blend, 1, 4, steps), scored_rows(blend, 2, 2, steps)
    assert one == two
    # Independently: the scored targets of the epoch, from the raw files and the blend's order.
    masks = {name: (raw_mask(root / name) if name != "c" else
                    np.ones(IndexedDataset(root / "c").num_tokens, dtype=np.uint8))
             for name in "abc"}
    expected = 0
    used = steps * 4
    for owner, local in zip(blend.dataset_index[:used], blend.dataset_sample_index[:used]):
        name = "abc"[owner]
        start = int(local) * SEQ
        expected += int(masks[name][start + 1:start + SEQ + 1].sum())
    got = sum(t != IGNORE_INDEX for step in one for _, targets in step for t in targets)
    assert got == expected > 0
    # The unmasked dataset's samples are scored throughout inside the masked blend.
    c_sample = next(i for i in range(len(blend)) if blend.dataset_index[i] == 2)
    assert blend[c_sample].mask.tolist() == [1] * (SEQ + 1)


def test_document_aligned_samples_start_at_documents_and_mask_past_the_end(corpus):
    root, processor = corpus["root"], corpus["spm"]
    docs = corpus["docs"]["a"]
    seq = 24
    data = build_train_val([root / "a"], seq_len=seq, align="document")
    dataset = data.train
    expected = []  # (tokens, scored targets) of every sample, computed from the JSONL
    longer = 0
    for segments in docs:
        ids, mask = expected_document(processor, segments)
        if len(ids) > seq + 1:  # no continuation sample without its start: left out
            longer += 1
            continue
        if len(ids) < 2:
            continue
        pad = seq + 1 - len(ids)
        targets = [t if m else IGNORE_INDEX for t, m in zip(ids[1:], mask[1:])] \
            + [IGNORE_INDEX] * pad
        expected.append((ids + [0] * pad, targets))
    assert len(dataset) == len(expected)
    assert dataset.dropped == longer > 0
    sampler = GlobalSampler(len(dataset), shuffle=False, num_epochs=1)
    rows = []
    for batch in StatefulLoader(dataset, sampler, 8):
        rows += [(list(i), list(t)) for i, t in zip(batch.inputs.tolist(),
                                                    batch.targets.tolist())]
    assert rows == [(tokens[:-1], targets) for tokens, targets in expected]
    # Without a mask file only the padding is masked.
    plain = build_train_val([root / "c"], seq_len=seq, align="document").train
    sample = plain[0]
    length = len(IndexedDataset(root / "c")[0])
    assert sample.mask.tolist() == [1] * min(length, seq + 1) + [0] * max(0, seq + 1 - length)
    assert plain.fingerprint != build_train_val([root / "c"], seq_len=seq).train.fingerprint
    with pytest.raises(DataError, match="align 'lines': must be one of packed, block, document"):
        build_train_val([root / "c"], seq_len=seq, align="lines")


def test_undecodable_segments_follow_the_bad_utf8_policy(corpus, tmp_path, capsys):
    """A lone surrogate escape in one segment: the policy applies to the whole document."""
    source = tmp_path / "surrogate.jsonl"
    source.write_text('{"segments": [{"text": "ok ", "loss": false}, '
                      '{"text": "bad \\ud800 x", "loss": true}]}\n'
                      '{"segments": [{"text": "fine", "loss": true}]}\n')
    flags = ["--segments-key", "segments", "--on-bad-utf8"]
    processor = corpus["spm"]
    assert tokenize(corpus["model"], [source], tmp_path / "replace", *flags, "replace") == 0
    replaced = IndexedDataset(tmp_path / "replace")
    # One U+FFFD per byte of the surrogate's 3-byte encoding, as in plain-text documents.
    ids, mask = expected_document(processor, [("ok ", False), ("bad \ufffd\ufffd\ufffd x", True)])
    assert (replaced[0].tolist(), replaced.loss_mask(0).tolist()) == (ids, mask)
    assert replaced.sidecar["report"]["first_undecodable_document"] == f"{source}:1"
    assert tokenize(corpus["model"], [source], tmp_path / "skip", *flags, "skip") == 0
    assert IndexedDataset(tmp_path / "skip").num_documents == 1
    capsys.readouterr()
    assert tokenize(corpus["model"], [source], tmp_path / "error", *flags, "error") == 2
    assert f"error: {source}:1: invalid UTF-8" in capsys.readouterr().err
