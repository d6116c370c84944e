"""The GPU timing script (megabeta/bench/gpu.py) on CPU: its quick run writes a complete report
and says what did not run (the device's exactness checks are tests: `pytest -m gpu tests`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from megabeta.bench import gpu
from megabeta.model import ExecutionConfig

pytest.importorskip("triton", reason="triton is not installed: the triton probes cannot run")


def test_quick_cpu_run_reports_every_section_and_says_what_did_not_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OUT", raising=False)
    gpu.main(["--device", "cpu", "--quick", "--out", str(tmp_path), "--modes",
              "eager,graphed,wavefront", "--speed-lengths", "64", "--max-batch", "2"])
    data = json.loads((tmp_path / "gpu.json").read_text())
    markdown = (tmp_path / "gpu.md").read_text()
    assert list(data["sections"]) == list(gpu.SECTIONS)
    for n, section in enumerate(data["sections"].values(), 1):
        assert f"## {n}. {section['title']}" in markdown
        assert section["rows"] or section["not_run"], section["title"]
        assert all(item["why"] for item in section["not_run"])
    assert data["summary"]["errors"] == 0, [s["errors"] for s in data["sections"].values()]
    versions = {row["item"]: row["value"] for row in data["sections"]["versions"]["rows"]}
    assert versions["torch"] == torch.__version__
    assert any(item.startswith("execution.attention = triton") for item in versions)
    not_run = {item["what"]: item["why"] for s in data["sections"].values()
               for item in s["not_run"]}
    assert "CUDA" in not_run["mode graphed (execution.cuda_graphs = true)"]
    assert "not in --modes" in not_run["mode compiled"]
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


def test_unknown_sections_are_refused_with_the_choices(capsys) -> None:
    with pytest.raises(SystemExit):
        gpu.parse_args(["--sections", "checks,speed"])
    assert "pytest -m gpu tests" in capsys.readouterr().err


def test_a_failing_section_is_recorded_and_the_rest_still_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(run: gpu.Run) -> None:
        raise RuntimeError("checks exploded")

    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setitem(gpu.SECTION_FUNCTIONS, "versions", broken)
    monkeypatch.setitem(gpu.SECTION_FUNCTIONS, "wavefront",
                        lambda run: run.report.note("wavefront", "wavefront ran"))
    report = gpu.main(["--device", "cpu", "--quick", "--out", str(tmp_path),
                       "--sections", "versions,wavefront"])
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert data["sections"]["versions"]["errors"][0]["error"] == "RuntimeError: checks exploded"
    assert data["sections"]["wavefront"]["notes"] == ["wavefront ran"]
    assert report.summary()["errors"] == 1
    assert data["sections"]["speed"]["not_run"] == [dict(what="the whole section",
                                                         why="not in --sections")]


def test_profile_step_says_where_a_step_goes() -> None:
    """The speed section's profile row: one step's wall time and its busiest operators (on a
    GPU also the kernel time's share of it, which tells a waiting device from a busy one)."""
    config = gpu._tiny_config()
    model = gpu._build(config, torch.device("cpu"), ExecutionConfig(activation_checkpoint="block"))
    row = gpu.profile_step(model, torch.randint(0, config.vocab_size, (2, 17)), top=3)
    assert row["wall_s"] > 0 and row["device_busy"] is None and row["kernel_launches"] == 0
    ops = [re.fullmatch(r"(\S+) ([\d.]+) ms x(\d+)", op) for op in
           row["top_ops"].split("; ")]
    assert len(ops) == 3 and all(ops), row["top_ops"]
    # Busiest first (which operators those are depends on the machine's load).
    times = [float(op.group(2)) for op in ops]
    assert times == sorted(times, reverse=True) and all(int(op.group(3)) > 0 for op in ops)
