"""Install a requirement apart from the virtual environment, as the oldest triton is: into a
folder of its own (`pip install --target`), with exactly what it needs that the environment
lacks or has at a version it refuses, as pip resolves it against the environment.

    python install_apart.py FOLDER REQUIREMENT      (make test: .venv/transformers-5)

A child process that puts FOLDER first on PYTHONPATH then imports the requirement from there and
everything else from the environment (tests/unit/hf/test_hf_transformers5.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path


def main(folder: str, requirement: str) -> int:
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--dry-run",
                        "--report", str(report), requirement], check=True)
        needed = [f"{item['metadata']['name']}=={item['metadata']['version']}"
                  for item in json.loads(report.read_text())["install"]]
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                    folder, *needed], check=True)
    print(f"installed into {folder}: {' '.join(needed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
