"""The package's boundaries (docs/architecture.md, "The model package in one picture"): no
import cycle, parallelisms that know no model class, and a ceiling on hand-written gradients."""

from __future__ import annotations

import ast
from pathlib import Path

from support import REPO

PACKAGE = REPO / "megabeta"

CUSTOM_BACKWARDS_CEILING = 10
"""Custom backward implementations in megabeta/model and megabeta/kernels (autograd Functions
plus `register_autograd` calls). Each is a gradient written by hand that every new capability
must extend; the count may go down, never up."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level_imports(path: Path, modules: set[str]) -> set[str]:
    """The megabeta modules `path` imports when it is imported (not inside functions, not under
    `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and not _is_type_checking(node):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
            else:
                found.update(_imported(node, package))

    visit(tree.body)
    return {m for m in found if m in modules and m != name}


def _imported(node: ast.AST, package: str) -> set[str]:
    """The modules (and names, as `module.name`) an import statement of `package` names."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    if not isinstance(node, ast.ImportFrom):
        return set()
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    return {base} | {f"{base}.{a.name}" for a in node.names}


def _every_import(path: Path, modules: set[str]) -> set[str]:
    """The megabeta modules `path` imports anywhere: at module level, under `if TYPE_CHECKING:`
    and inside functions."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = {m for node in ast.walk(tree) for m in _imported(node, package)}
    return {m for m in found if m in modules and m != name}


def _import_graph(imports=_module_level_imports) -> dict[str, set[str]]:
    paths = [p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts]
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): imports(p, modules) for p in paths}


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
    graph = _import_graph()
    assert "megabeta.model.beta12" in graph and graph["megabeta.model.beta12"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_no_cycle_through_imports_in_functions_or_for_typing() -> None:
    """An import inside a function or under TYPE_CHECKING closes a cycle as surely as one at the
    top (`megabeta.infer.cli` and `megabeta.infer.lm_eval` once imported each other so). Checked
    outside `megabeta.model`, whose typing-only imports between the arm and its schedules are
    that package's own."""
    graph = {name: {m for m in imports if not m.startswith("megabeta.model")}
             for name, imports in _import_graph(_every_import).items()
             if not name.startswith("megabeta.model")}
    assert "megabeta.infer.lm_eval" in graph["megabeta.infer.cli"]  # the scan sees inner imports
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_one() -> None:
    """The check above can fail: a cycle planted in a copy of the graph is reported."""
    graph = _import_graph()
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
    assert any(f.endswith(":_Publish") for f in found), found  # the scan sees them
    assert len(found) <= CUSTOM_BACKWARDS_CEILING, "\n".join(found)
