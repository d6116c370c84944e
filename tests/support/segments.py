"""Segmented documents (prompt and answer spans, the answers scored) for the loss-mask tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

from support.corpus import documents

Segments = list[tuple[str, bool]]


def segmented_documents(count: int, seed: int = 0) -> list[Segments]:
    """``count`` documents of 1-4 alternating spans: unscored ones from the varied corpus text,
    scored "answers" of a few words; some documents start with a scored span, some have none."""
    rng = random.Random(seed)
    texts = documents(count, seed=seed)
    docs = []
    for index in range(count):
        spans = []
        scored = index % 5 == 3  # a few documents start with a scored span
        for _ in range(rng.randint(1, 4)):
            if scored:
                spans.append((f" = {rng.randint(0, 999)} {rng.choice(texts)[:12]}", True))
            else:
                spans.append((rng.choice(texts)[: rng.randint(5, 60)], False))
            scored = not scored
        if index % 7 == 0:
            spans = [(text, False) for text, _ in spans]  # nothing scored at all
        docs.append(spans)
    return docs


def write_segments_jsonl(path: Path, docs: list[Segments], key: str = "segments") -> Path:
    with open(path, "w", encoding="utf-8") as stream:
        for doc in docs:
            record = {key: [{"text": text, "loss": loss} for text, loss in doc], "id": len(doc)}
            stream.write(json.dumps(record) + "\n")
    return path


def write_plain_jsonl(path: Path, docs: list[Segments]) -> Path:
    """The same documents as plain text (for training a tokenizer on them)."""
    with open(path, "w", encoding="utf-8") as stream:
        for doc in docs:
            stream.write(json.dumps({"text": "".join(text for text, _ in doc)}) + "\n")
    return path
