"""What the tests share: tiny models and data, helpers for multi-process runs and the throwaway
SLURM cluster, and the scripts those runs execute. `tests/` is on the import path (pyproject's
pytest `pythonpath`), so tests import `support.<module>`; the naive reference of spec §3 stays
beside them, `tests/reference_beta12.py`."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository's root."""
SCRIPTS = Path(__file__).resolve().parent / "scripts"
"""Scripts that multi-process tests run (torchrun, mpirun, a stalled rank), that check a model
folder in a process of its own, and that install a test prerequisite (install_apart.py)."""
