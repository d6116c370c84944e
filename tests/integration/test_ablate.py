"""Issue 16, item 3: `megabeta ablate`.

A tiny ablation (2 arms, a few batches, the real trainer) killed after its first arm and rerun:
the finished arm is not retrained (its result file untouched), the other one is, and the summary
files have the expected columns and the runs' figures (the test loss is the trainer's own final
evaluation of the same split; s/batch is the mean of the trainer's metrics). The summary's
mean ± spread is checked on synthetic results; equal-parameter arms at every scale; bad input.
"""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.train_helpers import REPO, build_dataset

from megabeta.ablate.cli import main
from megabeta.ablate.runner import prepare_task_data, read_train_metrics
from megabeta.ablate.suites import (
    SCALES,
    SUITES,
    TaskSpec,
    build_arms,
    check_equal_parameters,
    suite_arms,
)
from megabeta.ablate.summary import Spread, csv_text, markdown, summarize
from megabeta.model.config import FAIR_TOLERANCE, get_preset, preset_names


# ---- summary ------------------------------------------------------------------------------------
def _result(arm: str, seed: int, loss: float, accuracy: float | None = None,
            s_per_batch: float = 0.5) -> dict:
    tasks = {} if accuracy is None else {"parity-L8": {"accuracy": accuracy}}
    return {"arm": arm, "seed": seed, "parameters": 1000, "test": {"loss": loss,
            "ppl": math.exp(loss)}, "accuracy": accuracy, "tasks": tasks,
            "train": {"s_per_batch": s_per_batch, "tokens_per_s": 64 / s_per_batch,
                      "final_loss": loss + 0.1}}


def test_summary_mean_and_spread_over_two_seeds() -> None:
    results = [_result("beta", 1, 2.0, 0.6, 0.4), _result("std", 1, 2.5, 0.5, 0.2),
               _result("beta", 2, 2.4, 0.7, 0.6), _result("std", 2, 2.6, 0.4, 0.2)]
    rows = summarize(results, ["beta", "std"], reference="std")
    assert [r["arm"] for r in rows] == ["std", "beta"]  # the reference first
    beta = rows[1]
    assert beta["seeds"] == [1, 2]
    assert beta["test_loss"].mean == pytest.approx(2.2)
    assert beta["test_loss"].std == pytest.approx(statistics.stdev([2.0, 2.4]))  # n - 1
    assert beta["test_loss"].std == pytest.approx(0.4 / math.sqrt(2))
    assert (beta["test_loss"].min, beta["test_loss"].max) == (2.0, 2.4)
    assert beta["ppl"].mean == pytest.approx((math.exp(2.0) + math.exp(2.4)) / 2)
    # Deltas paired by seed: (2.0 - 2.5, 2.4 - 2.6) = (-0.5, -0.2).
    assert beta["delta_test_loss"].mean == pytest.approx(-0.35)
    assert beta["delta_test_loss"].std == pytest.approx(statistics.stdev([-0.5, -0.2]))
    assert beta["delta_accuracy"].mean == pytest.approx(0.2)
    assert beta["task_accuracy"]["parity-L8"].mean == pytest.approx(0.65)
    assert beta["s_per_batch"].mean == pytest.approx(0.5)
    assert rows[0]["delta_test_loss"].mean == 0.0

    table = list(csv.DictReader(csv_text(rows).splitlines()))
    assert [r["arm"] for r in table] == ["std", "beta"] and table[0]["reference"] == "1"
    assert float(table[1]["test_loss_mean"]) == pytest.approx(2.2)
    assert float(table[1]["test_loss_std"]) == pytest.approx(statistics.stdev([2.0, 2.4]))
    assert float(table[1]["acc:parity-L8_max"]) == pytest.approx(0.7)
    assert table[1]["seeds"] == "1 2"
    text = markdown(rows, {"scale": "tiny: test"})
    assert "scale**: tiny: test" in text and "sample standard deviation" in text
    assert "| beta | 1,000 | 2 | 2.2000 ± 0.2828 | -0.3500 ± 0.2121 | 0.650 ± 0.071" in text
    assert "| std * |" in text


def test_one_seed_has_no_spread() -> None:
    assert Spread.of([1.5]) == Spread(1.5, None, 1.5, 1.5, 1)
    assert Spread.of([1.5]).format(2) == "1.50"
    assert Spread.of([None, float("nan")]).n == 0
    rows = summarize([_result("a", 3, 1.0)], ["a", "b"], reference="a")
    assert rows[1]["seeds"] == [] and rows[1]["test_loss"].format() == "–"  # b not done yet


# ---- arms and scales ----------------------------------------------------------------------------
@pytest.mark.parametrize("scale", sorted(SCALES))
def test_equal_parameter_arms_within_tolerance_at_every_scale(scale: str) -> None:
    for suite in ("depth", "state"):
        seq_len = SCALES[scale].state_seq_len if SUITES[suite].task_data else SCALES[scale].seq_len
        arms, reference = suite_arms(suite, SCALES[scale], seq_len)
        ref = next(a for a in arms if a.name == reference)
        assert ref.model.arch == "standard" and all(a.fair for a in arms if a is not ref)
        assert {a.model.arch for a in arms} >= ({"standard", "looped", "beta12"}
                                                if suite == "state" else {"standard", "beta12"})
        for vocab in (None, 320, 8192):
            assert check_equal_parameters(arms, reference, vocab) == []
            for arm in arms:
                error = abs(arm.parameters(vocab) - ref.parameters(vocab)) / ref.parameters(vocab)
                assert error <= FAIR_TOLERANCE, (scale, suite, arm.name, error)
        for arm in arms:  # every arm fits the sequence it trains on (article: presets as they are)
            assert arm.model.max_seq_len >= seq_len and arm.model.block_size <= seq_len
            assert arm.model.max_seq_len == (2048 if scale == "article" else seq_len)


def test_scales_keep_the_articles_ratios() -> None:
    article, _ = suite_arms("depth", SCALES["article"], 2048)
    assert [a.model for a in article] == [get_preset(n) for n in
                                          ("t16_std_tf_rope", "beta_1.2_de10k6",
                                           "beta_1.2_de10k2", "beta_1.2_stride2")]
    sweep, reference = suite_arms("c-sweep", SCALES["tiny"], 64)
    blocks = {a.name: a.model.block_size for a in sweep}
    assert reference == "t16_std_tf_rope"
    assert blocks["beta_1.2_c256"] == 8 * blocks["beta_1.2_test"] == 64  # c = T at tiny
    depth, _ = suite_arms("depth", SCALES["tiny"], 64)
    layers = {a.name: a.model.num_layers for a in depth}
    assert layers["t16_std_tf_rope"] == 2 * layers["beta_1.2_de10k6"]
    windows = {a.name: (a.model.depth_window, a.model.depth_stride) for a in depth}
    assert windows["beta_1.2_de10k6"][0] > windows["beta_1.2_de10k2"][0]
    assert windows["beta_1.2_stride2"] == (windows["beta_1.2_de10k6"][0], 2)
    # An arm given by --arms that is an equal-parameter preset is resolved at the scale too.
    arms, _ = build_arms(["t16_std_tf_rope", "beta_1.2_de10k2"], SCALES["small"], 256)
    assert check_equal_parameters(arms, "t16_std_tf_rope") == [] and arms[1].fair


# ---- bad input ----------------------------------------------------------------------------------
def test_bad_input_names_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = ["--out", str(tmp_path / "out")]
    assert main(["--arms", "t16_std_tf_rope,no_such_arm", "--data", "x", *out]) == 2
    err = capsys.readouterr().err
    assert "--arms no_such_arm: unknown arm" in err
    assert all(name in err for name in preset_names())
    assert main(["--arms", "t16_std_tf_rope", "--data", str(tmp_path / "missing"), *out]) == 2
    assert "--data" in (err := capsys.readouterr().err) and "missing.bin does not exist" in err
    assert main(["--arms", "t16_std_tf_rope", *out]) == 2
    assert "--data: required" in capsys.readouterr().err
    assert main(["--suite", "depth", "--arms", "t16_std_tf_rope", *out]) == 2
    assert "either --suite" in capsys.readouterr().err
    assert main(["--arms", str(tmp_path / "arm.toml"), *out]) == 2
    assert "no such config file" in capsys.readouterr().err
    assert main(["--suite", "c-sweep", "--seeds", "1,x", "--data", "x", *out]) == 2
    assert "--seeds 1,x" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing written on bad input


# ---- the state suite's data ---------------------------------------------------------------------
def test_state_data_is_generated_once(tmp_path: Path) -> None:
    tasks = (TaskSpec("parity", {"length": 5}, 60, 20), TaskSpec("chains", {"hops": 2}, 60, 20))
    made = prepare_task_data(tmp_path, tasks, say=lambda _: None)
    train, test = (Path(made[k]) for k in ("train", "test"))
    for prefix in (train, test):
        for ext in (".bin", ".idx", ".mask", ".json"):
            assert Path(f"{prefix}{ext}").is_file()
    assert [Path(f).name for f in made["test_files"]] == ["parity-L5.test.jsonl",
                                                          "chains-n2-k2-v10.test.jsonl"]
    first = [json.loads(line)["text"] for line in open(made["train_files"][1])]
    held_out = [json.loads(line)["text"] for line in open(made["test_files"][1])]
    assert not set(first) & set(held_out)  # another seed
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    assert prepare_task_data(tmp_path, tasks, say=lambda _: None) == made
    assert {p: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == stamps


# ---- a tiny ablation, killed and resumed --------------------------------------------------------
def _eval_record(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("split") == "eval"][-1]


@pytest.mark.slow
def test_tiny_ablation_resumes_after_a_kill_and_summarises(tmp_path: Path) -> None:
    prefix, _ = build_dataset(tmp_path)
    out = tmp_path / "abl"
    arms = ["t16_std_tf_rope", "beta_1.2_test"]
    argv = ["--arms", ",".join(arms), "--scale", "tiny", "--data", str(prefix),
            "--batches", "3", "--seq-len", "32", "--global-batch", "4", "--micro-batch", "2",
            "--eval-batches", "2", "--checkpoint-every", "2", "--val-fraction", "0.1",
            "--out", str(out)]
    first = out / "runs" / "t16_std_tf_rope-seed1"
    second = out / "runs" / "beta_1.2_test-seed1"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    process = subprocess.Popen([sys.executable, "-m", "megabeta.cli", "ablate", *argv],
                               cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 150
    while not (first / "result.json").exists() and process.poll() is None:
        assert time.monotonic() < deadline, "the first arm did not finish"
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)  # kill the ablation while it is in the second arm
    output = process.communicate(timeout=120)[0]
    assert process.returncode in (130, -signal.SIGTERM), output
    assert (first / "result.json").is_file() and not (second / "result.json").exists(), output
    done = (first / "result.json").read_bytes()
    stamp = (first / "result.json").stat().st_mtime_ns

    assert main(argv) == 0  # the rerun: trains the second arm only
    assert (first / "result.json").read_bytes() == done
    assert (first / "result.json").stat().st_mtime_ns == stamp
    assert len((first / "launches.jsonl").read_text().splitlines()) == 1  # not retrained
    assert (second / "result.json").is_file()

    rows = list(csv.DictReader((out / "summary.csv").read_text().splitlines()))
    assert [r["arm"] for r in rows] == arms  # the standard arm is the reference, first
    for column in ("arm", "reference", "parameters", "seeds", "test_loss_mean", "test_loss_std",
                   "ppl_mean", "s_per_batch_mean", "tokens_per_s_mean", "delta_test_loss_mean"):
        assert column in rows[0]
    assert rows[0]["reference"] == "1" and rows[1]["reference"] == "0"
    for row, run_dir in zip(rows, (first, second)):
        result = json.loads((run_dir / "result.json").read_text())
        assert row["seeds"] == "1" and int(row["parameters"]) == result["parameters"]
        assert float(row["test_loss_mean"]) == pytest.approx(result["test"]["loss"])
        # The same held-out samples the trainer evaluated at its end, from the checkpoint.
        assert result["test"]["loss"] == pytest.approx(_eval_record(run_dir)["loss"], rel=1e-5)
        assert float(row["ppl_mean"]) == pytest.approx(math.exp(result["test"]["loss"]))
        timing = read_train_metrics(run_dir)
        assert float(row["s_per_batch_mean"]) == pytest.approx(timing["s_per_batch"])
        steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text()
                 .splitlines() if "split" not in json.loads(line)]
        assert timing["s_per_batch"] == pytest.approx(
            statistics.fmean(r["s_per_batch"] for r in steps[1:]))
        assert float(row["tokens_per_s_mean"]) == pytest.approx(4 * 32 / timing["s_per_batch"])
        assert result["steps"] == 3 and result["checkpoint"].endswith("step_00000003")
    assert float(rows[1]["delta_test_loss_mean"]) == pytest.approx(
        float(rows[1]["test_loss_mean"]) - float(rows[0]["test_loss_mean"]))
    text = (out / "summary.md").read_text()
    assert "**scale**: tiny" in text and "runs done**: 2 of 2" in text
    assert "| t16_std_tf_rope * |" in text and "| beta_1.2_test |" in text
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["runs"]) == 2 and summary["header"]["reference"] == "t16_std_tf_rope"

    # One TensorBoard run per arm, with the test metrics in it.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(second / "tb"))
    events.Reload()
    assert {"train/loss", "eval/loss", "test/loss", "test/ppl"} <= set(events.Tags()["scalars"])
    assert events.Scalars("test/loss")[-1].value == pytest.approx(
        json.loads((second / "result.json").read_text())["test"]["loss"], rel=1e-6)

    # A rerun with other settings is refused instead of mixing results.
    assert main([*argv[:-2], "--lr", "1e-3", "--out", str(out)]) == 2


def test_plan_prints_the_arms_and_the_trainer_command(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    assert main(["--suite", "state", "--scale", "small", "--plan", "--out",
                 str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "small: width x 0.5" in printed and printed.count("(equal parameters)") == 2
    assert "beta_1.2_c16" in printed and "looped" in printed
    assert "-m megabeta.train" in printed and "--data.align=document" in printed
    assert "--resume=auto" in printed and "--train.seed=1" in printed
    assert not (tmp_path / "out").exists()


def test_document_mask_reaches_every_arm_and_the_test_evaluation(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["--suite", "state", "--scale", "small", "--plan", "--document-mask", "--out",
                 str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "--data.document_mask=true" in printed
    assert main(["--suite", "state", "--scale", "small", "--plan", "--out",
                 str(tmp_path / "out")]) == 0
    assert "--data.document_mask=false" in capsys.readouterr().out


# ---- summary.png (issue 32, item 4) --------------------------------------------------------------
def _fake_run(out: Path, arm: str, seed: int, shift: float) -> None:
    """metrics.jsonl of a finished 4-step run: training losses and two validation evaluations."""
    run_dir = out / "runs" / f"{arm}-seed{seed}"
    run_dir.mkdir(parents=True)
    lines = [{"step": s, "loss": 3.0 - 0.3 * s + shift, "s_per_batch": 0.1, "tokens_per_s": 640}
             for s in range(1, 5)]
    lines += [{"step": s, "split": "eval", "loss": 3.1 - 0.25 * s + shift} for s in (2, 4)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_summary_png_shows_every_arm(tmp_path: Path) -> None:
    from megabeta.ablate.plot import arm_curves, summary_figure, write_plot

    arms = ["standard", "beta_1.2_c8"]
    results = []
    for seed in (1, 2):
        for index, arm in enumerate(arms):
            _fake_run(tmp_path, arm, seed, shift=0.1 * index + 0.05 * seed)
            result = _result(arm, seed, 2.0 + 0.1 * index, accuracy=0.5 + 0.1 * index + 0.02 * seed)
            results.append({**result, "steps": 4})
    rows = summarize(results, arms, reference="standard")
    curves = arm_curves(tmp_path, rows, results)
    # The band: mean, min and max over the two seeds at each step.
    assert curves["standard"]["train"][1] == pytest.approx((2.775, 2.75, 2.8))
    assert sorted(curves["beta_1.2_c8"]["test"]) == [2, 4]
    figure = summary_figure(rows, curves)
    (legend,) = figure.legends
    assert [t.get_text() for t in legend.get_texts()] == ["standard (reference)", "beta_1.2_c8"]
    assert figure.axes[2].get_xticklabels()[0].get_text() == "parity-L8"

    path = write_plot(tmp_path, rows, results, title="test")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (2000, 460)
    assert len(data) > 20_000  # four panels of lines, bands and bars, not an empty canvas


def test_summary_png_without_matplotlib_names_the_extra(tmp_path, monkeypatch) -> None:
    import sys

    from megabeta.ablate.plot import summary_figure
    from megabeta.extras import MissingExtra

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtra, match=r"pip install 'megabeta\[plot\]'"):
        summary_figure([], {})


# ---- bad input found before any arm trains (issue 32, item 5) -------------------------------------
def test_a_task_document_beyond_the_context_fails_before_training(
        tiny_data, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from megabeta.tasks.cli import main as tasks_main

    prefix, tokenizer = tiny_data
    long = tmp_path / "chains32.jsonl"
    assert tasks_main(["make", "--task", "chains", "--hops", "32", "--count", "2", "--seed", "1",
                       "--output", str(long)]) == 0
    out = tmp_path / "abl"
    argv = ["--arms", "t16_std_tf_rope", "--data", str(prefix), "--tokenizer", str(tokenizer),
            "--batches", "2", "--seq-len", "32", "--global-batch", "4", "--out", str(out)]
    assert main([*argv, "--task-files", str(long)]) == 2
    err = capsys.readouterr().err
    assert f"--task-files {long}: document 1 needs" in err and "max_seq_len = 32" in err
    assert not (out / "runs").exists()  # no arm trained
    assert main([*argv, "--set", "eval.nope=1"]) == 2
    assert "unknown config key 'eval.nope'" in capsys.readouterr().err
    assert not (out / "runs").exists()
