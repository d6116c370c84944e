"""Python 3.10, the floor pyproject.toml declares: every module parses as 3.10 syntax, and no
module imports a standard-library module or name that is newer without a version guard (how
`tomllib` once slipped in: 3.11+, while requires-python said >= 3.10)."""

from __future__ import annotations

import ast
import re

from megabeta.config_loader import tomllib
from support import REPO

SOURCES = sorted(p for folder in ("megabeta", "data_tools", "configs") for p in
                 (REPO / folder).rglob("*.py"))
# Standard-library modules and names newer than 3.10, by the version that added them.
NEWER_MODULES = {"tomllib": "3.11", "wsgiref.types": "3.11", "annotationlib": "3.14",
                 "compression": "3.14", "string.templatelib": "3.14",
                 "concurrent.interpreters": "3.14"}
NEWER_NAMES = {("typing", "Self"): "3.11", ("typing", "LiteralString"): "3.11",
               ("typing", "Never"): "3.11", ("typing", "assert_never"): "3.11",
               ("typing", "reveal_type"): "3.11", ("typing", "Required"): "3.11",
               ("typing", "NotRequired"): "3.11", ("typing", "TypeVarTuple"): "3.11",
               ("typing", "Unpack"): "3.11", ("typing", "dataclass_transform"): "3.11",
               ("typing", "override"): "3.12", ("typing", "TypeAliasType"): "3.12",
               ("typing", "ReadOnly"): "3.13", ("typing", "TypeIs"): "3.13",
               ("enum", "StrEnum"): "3.11", ("datetime", "UTC"): "3.11",
               ("hashlib", "file_digest"): "3.11", ("asyncio", "TaskGroup"): "3.11",
               ("asyncio", "timeout"): "3.11", ("itertools", "batched"): "3.12",
               ("contextlib", "chdir"): "3.11", ("operator", "call"): "3.11",
               ("warnings", "deprecated"): "3.13", ("copy", "replace"): "3.13"}


def floor() -> tuple[int, int]:
    spec = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    major, minor = re.fullmatch(r">=\s*(\d+)\.(\d+)", spec.strip()).groups()
    return int(major), int(minor)


def version_guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Inside `if sys.version_info ...` or a `try` that catches ImportError."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "version_info" in ast.unparse(node.test):
            return True
        if isinstance(node, ast.Try) and any(
                handler.type is not None and "ImportError" in ast.unparse(handler.type)
                for handler in node.handlers):
            return True
    return False


def newer_uses(source: str) -> list[str]:
    """What `source` uses from a standard library newer than 3.10, outside a version guard."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            names = [(node.value.id, node.attr)]
        else:
            continue
        for module, name in names:
            # A name bound to a module (`tomllib` may be tomli) is judged by its attributes only.
            imported = not isinstance(node, ast.Attribute)
            newer = next((v for m, v in NEWER_MODULES.items()
                          if imported and (module == m or module.startswith(m + "."))),
                         NEWER_NAMES.get((module, name)))
            if newer and not version_guarded(node, parents):
                found.append(f"line {node.lineno}: {module}{'.' + name if name else ''} "
                             f"(Python {newer})")
    return found


def test_the_floor_is_3_10() -> None:
    assert floor() == (3, 10)


def test_every_module_parses_as_the_floor_version() -> None:
    bad = []
    for path in SOURCES:
        try:
            ast.parse(path.read_text(encoding="utf-8"), feature_version=floor())
        except SyntaxError as err:
            bad.append(f"{path.relative_to(REPO)}:{err.lineno}: {err.msg}")
    assert bad == []


def test_no_unguarded_newer_standard_library() -> None:
    bad = [f"{path.relative_to(REPO)} {use}" for path in SOURCES
           for use in newer_uses(path.read_text(encoding="utf-8"))]
    assert bad == []


def test_the_check_catches_what_it_should() -> None:
    """The scan itself: an unguarded import is found, guarded ones are not."""
    assert newer_uses("import tomllib\n") == ["line 1: tomllib (Python 3.11)"]
    assert newer_uses("from typing import Self\n") == ["line 1: typing.Self (Python 3.11)"]
    assert newer_uses("import hashlib\nhashlib.file_digest(f, 'sha256')\n") == \
        ["line 2: hashlib.file_digest (Python 3.11)"]
    assert newer_uses("import sys\nif sys.version_info >= (3, 11):\n    import tomllib\n"
                      "else:\n    import tomli as tomllib\n") == []
    assert newer_uses("try:\n    import tomllib\nexcept ImportError:\n    import tomli\n") == []
    try:
        ast.parse("def f[T](x: T) -> T: ...\n", feature_version=(3, 10))
    except SyntaxError:
        pass
    else:
        raise AssertionError("feature_version=(3, 10) let 3.12 generics through")
