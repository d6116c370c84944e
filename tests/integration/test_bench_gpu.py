"""The GPU device check (megabeta/bench/gpu.py) on CPU: its quick run writes a complete report,
and its verdicts fail on deliberately wrong kernels (so its tolerances can fail).

The Triton kernels run under Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET);
shapes are the script's --quick ones."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from megabeta.bench import gpu
from megabeta.model import ExecutionConfig
from megabeta.model.attention.backend import AttentionBias, KeySet
from megabeta.model.attention.explicit import ExplicitAttention

pytest.importorskip("triton", reason="triton is not installed: the kernel checks cannot run")


def _run(tmp_path: Path, *argv: str) -> gpu.Run:
    args = gpu.parse_args(["--device", "cpu", "--quick", "--out", str(tmp_path), *argv])
    return gpu.Run(args, torch.device("cpu"), gpu.Report(tmp_path, {}), gpu.Budget(600))


def test_quick_cpu_run_reports_every_section_and_says_what_did_not_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OUT", raising=False)
    # Section 3 (model checks of the Triton backend under the interpreter: minutes) is tested
    # on its own below.
    gpu.main(["--device", "cpu", "--quick", "--out", str(tmp_path), "--modes",
              "eager,graphed,wavefront", "--speed-lengths", "64", "--max-batch", "2",
              "--sections", "versions,kernels,wavefront,speed,article"])
    data = json.loads((tmp_path / "gpu.json").read_text())
    markdown = (tmp_path / "gpu.md").read_text()
    assert list(data["sections"]) == list(gpu.SECTIONS)
    for n, section in enumerate(data["sections"].values(), 1):
        assert f"## {n}. {section['title']}" in markdown
        assert section["rows"] or section["not_run"], section["title"]
        assert all(item["why"] for item in section["not_run"])
    assert data["summary"]["errors"] == 0, [s["errors"] for s in data["sections"].values()]
    assert data["summary"]["failed"] == 0
    versions = {row["item"]: row["value"] for row in data["sections"]["versions"]["rows"]}
    assert versions["torch"] == torch.__version__
    assert any(item.startswith("execution.attention = triton") for item in versions)
    kernels = data["sections"]["kernels"]
    assert {r["check"] for r in kernels["rows"]} >= {"block_attention"}
    not_run = {item["what"]: item["why"] for s in data["sections"].values()
               for item in s["not_run"]}
    assert "interpreter" in not_run["block_attention bf16"]
    assert "CUDA" in not_run["mode graphed (execution.cuda_graphs = true)"]
    assert "not in --modes" in not_run["mode compiled"]
    assert not_run["the whole section"] == "not in --sections"  # exactness
    for item in not_run:
        assert item in markdown
    # The speed rows carry the figures the brief asks for, beta next to the standard arm.
    speed = data["sections"]["speed"]["rows"]
    beta = [r for r in speed if r["arm"].startswith("beta") and "profiled" not in r["mode"]]
    assert beta and all(r["s_per_step"] > 0 and "time_vs_standard" in r for r in beta)
    profiled = [r for r in speed if r["mode"] == "eager (profiled)"]
    assert len(profiled) == 1 and profiled[0]["wall_s"] > 0 and profiled[0]["top_ops"]
    assert [r["time_vs_block"] > 0 for r in beta if r["mode"] == "wavefront"] == [True, True]
    # The wavefront section: the paired arms, and the dispatch counts (deterministic) of the
    # batched shape within the 0.35x of the block schedule's.
    wave = {r["figure"]: r for r in data["sections"]["wavefront"]["rows"]}
    assert {"standard s/step", "block s/step", "wavefront s/step"} <= set(wave)
    assert wave["dispatches per step, beta_1.2_test"]["wavefront_vs_block"] <= 0.35
    assert all({"tokens_per_s", "MFU", "peak_GiB"} <= set(r) for r in speed if r not in profiled)
    article = {r["arm"]: r for r in data["sections"]["article"]["rows"]}
    assert set(article) == set(gpu.ARTICLE_S_PER_BATCH)
    assert article["beta_1.2_test"]["article_s_per_batch"] == 0.876


def test_model_exactness_checks_pass_on_a_cpu_backend_and_fail_a_wrong_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Section 3's three checks on a backend that runs fast on CPU; then the same with the
    self bias of every layer zeroed in what the backend sees, which must fail the
    comparison with the explicit reference."""
    from megabeta.model.attention.merged import CpuMergedAttention

    run = _run(tmp_path)
    fields, length, prompt = gpu._exact_shape(quick=True)
    gpu.check_one_block(run, "cpu_flash", "fp32", fields, length=length, case="mha")
    gpu.check_decoding(run, "cpu_flash", "fp32", fields, length=length, prompt=prompt,
                       case="mha")
    gpu.check_against_explicit(run, "cpu_flash", "fp32", fields, length=length, case="mha")
    rows = run.report.sections["exactness"]["rows"]
    assert [r["verdict"] for r in rows] == ["pass"] * 4  # logits/loss and gradients: two rows
    assert all("runs cpu_flash" in r["case"] for r in rows)

    original = CpuMergedAttention.attend
    monkeypatch.setattr(CpuMergedAttention, "attend", lambda self, q, keys, bias, **kw: original(
        self, q, keys, AttentionBias(bias.slope, torch.zeros_like(bias.self_bias),
                                     bias.group_shift), **kw))
    gpu.check_against_explicit(run, "cpu_flash", "fp32", fields, length=length, case="mha")
    assert [r["verdict"] for r in rows[4:]] == ["FAIL", "FAIL"]


def _drop_self_bias(monkeypatch: pytest.MonkeyPatch) -> None:
    from megabeta.kernels import triton_attention

    original = triton_attention.block_attention

    def without_self_bias(q, k, v, hist_k, hist_v, grad_k, grad_v, start, shift, self_bias,
                          **kwargs):
        return original(q, k, v, hist_k, hist_v, grad_k, grad_v, start, shift, None, **kwargs)

    monkeypatch.setattr(triton_attention, "block_attention", without_self_bias)


def test_block_attention_check_fails_a_kernel_that_drops_the_self_bias(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    case = gpu.attention_cases(quick=True)[0]
    run = _run(tmp_path)
    gpu.check_block_attention(run, case, ["fp32"])
    _drop_self_bias(monkeypatch)
    gpu.check_block_attention(run, case, ["fp32"])
    right, wrong = run.report.sections["kernels"]["rows"]
    assert right["verdict"] == "pass"
    assert wrong["verdict"] == "FAIL"
    assert wrong["errors"]["out"] > 1e-2  # a visible error, not a rounding one
    assert math.isinf(wrong["errors"]["d_self_bias"])  # no gradient at all
    run.report.write()
    assert "**FAILED**" in (tmp_path / "gpu.md").read_text()


def test_cell_kernel_check_fails_a_wrong_swiglu(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from megabeta.kernels import triton_elementwise

    monkeypatch.setattr(triton_elementwise, "swiglu", lambda gate_up: torch.nn.functional.gelu(
        gate_up.chunk(2, dim=-1)[0]) * gate_up.chunk(2, dim=-1)[1])
    run = _run(tmp_path)
    gpu.check_elementwise_kernels(run, ["fp32"])
    verdicts = {r["check"]: r["verdict"] for r in run.report.sections["kernels"]["rows"]}
    assert verdicts == {"rms_normalize": "pass", "add_rms_normalize": "pass",
                        "split_heads_rope": "pass", "swiglu": "FAIL"}


def test_attention_reference_is_the_models_explicit_attention() -> None:
    """The script's float64 reference (group shifts as a general [G, H] table) equals the
    model's explicit backend fed the same groups as pieces, with shift = λ_h·(m - l)."""
    case = gpu.AttentionCase("gqa+window", 2, 4, 2, 8, 5, 4, 30, 20, (1, 2, 3), 1, 7)
    inputs = gpu.attention_inputs(case)
    slope = torch.rand(case.heads, dtype=torch.float64) + 0.5
    offsets = torch.tensor([m - case.layer for m in case.sources], dtype=torch.float64)
    shift = offsets[:, None] * slope
    got = gpu.reference_block_attention(inputs["q"], inputs["k"], inputs["v"], inputs["hist_k"],
                                        inputs["hist_v"], shift, inputs["self_bias"], case)
    rows = [slice(case.lo(m), case.start) for m in case.sources]
    keys = KeySet(k=inputs["k"], v=inputs["v"], finished=[
        (m - case.layer, inputs["hist_k"][m, :, :, r], inputs["hist_v"][m, :, :, r])
        for m, r in zip(case.sources, rows)])
    want = ExplicitAttention(case.head_dim).attend(
        inputs["q"], keys, AttentionBias(slope, inputs["self_bias"]), layer=case.layer,
        dropout_p=0.0)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert rows[0] == slice(0, 20) and rows[1] == slice(13, 20)  # the window cuts deeper groups


def test_verdict_and_error_measure() -> None:
    nan = torch.tensor([1.0, float("nan")])
    assert math.isnan(gpu.rel_err(nan, torch.ones(2)))
    assert gpu.verdict({"out": gpu.rel_err(nan, torch.ones(2))}, 1.0) == "FAIL"
    assert gpu.rel_err(torch.zeros(3), torch.zeros(2)) == math.inf
    assert gpu.rel_err(torch.full((2,), 1e-9), torch.zeros(2)) == math.inf
    assert gpu.rel_err(torch.full((2,), 1e-9), torch.zeros(2), floor=1e-3) == pytest.approx(1e-6)
    assert gpu.verdict({"a": 1e-5, "b": 2e-4}, 1e-4) == "FAIL"
    assert gpu.verdict({"a": 1e-5}, 1e-4) == "pass"


def test_a_failing_section_is_recorded_and_the_rest_still_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(run: gpu.Run) -> None:
        raise RuntimeError("kernel exploded")

    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setitem(gpu.SECTION_FUNCTIONS, "kernels", broken)
    monkeypatch.setitem(gpu.SECTION_FUNCTIONS, "exactness",
                        lambda run: run.report.note("exactness", "exactness ran"))
    report = gpu.main(["--device", "cpu", "--quick", "--out", str(tmp_path),
                       "--sections", "kernels,exactness"])
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert data["sections"]["kernels"]["errors"][0]["error"] == "RuntimeError: kernel exploded"
    assert data["sections"]["exactness"]["notes"] == ["exactness ran"]
    assert report.summary()["errors"] == 1
    assert data["sections"]["speed"]["not_run"] == [dict(what="the whole section",
                                                         why="not in --sections")]


def test_static_step_check_compares_with_eager_and_counts_graphs(tmp_path: Path) -> None:
    """The device check's compiled-step row, on cpu_fused (the CPU's static backend): equal
    to the eager loop, one compiled graph."""
    run = _run(tmp_path)
    fields, length, _ = gpu._exact_shape(quick=True)
    gpu.check_static_step(run, "cpu_fused", "fp32", fields, length=length, case="mha",
                          mode="compiled")
    row, = run.report.sections["exactness"]["rows"]
    assert row["verdict"] == "pass", row
    assert row["case"].endswith("compiled graphs: 1")


def test_wavefront_check_compares_with_the_block_schedule(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The device check's wavefront row passes on cpu_flash, and fails when the wavefront's
    attention loses the self bias (the block schedule's does not)."""
    from megabeta.model import wavefront

    run = _run(tmp_path)
    fields, length, _ = gpu._exact_shape(quick=True)
    gpu.check_wavefront(run, "cpu_flash", "fp32", fields, length=length, case="mha")
    rows = run.report.sections["exactness"]["rows"]
    assert rows[0]["verdict"] == "pass", rows[0]
    cell_weights = wavefront.WaveWeights.__init__

    def zero_self_bias(self, model, cell):
        cell_weights(self, model, cell)
        biases = cell.pass_biases
        biases.self_bias = torch.zeros_like(biases.self_bias)

    monkeypatch.setattr(wavefront.WaveWeights, "__init__", zero_self_bias)
    gpu.check_wavefront(run, "cpu_flash", "fp32", fields, length=length, case="mha")
    assert rows[1]["verdict"] == "FAIL", rows[1]


def test_profile_step_says_where_a_step_goes() -> None:
    """The speed section's profile row: one step's wall time and its busiest operators (on a
    GPU also the kernel time's share of it, which tells a waiting device from a busy one)."""
    config = gpu._tiny_config()
    model = gpu._build(config, torch.device("cpu"), ExecutionConfig(activation_checkpoint="block"))
    row = gpu.profile_step(model, torch.randint(0, config.vocab_size, (2, 17)), top=3)
    assert row["wall_s"] > 0 and row["device_busy"] is None and row["kernel_launches"] == 0
    ops = row["top_ops"].split("; ")
    assert len(ops) == 3 and any(op.startswith("aten::mm") for op in ops), ops
