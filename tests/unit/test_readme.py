"""README.md's install steps are the ones the Makefile runs: the CPU torch from the configured
indexes first (a mirror or a wheel folder) and PyTorch's index only as the fallback, so they
work where that index cannot be reached; and `make venv` is named."""

from __future__ import annotations

import re

from support import REPO


def _makefile_default(name: str) -> str:
    match = re.search(rf"^{name}\s*\?=\s*(\S+)$", (REPO / "Makefile").read_text(), re.M)
    assert match, name
    return match.group(1)


def _install_section() -> str:
    text = (REPO / "README.md").read_text()
    return text[text.index("## Install"):text.index("\n## ", text.index("## Install") + 1)]


def test_the_readme_installs_torch_as_the_makefile_does() -> None:
    section = _install_section()
    torch, index = _makefile_default("TORCH"), _makefile_default("TORCH_INDEX")
    assert "make venv" in section
    lines = [line for line in section.splitlines() if line.lstrip().startswith("pip install")
             and "torch" in line.split("#")[0]]
    # First from the configured indexes, then PyTorch's, both the Makefile's torch.
    assert lines[0].split("#")[0].split() == ["pip", "install", torch, "||"], lines
    assert lines[1].split("#")[0].split() == ["pip", "install", torch, "--index-url", index]
