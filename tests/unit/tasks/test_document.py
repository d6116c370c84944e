"""Reading a task file (megabeta/tasks/document.py): a bad line is named by file and number."""

from __future__ import annotations

import pytest

from megabeta.tasks.document import TaskFileError, read_task_file
from megabeta.tasks.make import generate_documents
from megabeta.tasks.parity import Parity


def test_read_task_file_names_the_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = next(generate_documents(Parity(length=3), 1, seed=0)).to_json()
    path.write_text(good + "\n\n" + '{"segments": [{"text": "x"}]}\n')
    with pytest.raises(TaskFileError, match=r"bad.jsonl:3: segments\[0\]"):
        list(read_task_file(path))
    path.write_text(good + "\nnot json\n")
    with pytest.raises(TaskFileError, match=r"bad.jsonl:2: not valid JSON"):
        list(read_task_file(path))
    path.write_text('{"segments": [{"text": "a=", "loss": false}, {"text": "1", "loss": true}]}\n')
    (document,) = read_task_file(path)  # not generated: grouped under the file name
    assert document.task == "bad" and document.chance is None and document.answers == ["1"]
