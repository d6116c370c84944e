"""The roofline's counts (megabeta/bench/roofline.py) against literal walks of the Triton
kernels' programs, flops.py, and the directions its knobs must move; the command's output and
errors."""

from __future__ import annotations

import pytest
import torch

from megabeta.bench import roofline
from megabeta.bench.roofline import DEVICES, step_bound
from megabeta.kernels.triton_attention import cuda_tiles, splits
from megabeta.model import ExecutionConfig, ModelConfig, get_preset
from megabeta.model.flops import dense_flops, training_flops

T, BATCH = 400, 2
BLOCK = ExecutionConfig(activation_checkpoint="block")
H200 = DEVICES["h200"]


def tiny(**overrides) -> ModelConfig:
    """Two query tiles a block forward, three backward, a ragged last block (400 = 4·96 + 16),
    GQA and a deep-token window: every mask of the kernels' loops matters."""
    fields = dict(d_model=64, hidden_dim=96, num_heads=4, num_kv_heads=2, num_layers=3,
                  block_size=96, depth_window=2, deep_token_window=100, max_seq_len=T,
                  vocab_size=50)
    return ModelConfig(**{**fields, **overrides})


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def walk(config: ModelConfig, length: int, batch: int) -> tuple[dict[str, int], dict[str, int]]:
    """(HBM bytes, FLOPs) of the attention kernels on the block schedule, program by program
    and tile by tile: each loaded or stored row counted where its mask lets it through (no L2
    reuse), each tile product at its full padded size, the history split across programs as
    the kernels split it (`splits`, an H200's SMs)."""
    hd, heads, kv = config.head_dim, config.num_heads, config.num_kv_heads
    width = max(16, 1 << (hd - 1).bit_length())
    fwd = cuda_tiles(width, torch.bfloat16, backward=False)
    bwd = cuda_tiles(width, torch.bfloat16, backward=True)
    hist_m, hist_n = 16, bwd.block_n
    fwd_tile = 4 * fwd.block_m * fwd.block_n * width          # q·kᵀ and p·v
    key_tile, query_tile = (k * bwd.block_m * bwd.block_n * width for k in (8, 6))
    hist_tile = 8 * hist_m * hist_n * width
    row, stat, q_side = 2 * hd, 4, 3 * 2 * hd + 4
    reader = 2 * row + 2 * stat                                # q, dO, one lse, delta
    c, w, L = config.block_size, config.deep_token_window, config.num_layers
    nbytes = dict.fromkeys(("in-block", "finished fwd", "finished bwd"), 0)
    flops = dict(nbytes)
    sms = H200.sms

    def rows(lo: int, hi: int, tile: int, limit: int, step: int = 0) -> int:
        """Rows loaded by tiles of `tile` rows starting at lo, lo + step, … < hi (step: the
        tile), masked at `limit`."""
        return sum(1 for j0 in range(lo, hi, step or tile) for j in range(j0, j0 + tile)
                   if j < limit)

    def tiles(lo: int, hi: int, tile: int) -> int:
        return len(range(lo, hi, tile))

    def lows(layer: int, start: int) -> list[tuple[int, int]]:
        return [(m, max(0, start - w) if w > 0 and m > layer else 0)
                for m in config.source_layers(layer)]

    starts = list(range(0, length, c))
    for start in starts:
        n = min(c, length - start)
        for layer in range(L):
            groups = [lo for _, lo in lows(layer, start)]
            for _ in range(batch):
                f_tiles = cdiv(n, fwd.block_m)
                split = splits(f_tiles * batch * heads, sum(tiles(lo, start, fwd.block_n)
                                                    for lo in groups), sms)
                for h in range(heads):  # forward programs
                    for pid in range(f_tiles):
                        q_rows = rows(pid * fwd.block_m, pid * fwd.block_m + 1, fwd.block_m, n)
                        nbytes["in-block"] += q_rows * (2 * row + stat)
                        own_end = min(n, (pid + 1) * fwd.block_m)
                        nbytes["in-block"] += rows(0, own_end, fwd.block_n, n) * 2 * row
                        flops["in-block"] += tiles(0, own_end, fwd.block_n) * fwd_tile
                        for s in range(split):
                            for lo in groups:
                                lo_s = lo + s * fwd.block_n
                                nbytes["finished fwd"] += rows(lo_s, start, fwd.block_n, start,
                                                               split * fwd.block_n) * 2 * row
                                flops["finished fwd"] += tiles(lo_s, start,
                                                               split * fwd.block_n) * fwd_tile
                            if split > 1:   # partial out, max, sum written; merged: read
                                nbytes["finished fwd"] += 2 * q_rows * (4 * hd + 2 * stat)
                for _ in range(kv):  # backward programs of the own keys
                    for task in range(cdiv(n, bwd.block_n)):
                        k_rows = rows(task * bwd.block_n, task * bwd.block_n + 1, bwd.block_n, n)
                        nbytes["in-block"] += k_rows * 4 * row  # K, V read; dK, dV written
                        for _ in range(heads // kv):
                            first = task * bwd.block_n // bwd.block_m * bwd.block_m
                            nbytes["in-block"] += rows(first, n, bwd.block_m, n) * q_side
                            flops["in-block"] += tiles(first, n, bwd.block_m) * key_tile
                b_tiles = cdiv(n, bwd.block_m)
                split = splits(b_tiles * batch * heads, sum(tiles(lo, start, bwd.block_n)
                                                    for lo in groups), sms)
                for h in range(heads):  # backward query programs
                    for pid in range(b_tiles):
                        m0 = pid * bwd.block_m
                        q_rows = rows(m0, m0 + 1, bwd.block_m, n)
                        nbytes["in-block"] += q_rows * (q_side + row + stat * config.self_slot)
                        own_end = min(n, m0 + bwd.block_m)
                        nbytes["in-block"] += rows(0, own_end, bwd.block_n, n) * 2 * row
                        flops["in-block"] += tiles(0, own_end, bwd.block_n) * query_tile
                        # per group its row sums; the reader row: q, dO, each lse, delta
                        nbytes["finished bwd"] += q_rows * (stat * len(groups) + 2 * row
                                                            + stat * (len(groups) + 1))
                        for s in range(split):
                            for lo in groups:
                                lo_s = lo + s * bwd.block_n
                                nbytes["finished bwd"] += rows(lo_s, start, bwd.block_n, start,
                                                               split * bwd.block_n) * 2 * row
                                flops["finished bwd"] += tiles(lo_s, start,
                                                               split * bwd.block_n) * query_tile
                            if split > 1:   # partial dQ and sums written; reduced: read
                                nbytes["finished bwd"] += 2 * q_rows * 4 * (hd + len(groups) + 1)
    # The history's gradients: a program per (source block, source layer, kv head, key tile).
    for src in starts[:-1]:
        n_src = min(c, length - src)
        key_tiles = cdiv(n_src, hist_n)
        split = splits(L * batch * kv * key_tiles, cdiv(length, hist_m), sms)
        for m in range(L):
            for _ in range(batch * kv):
                for t in range(key_tiles):
                    t0 = src + t * hist_n
                    k_rows = rows(t0, t0 + 1, hist_n, src + n_src)
                    nbytes["finished bwd"] += k_rows * 4 * row   # K, V read; dK, dV written
                    if split > 1:
                        nbytes["finished bwd"] += 2 * split * k_rows * 2 * hd * 4
                    for start in starts:
                        if start <= src:
                            continue
                        n = min(c, length - start)
                        for layer in range(L):
                            for source, lo in lows(layer, start):
                                if source == m and t0 + hist_n > lo:
                                    nbytes["finished bwd"] += heads // kv * n * reader
                                    flops["finished bwd"] += heads // kv * cdiv(n, hist_m) \
                                        * hist_tile
    return nbytes, flops


def test_attention_bytes_and_flops_equal_a_walk_of_the_kernels_programs() -> None:
    config = tiny()
    bound = step_bound(config, ExecutionConfig(activation_checkpoint="none"), T, BATCH, H200)
    nbytes, flops = walk(config, T, BATCH)
    for part, name in (("finished fwd", "finished fwd"), ("finished bwd", "finished bwd"),
                       ("in-block attn", "in-block")):
        assert bound.part(part).bytes == nbytes[name], part
        assert bound.part(part).flops == flops[name], part


def test_recompute_is_the_forward_again_and_only_with_checkpointing() -> None:
    config = tiny()
    none = step_bound(config, ExecutionConfig(activation_checkpoint="none"), T, BATCH, H200)
    block = step_bound(config, BLOCK, T, BATCH, H200)
    assert none.part("recompute").bytes == none.part("recompute").flops == 0
    assert [p for p in none.parts if p.name != "recompute"] == \
        [p for p in block.parts if p.name != "recompute"]
    recompute = block.part("recompute")
    # At least the finished groups' forward again, less than the whole forward + backward.
    assert block.part("finished fwd").bytes < recompute.bytes < block.part("dense").bytes \
        + block.part("finished fwd").bytes + block.part("in-block attn").bytes
    assert recompute.useful == 0


def test_dense_matmuls_are_flops_py_s_and_useful_flops_add_up() -> None:
    config = tiny()
    blocks = list(range(0, T, config.block_size))
    mine = sum(2 * BATCH * min(config.block_size, T - s) * d_in * d_out
               for s in blocks for layer in range(config.num_layers)
               for d_in, d_out in roofline.matmul_shapes(config, layer, s < blocks[-1]))
    head = 2 * config.d_model * config.vocab_size * T
    assert mine == BATCH * (dense_flops(config, T) - head)
    bound = step_bound(config, BLOCK, T, BATCH, H200)
    assert sum(p.useful for p in bound.parts) == bound.useful_flops \
        == BATCH * training_flops(config, T)
    # The kernels compute whole tiles and recompute scores in both backward programs.
    for name in ("in-block attn", "finished fwd", "finished bwd"):
        assert bound.part(name).flops >= bound.part(name).useful


def test_more_kv_sharing_never_adds_bytes_and_forward_gqa_saves_none() -> None:
    bounds = [step_bound(tiny(num_kv_heads=kv), BLOCK, T, BATCH, H200) for kv in (4, 2, 1)]
    for wide, narrow in zip(bounds, bounds[1:]):
        assert narrow.bytes < wide.bytes
        for a, b in zip(wide.parts, narrow.parts):
            assert b.bytes <= a.bytes, a.name
        # Every query head's forward program reads its kv head's rows itself.
        assert narrow.part("finished fwd").bytes == wide.part("finished fwd").bytes
        cached = [step_bound(tiny(num_kv_heads=kv), BLOCK, T, BATCH, H200, l2_reuse=True)
                  for kv in (4, 2)]
        assert cached[1].part("finished fwd").bytes < cached[0].part("finished fwd").bytes


def test_deep_token_window_and_l2_reuse_reduce_bytes() -> None:
    full = step_bound(tiny(deep_token_window=0), BLOCK, T, BATCH, H200)
    for window in (20, 100):
        windowed = step_bound(tiny(deep_token_window=window), BLOCK, T, BATCH, H200)
        assert windowed.part("finished fwd").bytes < full.part("finished fwd").bytes
        assert windowed.part("finished bwd").bytes < full.part("finished bwd").bytes
    cached = step_bound(tiny(deep_token_window=0), BLOCK, T, BATCH, H200, l2_reuse=True)
    assert cached.bytes < full.bytes
    assert cached.part("dense").bytes == full.part("dense").bytes


def test_larger_blocks_raise_the_mfu_ceiling_of_t19_flash() -> None:
    """t19_flash at 4K tokens (16K is the command's default; the direction is the same)."""
    ceilings = [step_bound(get_preset("t19_flash", block_size=c), BLOCK, 4096, 1, H200,
                           vocab_size=55000).mfu_ceiling for c in (32, 256)]
    assert 0 < ceilings[0] < ceilings[1] < 1


def test_the_bound_is_the_sum_of_the_parts_roofs() -> None:
    bound = step_bound(tiny(), BLOCK, T, BATCH, DEVICES["a100"])
    for part in bound.parts:
        assert part.seconds == max(part.flops / 312e12, part.bytes / 2.039e12)
    assert bound.seconds == pytest.approx(sum(p.seconds for p in bound.parts))
    assert bound.overlapped_s <= bound.seconds * (1 + 1e-12)
    assert bound.mfu_ceiling == pytest.approx(bound.useful_flops / 312e12 / bound.seconds)


def test_device_names_and_refusals() -> None:
    assert roofline.device_for("NVIDIA H200") is DEVICES["h200"]
    assert roofline.device_for("NVIDIA A100-SXM4-80GB") is DEVICES["a100"]
    assert roofline.device_for("NVIDIA L4") is None
    with pytest.raises(ValueError, match="vocab"):
        step_bound(get_preset("t19_flash"), BLOCK, 64, 1, H200)
    with pytest.raises(ValueError, match="arch"):
        step_bound(tiny(arch="standard"), BLOCK, 64, 1, H200)


def test_command_prints_the_parts_the_bound_and_the_sweeps(capsys) -> None:
    roofline.main(["--preset", "beta_1.2_test", "--seq-len", "256", "--device", "h100"])
    out = capsys.readouterr().out
    for name in roofline.PART_NAMES:
        assert f"\n{name} " in out
    assert "bound: " in out and "s/step" in out and "MFU ceiling: " in out
    assert "H100" in out
    for knob in ("block_size c", "num_kv_heads", "deep_token_window", "micro-batch"):
        assert f"sweep {knob}" in out
    assert "launch term: " in out and "eager" in out and "graphed" in out
    assert "memory (model/memory.py): " in out and "largest micro-batch" in out


def test_command_reads_a_training_config_and_its_overrides(capsys) -> None:
    roofline.main(["--config", "t19_flash", "--seq-len", "512", "--no-sweeps"])
    out = capsys.readouterr().out
    assert "activation_checkpoint = block" in out and "vocab 55000" in out and "c = 32" in out
    assert "sweep" not in out
    roofline.main(["--seq-len", "512", "--no-sweeps", "--model.block_size=256",
                   "--execution.schedule=wavefront", "--execution.activation_checkpoint=wave"])
    out = capsys.readouterr().out
    assert "c = 256" in out and "activation_checkpoint = wave" in out


@pytest.mark.parametrize("argv, named", [(["--device", "v100"], "argument --device"),
                                         (["--preset", "nope"], "argument --preset"),
                                         (["--config", "/nonexistent.toml"], "--config PATH"),
                                         (["--preset", "t16_std_tf_rope"], "argument --preset"),
                                         (["--batch", "0"], "argument --batch"),
                                         (["--model.bogus=1"], "model.bogus"),
                                         (["--data.path=x"], "--data.path=x")])
def test_bad_input_is_an_error_naming_the_flag(argv: list[str], named: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        roofline.main(argv)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("gpu, has_column", [("NVIDIA H200", True), ("NVIDIA L4", False)])
def test_bench_gpu_speed_rows_carry_the_share_of_the_bound(gpu: str, has_column: bool,
                                                           monkeypatch) -> None:
    from megabeta.bench import gpu as bench_gpu

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
    run = bench_gpu.Run(args=None, device=torch.device("cuda"), report=None, budget=None)
    config = get_preset("t19_flash", vocab_size=512, max_seq_len=256)
    timing = bench_gpu.Timing(seconds=2.0, first_s=3.0, peak_gib=1.0, static_gib=0.5,
                              backend="triton", captures=0, timed_steps=3)
    row = bench_gpu._speed_row(run, "beta", config, 1, 256, "eager", timing, 989e12)
    if has_column:
        want = step_bound(config, BLOCK, 256, 1, H200).seconds / 2.0
        assert row["of_bound"] == pytest.approx(want)
    else:
        assert "of_bound" not in row
    standard = bench_gpu._speed_row(run, "standard", config.replace(arch="standard"), 1, 256,
                                    "eager", timing, 989e12)
    assert "of_bound" not in standard


def test_document_mask_saving_on_a_hand_example(tmp_path) -> None:
    """Spec §7 in the roofline: the history tiles wholly below a bound are skipped. One layer,
    k = 0 (one group, rows [0, start)), c = 2, every tile 2 rows, d_h 16, 2 heads (no GQA),
    documents of 3 and 3 tokens: the block at 2 (bound 0) skips nothing of its 1 tile; the
    block at 4 (bound 3) skips 1 of its 2 tiles; three kinds of loop each (forward, backward
    query programs, the history gradients' programs)."""
    assert roofline.skipped_tiles(0, 8, 5, 2) == 2
    assert roofline.skipped_tiles(3, 8, 5, 2) == 1       # tiles cut from the group's first row
    assert roofline.skipped_tiles(0, 8, 100, 4) == 2     # never more than there are
    assert roofline.skipped_tiles(8, 8, 100, 4) == 0
    starts = roofline.document_starts([3], 6)
    assert starts == [0, 0, 0, 3, 3, 3]
    assert roofline.document_starts([3, 2], 8) == [0, 0, 0, 3, 3, 5, 5, 5]
    config = ModelConfig(vocab_size=16, d_model=32, hidden_dim=48, num_heads=2, num_layers=1,
                         block_size=2, depth_window=0, max_seq_len=8)
    kernel = roofline._Kernel(2, 2, 2, 2, 16, hist_m=2)
    saving = roofline.document_saving(config, kernel, starts, recompute=False)
    assert (saving.tiles, saving.tiles_skipped) == (9, 3)
    # A skipped tile saves: forward 2 heads x 2 rows x K,V (32 B a row); a history-gradient
    # program the reader rows of the block's 2 queries (q, dO: 32 B each; lse, delta: 4 B
    # each) for 2 heads; a query program 2 heads x 2 K/V rows.
    assert saving.bytes_saved == 256 + 2 * 2 * (64 + 8) + 256
    assert saving.flops_saved == 2 * 4 * 2 * 2 * 16 + 2 * 8 * 2 * 2 * 16 + 2 * 6 * 2 * 2 * 16
    assert saving.bytes == 3 * saving.bytes_saved        # 3 tiles a kind, 1 skipped
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("5\n7\n")
    assert roofline.parse_doc_lengths(str(lengths), 3) == [5, 7]
    drawn = roofline.parse_doc_lengths("64-300", 50)
    assert len(drawn) == 50 and 64 <= min(drawn) and max(drawn) <= 300
    with pytest.raises(ValueError, match="doc-lengths"):
        roofline.parse_doc_lengths("300-64", 5)


def test_roofline_prints_the_document_saving(capsys) -> None:
    roofline.main(["--no-sweeps", "--doc-lengths", "64-300", "--seq-len", "2048"])
    assert "document mask (spec §7; documents" in capsys.readouterr().out
