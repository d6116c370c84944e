"""`megabeta ablate`'s plan (megabeta/ablate/cli.py): held-out --task-files do not change how
the arms' training samples are cut: a corpus is packed and a task dataset (a loss mask)
document-aligned, and the choice is said at the start, not only under --plan; the summary's
`test loss` says what the test loss is over."""

from __future__ import annotations

from pathlib import Path

import pytest

from megabeta.ablate.cli import build_parser, plan
from megabeta.ablate.runner import prepare_task_data
from megabeta.ablate.suites import TaskSpec


@pytest.fixture(scope="module")
def task_data(tmp_path_factory) -> dict:
    """A masked training and test dataset of a small task, its tokenizer and test file."""
    return prepare_task_data(tmp_path_factory.mktemp("tasks"),
                             (TaskSpec("parity", {"length": 5}, 60, 20),
                              TaskSpec("chains", {"hops": 2}, 60, 20)), say=lambda _: None)


def planned(*argv: str):
    said: list[str] = []
    settings, _, _, header = plan(build_parser().parse_args(
        ["--arms", "t16_std_tf_rope", "--plan", *argv]), say=said.append)
    return settings, header, "\n".join(said)


def test_task_files_leave_a_corpus_packed_and_say_so(tiny_data, task_data, tmp_path) -> None:
    prefix, tokenizer = tiny_data
    settings, header, said = planned("--data", str(prefix), "--tokenizer", str(tokenizer),
                                     "--task-files", *task_data["test_files"],
                                     "--out", str(tmp_path / "a"))
    assert settings.align == "packed"
    assert "data.align = packed: the default for a corpus (--data has no loss mask)" in said
    assert header["test loss"] == ("mean over the scored targets of the validation split "
                                   "(val_fraction 0.05) of --data: every token (no loss mask)")


def test_task_data_is_document_aligned_and_said(task_data, tmp_path) -> None:
    settings, header, said = planned("--data", task_data["train"], "--test-data",
                                     task_data["test"], "--task-files", *task_data["test_files"],
                                     "--out", str(tmp_path / "b"))
    assert settings.align == "document"
    assert "data.align = document: the default for task data (--data has a loss mask)" in said
    assert header["test loss"].endswith(": only the answers (the held-out data's loss mask)")
    settings, _, said = planned("--data", task_data["train"], "--align", "packed",
                                "--out", str(tmp_path / "c"))
    assert settings.align == "packed" and "data.align = packed: --align" in said


def test_scale_says_what_it_sets_and_scales_its_intervals_with_the_batches(
        tiny_data, tmp_path, monkeypatch) -> None:
    prefix, tokenizer = tiny_data
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    settings, _, said = planned("--data", str(prefix), "--scale", "article", "--batches", "400",
                                "--lr", "5e-4", "--out", str(tmp_path / "a"))
    # article: a checkpoint every 1000 of its 20000 batches, so every 20 of 400.
    assert (settings.checkpoint_every, settings.eval_every, settings.threads) == (20, 40, 1)
    assert ("--scale article with 400 batches sets: lr 0.0005 (flag), warm-up 10 (0.025 of the "
            "batches), checkpoint every 20 (scale, in proportion to the batches), eval every 40 "
            "(batches / 10), logging every 10 (scale), seq_len 2048 (scale)") in said
    assert "intra-op threads per arm 1 (default)" in said
    settings, _, said = planned("--data", str(prefix), "--batches", "60", "--eval-every", "7",
                                "--threads", "2", "--out", str(tmp_path / "b"))
    assert (settings.checkpoint_every, settings.eval_every, settings.threads) == (15, 7, 2)
    assert "eval every 7 (flag)" in said and "intra-op threads per arm 2 (flag)" in said
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    settings, _, said = planned("--data", str(prefix), "--out", str(tmp_path / "c"))
    assert settings.threads == 3 and "threads per arm 3 (OMP_NUM_THREADS)" in said


def test_each_arm_trains_with_the_ablations_threads(tmp_path, monkeypatch) -> None:
    """The trainer's environment carries OMP_NUM_THREADS = settings.threads (the child echoes
    it in place of training)."""
    from megabeta.ablate import runner

    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    echo = ["python3", "-c", "import os; print('threads', os.environ['OMP_NUM_THREADS'])"]
    monkeypatch.setattr(runner, "_trainer_command", lambda settings, args: echo)

    class Given:
        threads = 1

    runner.launch_trainer(Given(), [], tmp_path)
    assert "threads 1" in (tmp_path / "train.log").read_text()


def test_an_arm_file_brings_its_block_size_curriculum_scaled(tiny_data, tmp_path) -> None:
    from megabeta.ablate.runner import trainer_args

    prefix, _ = tiny_data
    arm = tmp_path / "curriculum.toml"
    arm.write_text('[model]\narch = "beta12"\nblock_size = 32\nd_model = 64\nnum_heads = 2\n'
                   "num_layers = 2\nmax_seq_len = 256\n"
                   "[train]\nsteps = 400\nblock_size_schedule = [[0, 256], [200, 32]]\n")
    said: list[str] = []
    settings, arms, _, _ = plan(build_parser().parse_args(
        ["--arms", f"t16_std_tf_rope,{arm}", "--plan", "--data", str(prefix), "--scale",
         "tiny", "--batches", "300", "--out", str(tmp_path / "o")]), say=said.append)
    curriculum = next(a for a in arms if a.name == "curriculum")
    # tiny: blocks x 1/4, at most seq_len 64: c = 256 -> 64, c = 32 -> 8 (the model's c).
    assert curriculum.model.block_size == 8
    assert curriculum.block_size_schedule == ((0, 64), (200, 8))
    assert "curriculum c = 64 from step 0, c = 8 from step 200" in curriculum.source
    args = trainer_args(settings, curriculum, 1, tmp_path / "run")
    assert "--train.block_size_schedule=[[0, 64], [200, 8]]" in args
    standard = next(a for a in arms if a.name == "t16_std_tf_rope")
    assert not any("block_size_schedule" in a for a in trainer_args(settings, standard, 1,
                                                                      tmp_path / "run"))
    # The ablation's own --batches is checked against the arm's stages before any training.
    with pytest.raises(Exception, match=r"train\.block_size_schedule.*at or after train\.steps"):
        plan(build_parser().parse_args(
            ["--arms", str(arm), "--plan", "--data", str(prefix), "--scale", "tiny",
             "--batches", "150", "--out", str(tmp_path / "p")]), say=said.append)
