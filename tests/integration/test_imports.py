"""The import direction of the packages: a module never imports from a layer above its own.

    storage < kernels < model < data < config/extras < parallel < engine < checkpoint, hf
    < infer < train, tasks < ablate < bench, cli, demo

(The model knows nothing of parallelism, engines or training; the engine nothing of the loop;
storage, how any file is written durably or read safely, nothing of the rest.)
"""

from __future__ import annotations

import ast
from pathlib import Path
from support import REPO


LAYERS = [["megabeta.storage"], ["megabeta.kernels"], ["megabeta.model"], ["megabeta.data"],
          ["megabeta.config", "megabeta.config_loader", "megabeta.extras"], ["megabeta.parallel"],
          ["megabeta.engine"],
          ["megabeta.checkpoint", "megabeta.hf"], ["megabeta.infer"],
          ["megabeta.train", "megabeta.tasks"],
          ["megabeta.ablate"],
          ["megabeta.bench", "megabeta.cli", "megabeta.demo", "megabeta.__main__"]]


def _layer(module: str) -> int | None:
    for rank, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return rank
    return None


def _imports(path: Path, module: str) -> list[str]:
    """Absolute names of the megabeta modules `path` imports (also inside functions)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing package
                base = module.split(".")[:-node.level]
                found.append(".".join([*base, node.module] if node.module else base))
            elif node.module:
                found.append(node.module)
    return [name for name in found if name.startswith("megabeta")]


def _modules() -> list[tuple[Path, str]]:
    out = []
    for path in sorted((REPO / "megabeta").rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1] + ["__init__"]
        out.append((path, ".".join(parts)))
    return out


def test_every_module_has_a_layer() -> None:
    unplaced = [m for _, m in _modules() if m != "megabeta.__init__" and _layer(m) is None]
    assert unplaced == []


def test_no_module_imports_upward() -> None:
    upward = []
    for path, module in _modules():
        own = _layer(module)
        for name in _imports(path, module):
            target = _layer(name)
            if own is not None and target is not None and target > own:
                upward.append(f"{module} imports {name}")
    assert upward == []


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The walker finds imports inside functions too (what a lazy upward import looks like)."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from megabeta.train.loop import run\n")
    assert _imports(probe, "megabeta.model.probe") == ["megabeta.train.loop"]
    assert _layer("megabeta.train.loop") > _layer("megabeta.model.probe")
