"""Generating a task file: the registry of tasks, the seeded document stream, the atomic write.

One `np.random.default_rng(seed)` draws the documents one after another, so the same task,
options and seed give a byte-identical file (with the same numpy), and a file of N documents is
the first N documents of a longer one with the same seed. Train and test files need different
seeds; on tasks with few distinct documents (parity of short strings) they still overlap.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import numpy as np

from megabeta.data.errors import refuse_existing
from megabeta.storage.durable import AtomicFiles
from megabeta.tasks.chains import Chains
from megabeta.tasks.document import TaskDocument
from megabeta.tasks.parity import Parity
from megabeta.tasks.permutations import Permutations
from megabeta.tasks.retrieval import Retrieval


class Task(Protocol):
    """A task variant (its options): what it is called, its chance level, one random document."""

    @property
    def name(self) -> str: ...

    @property
    def chance(self) -> float: ...

    def generate(self, rng: np.random.Generator) -> TaskDocument: ...


TASKS: dict[str, type] = {"chains": Chains, "permutations": Permutations, "parity": Parity,
                          "retrieval": Retrieval}
"""`--task` name -> the options dataclass of that task (keyword arguments = its flags)."""


def generate_documents(task: Task, count: int, seed: int) -> Iterator[TaskDocument]:
    """`count` documents of `task`, drawn in order from one generator seeded with `seed`."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        yield task.generate(rng)


def write_task_file(path: str | Path, documents: Iterable[TaskDocument],
                    overwrite: bool = False) -> int:
    """Write `documents` as JSONL, atomically (a failed run leaves no file under `path`);
    DataError when `path` exists and not `overwrite`. Returns the number written."""
    path = Path(path)
    written = 0
    refuse_existing([path], overwrite)
    with AtomicFiles([path]) as files:
        # newline="\n": the same bytes on every platform.
        with open(files.temp(path), "w", encoding="utf-8", newline="\n") as stream:
            for document in documents:
                stream.write(document.to_json() + "\n")
                written += 1
        files.commit()
    return written
