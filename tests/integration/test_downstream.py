"""Issue 32, item 3: downstream evals in the training loop ([eval] tasks, lm_eval_tasks,
downstream_interval).

With attention dropout on (so any draw from the global generators would show in the losses), a run
with downstream evals every 2 steps, task files and lm-eval tasks (the harness reseeds every global
generator) takes bitwise the losses of a run without them. A run with downstream evals stopped at
step 2 and resumed takes bitwise the losses of an uninterrupted one (without dropout: a resumed
launch's start-up draws from the global generator, evals or not). Their results are logged as
eval/<task>/<metric> to metrics.jsonl and TensorBoard, with their cost; the task accuracy is that
of `megabeta tasks eval`'s scoring of the final checkpoint. On 2 ranks (DDP and FSDP2) every
metric is the one a single process computes from the same checkpoint, rank 0 alone writes them,
and the steps stay bitwise. Bad task files and task names stop the run at start-up, before any
step.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from support.lm_eval_helpers import WORDS, write_tasks
from support.train_helpers import TINY, launch, losses

from data_tools.tokenizer import load_tokenizer
from megabeta.checkpoint.export import load_model
from megabeta.config import load_config
from megabeta.model import ConfigError
from megabeta.tasks.cli import main as tasks_main
from megabeta.tasks.document import TaskDocument
from megabeta.tasks.evaluate import evaluate_tasks
from megabeta.train.loop import Trainer


@pytest.fixture(scope="module")
def inputs(tiny_data, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("downstream")
    parity = root / "parity.jsonl"
    assert tasks_main(["make", "--task", "parity", "--length", "5", "--count", "12", "--seed",
                       "1", "--output", str(parity)]) == 0
    long = root / "chains.jsonl"
    assert tasks_main(["make", "--task", "chains", "--hops", "32", "--count", "2", "--seed",
                       "1", "--output", str(long)]) == 0
    return {"parity": parity, "long": long, "echo": write_echo(root / "echo.jsonl", 9),
            "include": write_tasks(root / "lm_tasks", 3)}


def write_echo(path: Path, count: int) -> Path:
    """`count` documents of 1 to 4 words of the corpus, each with a one-character answer inside
    a word: half of them the word's next character, half a repeat of the one before. A model a
    few steps old mostly predicts its input token again, so it gets some of these right and some
    wrong, unlike parity's, which it gets all wrong: accuracies that tell one shard from all."""
    rng = random.Random(5)
    with open(path, "w", encoding="utf-8") as stream:
        for index in range(count):
            segments: list[tuple[str, bool]] = []
            for _ in range(1 + index % 4):
                word = rng.choice(WORDS)
                cut = rng.randrange(1, len(word))
                answer = word[cut - 1] if rng.random() < 0.5 else word[cut]
                before = segments.pop()[0] if segments else ""
                segments += [(before + word[:cut], False), (answer, True),
                             (word[cut + 1:] + " ", False)]
            stream.write(TaskDocument("echo", tuple(segments)).to_json() + "\n")
    return path


def train(run_dir: Path, tiny_data, *extra: str) -> Trainer:
    prefix, tokenizer = tiny_data
    config = load_config(TINY[0].partition("=")[2],
                         [*TINY[1:], f"--data.path={prefix}", f"--data.tokenizer={tokenizer}",
                          f"--run_dir={run_dir}", "--train.steps=4", "--checkpoint.interval=2",
                          *extra])
    trainer = Trainer(config)
    trainer.train()
    return trainer


def downstream(inputs) -> list[str]:
    return ["--eval.downstream_interval=2", f"--eval.tasks={inputs['parity']}",
            "--eval.lm_eval_tasks=mb_choice,mb_generate",
            f"--eval.lm_eval_include={inputs['include']}", "--eval.lm_eval_limit=2"]


def test_downstream_evals_change_no_step(tiny_data, inputs, tmp_path):
    train(tmp_path / "plain", tiny_data, "--model.dropout=0.1")
    train(tmp_path / "evals", tiny_data, "--model.dropout=0.1", *downstream(inputs))
    plain = losses(tmp_path / "plain")
    assert len(plain) == 4
    assert losses(tmp_path / "evals") == plain  # bitwise: floats compared with ==

    records = [json.loads(line) for line in
               (tmp_path / "evals" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("split") == "eval" and "downstream_s" in r]
    assert [r["step"] for r in evals] == [2, 4]  # every 2 steps and at the end
    names = {"parity-L5/accuracy", "mb_choice/acc", "mb_choice/acc_norm",
             "mb_generate/exact_match", "downstream_s"}
    assert all(set(r) - {"step", "split"} == names for r in evals)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "evals" / "tb"))
    events.Reload()
    assert {f"eval/{name}" for name in names} <= set(events.Tags()["scalars"])

    # The logged accuracy is the task-file scoring of the same weights.
    final = load_model(tmp_path / "evals" / "checkpoints" / "step_00000004")
    (score,) = evaluate_tasks(final, load_tokenizer(tiny_data[1]), [inputs["parity"]])
    assert evals[-1]["parity-L5/accuracy"] == score.accuracy


def test_resume_with_downstream_evals_stays_bitwise(tiny_data, inputs, tmp_path):
    evals = ["--eval.downstream_interval=2", f"--eval.tasks={inputs['parity']}"]
    train(tmp_path / "whole", tiny_data, *evals)
    train(tmp_path / "resumed", tiny_data, *evals, "--train.exit_after=2")
    assert len(losses(tmp_path / "resumed")) == 2
    train(tmp_path / "resumed", tiny_data, *evals, "--resume=auto")
    assert losses(tmp_path / "resumed") == losses(tmp_path / "whole")


@pytest.mark.parametrize("setting, message", [
    ("long", "eval.tasks {long}: document 1 needs"),
    ("missing", "eval.tasks {missing}: no such file"),
    ("name", "eval.lm_eval_tasks: unknown lm-eval task(s) mb_chioce (did you mean mb_choice"),
])
def test_bad_downstream_input_stops_the_run_before_any_step(tiny_data, inputs, tmp_path,
                                                            setting, message):
    missing = tmp_path / "missing.jsonl"
    extra = {"long": [f"--eval.tasks={inputs['long']}"],
             "missing": [f"--eval.tasks={missing}"],
             "name": ["--eval.lm_eval_tasks=mb_chioce",
                      f"--eval.lm_eval_include={inputs['include']}"]}[setting]
    with pytest.raises(ConfigError) as caught:
        train(tmp_path / "run", tiny_data, *extra)
    assert message.format(long=inputs["long"], missing=missing) in str(caught.value)
    assert not (tmp_path / "run").exists()  # nothing written: no step ran


def launch_args(tiny_data, run_dir: Path, *extra: str) -> list[str]:
    prefix, tokenizer = tiny_data
    return [*TINY, f"--data.path={prefix}", f"--data.tokenizer={tokenizer}",
            f"--run_dir={run_dir}", "--train.steps=4", "--checkpoint.interval=2",
            "--model.dropout=0.1", *extra]


def scored_alone(checkpoint: Path, tokenizer: Path, task_files: list[Path],
                 include: Path) -> dict[str, float]:
    """The downstream metrics of one process scoring `checkpoint`'s weights: the task files by
    `megabeta tasks eval`'s scoring, the lm-eval tasks by the harness with the run's settings."""
    from megabeta.infer import lm_eval as harness

    model, processor = load_model(checkpoint), load_tokenizer(tokenizer)
    scores = evaluate_tasks(model, processor, task_files)
    tasks = harness.find_tasks(["mb_choice", "mb_generate"], str(include))
    results = harness.run_tasks(harness.MegabetaLM(model, processor, batch_size=2), tasks,
                                limit=2, bootstrap_iters=0)
    return {**{f"{s.task}/accuracy": s.accuracy for s in scores},
            **harness.metric_values(results)}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_downstream_evals_on_two_ranks(backend, tiny_data, inputs, tmp_path):
    """2 ranks (gloo): task files sharded across them, the harness on rank 0 (under FSDP2 on
    weights gathered from both ranks' shards). The metrics are those one process computes from
    the same checkpoint, only rank 0 writes them, and the steps are bitwise those of a 2-rank
    run without evals (dropout on: a draw from any rank's generators would show)."""
    plain, evals = tmp_path / "plain", tmp_path / "evals"
    task_files = [inputs["parity"], inputs["echo"]]
    launch(launch_args(tiny_data, plain, f"--parallel.backend={backend}"), nproc=2)
    done = launch(launch_args(tiny_data, evals, f"--parallel.backend={backend}",
                              *downstream(inputs),
                              f"--eval.tasks={','.join(map(str, task_files))}"), nproc=2)
    assert losses(evals) == losses(plain)
    assert len(losses(plain)) == 4

    lines = (evals / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len(set(lines))  # one writer: no record twice
    records = [r for r in map(json.loads, lines) if "downstream_s" in r]
    assert [r["step"] for r in records] == [2, 4]
    rank0_share = tmp_path / "echo-rank0.jsonl"
    rank0_share.write_text("".join(inputs["echo"].read_text().splitlines(True)[0::2]))
    shard_differs = False
    for record in records:
        logged = {k: v for k, v in record.items() if k not in ("step", "split", "downstream_s")}
        checkpoint = evals / "checkpoints" / f"step_{record['step']:08d}"
        assert logged == scored_alone(checkpoint, tiny_data[1], task_files, inputs["include"])
        (alone,) = evaluate_tasks(load_model(checkpoint), load_tokenizer(tiny_data[1]),
                                  [rank0_share])
        shard_differs |= alone.accuracy != logged["echo/accuracy"]
    assert shard_differs  # else rank 0's share alone would pass for the gathered result

    assert len(list((evals / "tb").glob("events.out.tfevents.*"))) == 1
    output = done.stdout + done.stderr
    assert "[rank 1]" not in output
    assert output.count("eval step 2 |") == 1  # rank 0's log line, once
