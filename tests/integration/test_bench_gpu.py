"""The GPU timing script (megabeta/bench/gpu.py) on CPU: its quick run writes a complete report,
measures both arms at their memory-model micro-batches, judges its targets and says what did not
run (the device's exactness checks are tests: `pytest -m gpu tests`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from megabeta.bench import gpu
from megabeta.model import ExecutionConfig

pytest.importorskip("triton", reason="triton is not installed: the triton probes cannot run")


def test_quick_cpu_run_reports_every_section_and_its_targets(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OUT", raising=False)
    gpu.main(["--device", "cpu", "--quick", "--out", str(tmp_path), "--modes", "graphed,eager",
              "--max-batch", "2"])
    data = json.loads((tmp_path / "gpu.json").read_text())
    markdown = (tmp_path / "gpu.md").read_text()
    assert list(data["sections"]) == list(gpu.SECTIONS)
    for n, section in enumerate(data["sections"].values(), 1):
        assert f"## {n}. {section['title']}" in markdown
        assert section["rows"], section["title"]
        assert all(item["why"] for item in section["not_run"])
    assert data["summary"]["errors"] == 0, [s["errors"] for s in data["sections"].values()]
    versions = {row["item"]: row["value"] for row in data["sections"]["versions"]["rows"]}
    assert versions["torch"] == torch.__version__
    assert any(item.startswith("execution.attention = triton") for item in versions)
    not_run = {item["what"]: item["why"] for item in data["sections"]["speed"]["not_run"]}
    assert "CUDA" in not_run["beta_1.2 t19_flash 64 tokens batch 1 graphed"]
    speed = [r for r in data["sections"]["speed"]["rows"] if "profiled" not in r["mode"]]
    # Micro-batch 1 and the memory model's largest (capped by --max-batch) for both arms, and
    # the long length for beta.
    seen = {(r["arm"].split()[0], r["tokens"], r["batch"]) for r in speed}
    assert {("standard", 64, 1), ("beta_1.2", 64, 1), ("beta_1.2", 128, 2),
            ("standard", 64, 2), ("beta_1.2", 64, 2)} <= seen
    assert all(r["s_per_step"] > 0 and {"tokens_per_s", "MFU", "peak_GiB"} <= set(r)
               for r in speed)
    profiled = [r for r in data["sections"]["speed"]["rows"] if r["mode"] == "eager (profiled)"]
    assert len(profiled) == 1 and profiled[0]["wall_s"] > 0 and profiled[0]["top_ops"]
    targets = {r["target"]: r for r in data["sections"]["targets"]["rows"]}
    assert len(targets) == 3
    graphed = next(r for name, r in targets.items() if "graphed" in name)
    assert graphed["met"] == "not measured"
    ratio = next(r for name, r in targets.items() if "tokens/s" in name)
    assert isinstance(ratio["got"], float) and ratio["met"] in (True, False)


@pytest.mark.parametrize("argv, named", [(["--sections", "checks,speed"], "pytest -m gpu tests"),
                                         (["--modes", "eager,fast"], "--modes"),
                                         (["--lengths", "128,64"], "--lengths"),
                                         (["--max-batch", "0"], "--max-batch")])
def test_bad_options_are_refused_by_name(argv: list[str], named: str, capsys) -> None:
    with pytest.raises(SystemExit):
        gpu.parse_args(argv)
    assert named in capsys.readouterr().err


def test_a_failing_section_is_recorded_and_the_rest_still_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(run: gpu.Run) -> None:
        raise RuntimeError("versions exploded")

    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setitem(gpu.SECTION_FUNCTIONS, "versions", broken)
    monkeypatch.setitem(gpu.SECTION_FUNCTIONS, "targets",
                        lambda run: run.report.note("targets", "targets ran"))
    report = gpu.main(["--device", "cpu", "--quick", "--out", str(tmp_path),
                       "--sections", "versions,targets"])
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert data["sections"]["versions"]["errors"][0]["error"] == \
        "RuntimeError: versions exploded"
    assert data["sections"]["targets"]["notes"] == ["targets ran"]
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
    times = [float(op.group(2)) for op in ops]
    assert times == sorted(times, reverse=True) and all(int(op.group(3)) > 0 for op in ops)
