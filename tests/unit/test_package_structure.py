"""The package's boundaries (docs/architecture.md, "The model package in one picture"): no
import cycle, parallelisms that know no model class, and a ceiling on hand-written gradients."""

from __future__ import annotations

import ast
from pathlib import Path

from support import REPO

PACKAGE = REPO / "megabeta"

CUSTOM_BACKWARDS_CEILING = 8
"""Custom backward implementations in megabeta/model and megabeta/kernels (autograd Functions
plus `register_autograd` calls). Each is a gradient written by hand that every new capability
must extend; the count may go down, never up."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Every megabeta module `path` imports: at module level, inside functions and under
    `if TYPE_CHECKING:` alike (an annotation-only or deferred import is still a dependency)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in modules and m != name}


def _import_graph() -> dict[str, set[str]]:
    paths = [p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts]
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) for p in paths}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (a package's `__init__` importing its own submodules is
    not one: importing the submodule imports the package first, by design)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def edges(node: str) -> set[str]:
        return {m for m in graph[node] if not node.startswith(m + ".")}

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges(node)):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_graph_has_no_cycle() -> None:
    """Counting every import (`_imports`): no module imports upward."""
    graph = _import_graph()
    assert "megabeta.model.beta12" in graph and graph["megabeta.model.beta12"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_inner_imports_are_seen() -> None:
    """`megabeta lm-eval` imports the harness's module inside a function: the graph has it."""
    assert "megabeta.infer.lm_eval" in _import_graph()["megabeta.infer.cli"]


def test_the_cycle_finder_finds_one() -> None:
    """The check above can fail: a cycle planted in a copy of the graph is reported, and an
    import inside a function or under `if TYPE_CHECKING:` counts."""
    graph = _import_graph()
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
              "    from megabeta.model import beta12\n"
              "def f():\n    import megabeta.model.layers\n")
    planted = REPO / "megabeta" / "model" / "_planted_for_test.py"
    try:
        planted.write_text(source)
        assert _imports(planted, set(graph)) == {"megabeta.model", "megabeta.model.beta12",
                                                 "megabeta.model.layers"}
    finally:
        planted.unlink()
    graph["megabeta.model.layers"] = graph["megabeta.model.layers"] | {"megabeta.model.beta12"}
    cycle = _cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1] and "megabeta.model.layers" in cycle


def test_parallelisms_know_no_model_class() -> None:
    """parallel/ applies what an arm declares (`DecoderLM.parallel_plan`), not per class."""
    arms = {"Beta12Transformer", "StandardTransformer", "LoopedTransformer"}
    for path in (PACKAGE / "parallel").rglob("*.py"):
        names = {n.id for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Name)}
        names |= {a.name for n in ast.walk(ast.parse(path.read_text()))
                  if isinstance(n, ast.ImportFrom) for a in n.names}
        assert not names & arms, f"{path} names {names & arms}"


def _custom_backwards() -> list[str]:
    found = []
    for folder in ("model", "kernels"):
        for path in (PACKAGE / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and any(
                        ast.unparse(b).endswith("autograd.Function") for b in node.bases):
                    found.append(f"{path.name}:{node.name}")
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                      and node.func.attr == "register_autograd"):
                    found.append(f"{path.name}:{ast.unparse(node.func.value)}")
    return sorted(found)


def test_hand_written_gradients_do_not_grow() -> None:
    found = _custom_backwards()
    assert any(f.endswith(":_ByHandLinear") for f in found), found  # the scan sees them
    assert len(found) <= CUSTOM_BACKWARDS_CEILING, "\n".join(found)
