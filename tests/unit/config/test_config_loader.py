"""Dataclass configs from TOML and `--section.key=value` flags (megabeta.config_loader), on a
config of its own: one flat mapping, values of the declared types, mistakes named."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from megabeta.config_loader import (coerce, field_docs, field_types, flatten, parse_overrides,
                                    read_toml, renamed, typed_tables)
from megabeta.model import ConfigError


@dataclass
class Section:
    steps: int = 1
    """How many steps."""
    lr: float = 0.1
    """Learning rate."""
    quiet: bool = False
    names: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    limit: int | None = None
    """At most this many; none: no limit."""


KINDS = {"run_dir": str, **{f"train.{k}": v for k, v in field_types(Section).items()}}


def test_a_toml_file_and_flags_become_one_flat_mapping(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('run_dir = "runs/a"\n[train]\nsteps = 3\nnames = ["x", "y"]\n')
    flat = flatten(read_toml(path))
    assert flat == {"run_dir": "runs/a", "train.steps": 3, "train.names": ["x", "y"]}
    flat.update(parse_overrides(["--train.steps=7", "--train.lr=1e-3", "run_dir=b=c"]))
    assert flat == {"run_dir": "b=c", "train.steps": "7", "train.names": ["x", "y"],
                    "train.lr": "1e-3"}
    with pytest.raises(ConfigError, match="override '--train.steps' must look like"):
        parse_overrides(["--train.steps"])


def test_an_invalid_toml_file_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[optim\nlr = 1")
    with pytest.raises(ConfigError, match="bad.toml is not valid TOML"):
        read_toml(bad)
    with pytest.raises(FileNotFoundError):  # the caller says what to pass instead
        read_toml(tmp_path / "missing.toml")


def test_values_take_their_fields_types() -> None:
    tables, top = typed_tables({"run_dir": "r", "train.steps": "7", "train.lr": "1e-3",
                                "train.quiet": "on", "train.names": "a,b",
                                "train.weights": "0.25,0.75", "train.limit": "none"}, KINDS)
    assert top == {"run_dir": "r"}
    assert tables == {"train": {"steps": 7, "lr": 1e-3, "quiet": True, "names": ["a", "b"],
                                "weights": [0.25, 0.75], "limit": None}}
    assert Section(**tables["train"]).steps == 7
    assert typed_tables({"train.limit": 5, "train.quiet": False}, KINDS)[0] == {
        "train": {"limit": 5, "quiet": False}}  # TOML values already typed stay as they are
    for key, value, message in [("train.steps", "many", "train.steps = 'many': expected int"),
                                ("train.steps", 1.5, "train.steps = 1.5: expected int"),
                                ("train.steps", True, "train.steps = True: expected int"),
                                ("train.quiet", "maybe", "train.quiet = 'maybe': expected bool"),
                                ("train.names", 3, "train.names = 3: expected a list")]:
        with pytest.raises(ConfigError, match=message):
            typed_tables({key: value}, KINDS)


def test_a_list_in_the_config_files_spelling() -> None:
    """`--eval.tasks=["a", "b"]`, as the TOML file writes a list, is that list (not the one
    item `["a"`); comma-separated as before."""
    assert coerce('["hellaswag", "arc_easy"]', list[str], "eval.tasks") == ["hellaswag",
                                                                          "arc_easy"]
    assert coerce("[0.25, 0.75]", list[float], "data.weights") == [0.25, 0.75]
    assert coerce("a,b,", list[str], "data.path") == ["a", "b"]
    with pytest.raises(ConfigError, match=r'eval.tasks = \["a",: not a TOML list'):
        coerce('["a",', list[str], "eval.tasks")


def test_an_unknown_key_names_the_closest_known_one() -> None:
    with pytest.raises(ConfigError, match="unknown config key 'train.lrr'; did you mean "
                                          "'train.lr'"):
        typed_tables({"train.lrr": "1"}, KINDS)
    with pytest.raises(ConfigError, match="unknown config key 'zzz'; known: run_dir, "):
        typed_tables({"zzz": "1"}, KINDS)


def test_renamed_keys_load_under_their_new_name_and_not_twice() -> None:
    renames = {"train.nsteps": "train.steps"}
    assert renamed({"train.nsteps": 3, "train.lr": 1}, renames) == {"train.steps": 3,
                                                                   "train.lr": 1}
    with pytest.raises(ConfigError, match="'train.nsteps' and 'train.steps' are the same"):
        renamed({"train.nsteps": 3, "train.steps": 4}, renames)


def test_field_docs_are_the_strings_under_the_fields() -> None:
    docs = field_docs([Section])
    assert docs[("Section", "steps")] == "How many steps."
    assert docs[("Section", "limit")] == "At most this many; none: no limit."
    assert ("Section", "quiet") not in docs  # no string under it
