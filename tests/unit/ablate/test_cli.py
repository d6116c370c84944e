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
