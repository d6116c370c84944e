"""Task documents: what `megabeta tasks make` writes and `megabeta tasks eval` reads.

A task file is JSONL, one document per line:

    {"task": "parity-L4", "chance": 0.5,
     "segments": [{"text": "0110=", "loss": false}, {"text": "0", "loss": true},
                  {"text": "\\n", "loss": false}],
     "answers": ["0"], "text": "0110=0\\n"}

`segments` is the contract with the tokenizer (`megabeta-data tokenize --segments-key segments`)
and the evaluator: each segment is encoded on its own (`data_tools.encode.encode_segments`), and
the tokens of a `loss: true` segment are the scored targets. Each scored segment is one answer,
always followed by unscored text, so that the runs of scored tokens are the answers one for one.
`task` names the variant (its options in the name: results are grouped by it), `chance` is the
accuracy of a predictor that ignores the document (see each task's module), `answers` repeats the
scored texts for people reading the file, and `text` joins all segments so that
`megabeta-data train-tokenizer --inputs FILE.jsonl` (default `--text-key text`) trains on the
documents as they read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

Segment = tuple[str, bool]
"""A piece of a document's text and whether its tokens are scored (as data_tools.encode)."""


class TaskFileError(ValueError):
    """A task file that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class TaskDocument:
    """One document of a task: its segments, the variant's name and its chance level."""

    task: str
    segments: tuple[Segment, ...]
    chance: float | None = None
    """Accuracy of an input-blind predictor; None when the file does not say (not generated)."""

    @property
    def answers(self) -> list[str]:
        return [text for text, scored in self.segments if scored]

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self.segments)

    def to_json(self) -> str:
        """The document's JSONL line (without the newline); keys in a fixed order."""
        return json.dumps({"task": self.task, "chance": self.chance,
                           "segments": [{"text": t, "loss": s} for t, s in self.segments],
                           "answers": self.answers, "text": self.text})


class DocumentBuilder:
    """Collects a document's text and answers into segments: consecutive unscored text joins
    into one segment, and every answer must be followed by unscored text before the next one
    (two adjacent scored segments would be one run of scored tokens, one answer to the
    evaluator)."""

    def __init__(self) -> None:
        self._segments: list[Segment] = []
        self._text: list[str] = []

    def text(self, text: str) -> None:
        self._text.append(text)

    def answer(self, text: str) -> None:
        if not self._text:
            raise ValueError(f"answer {text!r} follows another answer (or starts the document) "
                             "with no unscored text between them")
        self._segments.append(("".join(self._text), False))
        self._text = []
        self._segments.append((text, True))

    def build(self, task: str, chance: float) -> TaskDocument:
        if self._text:
            self._segments.append(("".join(self._text), False))
        return TaskDocument(task, tuple(self._segments), chance)


def read_task_file(path: str | Path, max_documents: int = 0,
                   flag: str = "--tasks") -> Iterator[TaskDocument]:
    """The documents of a task file (at most `max_documents`; 0 = all). Blank lines are skipped;
    a line that is not a document with valid `segments` is a TaskFileError naming FILE:LINE.
    A document without `task` is grouped under the file's name; without `chance`, None.
    `flag`: the option or config key that named the file, for the messages."""
    path = Path(path)
    if not path.is_file():
        raise TaskFileError(f"{flag} {path}: no such file; pass a JSONL file written by "
                            "`megabeta tasks make`")
    read = 0
    with open(path, encoding="utf-8") as stream:
        for line_number, line in enumerate(stream, start=1):
            if max_documents and read >= max_documents:
                return
            if not line.strip():
                continue
            yield _parse(line, f"{path}:{line_number}", default_task=path.stem)
            read += 1


def _parse(line: str, where: str, default_task: str) -> TaskDocument:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise TaskFileError(f"{where}: not valid JSON ({err})") from None
    if not isinstance(record, dict) or not isinstance(record.get("segments"), list):
        raise TaskFileError(f"{where}: expected a JSON object with a list \"segments\" of "
                            "{\"text\": str, \"loss\": bool}, as `megabeta tasks make` writes")
    segments = []
    for index, segment in enumerate(record["segments"]):
        if (not isinstance(segment, dict) or not isinstance(segment.get("text"), str)
                or not isinstance(segment.get("loss"), bool)):
            raise TaskFileError(f"{where}: segments[{index}] is {segment!r}; each segment must "
                                "be {\"text\": str, \"loss\": bool}")
        segments.append((segment["text"], segment["loss"]))
    task = record.get("task", default_task)
    chance = record.get("chance")
    if not isinstance(task, str) or not task:
        raise TaskFileError(f"{where}: \"task\" is {task!r}; it must be a non-empty string")
    if chance is not None and (isinstance(chance, bool) or not isinstance(chance, (int, float))
                               or not 0.0 <= chance <= 1.0):
        raise TaskFileError(f"{where}: \"chance\" is {chance!r}; it must be a number in [0, 1] "
                            "or absent")
    return TaskDocument(task, tuple(segments), None if chance is None else float(chance))
