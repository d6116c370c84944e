"""Tiny generated corpora and a tiny tokenizer for the data-pipeline tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

from data_tools.cli import main

# Text that a careless tokenizer setup would not give back: indentation, tabs, runs of spaces,
# blank lines, CRLF, trailing spaces, non-ASCII.
TRICKY_TEXTS = [
    "def f(x):\n    if x:\n        return  x\n\n\n    return None\n",
    "\tindented with a tab\n\t\ttwo tabs\n  \t mixed \t\n",
    "several    spaces   between     words   ",
    "  leading spaces and a trailing newline\n",
    "windows line\r\nendings\r\n",
    "unicode: café, naïve, 中文, emoji 🙂, math ∑",
    "\n\nstarts with blank lines",
    "x",
]

_WORDS = ("alpha beta gamma delta epsilon model token layer block depth train value return "
          "import class self print while for if else data loader sample").split()


def documents(count: int, seed: int = 0) -> list[str]:
    """``count`` varied documents: prose-like lines, code-like indented lines, the tricky texts."""
    rng = random.Random(seed)
    docs = []
    for index in range(count):
        lines = []
        for line in range(rng.randint(1, 6)):
            indent = "    " * rng.randint(0, 2) if index % 2 else ""
            words = " ".join(rng.choices(_WORDS, k=rng.randint(1, 9)))
            lines.append(indent + words + ("\t# note" if line % 3 == 0 else ""))
        docs.append("\n".join(lines) + ("\n\n" if index % 4 == 0 else ""))
    for position, text in enumerate(TRICKY_TEXTS):
        docs.insert((position * 7) % (len(docs) + 1), text)
    return docs


def write_jsonl(path: Path, docs: list[str], key: str = "text") -> Path:
    with open(path, "w", encoding="utf-8") as stream:
        for doc in docs:
            stream.write(json.dumps({key: doc, "id": len(doc)}) + "\n")
    return path


def train_tiny_tokenizer(directory: Path, inputs: list[Path], vocab_size: int = 400,
                         model_type: str = "bpe", seed: int = 0) -> Path:
    """Train through the CLI; returns the .model path."""
    prefix = directory / f"tok-{model_type}-{vocab_size}-{seed}"
    status = main(["train-tokenizer", "--inputs", *map(str, inputs), "--vocab-size",
                   str(vocab_size), "--output", str(prefix), "--model-type", model_type,
                   "--seed", str(seed), "--quiet"])
    assert status == 0
    return Path(f"{prefix}.model")


def tokenize(model: Path, inputs: list[Path], prefix: Path, *extra: str) -> int:
    """Run ``tokenize`` through the CLI; returns the exit status."""
    return main(["tokenize", "--tokenizer", str(model), "--inputs", *map(str, inputs),
                 "--output-prefix", str(prefix), "--quiet", *extra])
