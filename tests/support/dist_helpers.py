"""Helpers shared by the multi-process launcher tests: a clean environment, free ports, and
per-rank report files."""

from __future__ import annotations

import json
import os
import random
import socket
from pathlib import Path

from support import REPO


_LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "TORCHELASTIC_")
_LAUNCHER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                   "MASTER_PORT", "GROUP_RANK", "ROLE_RANK"}


def launcher_free_environ(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables (so a test run under srun or
    torchrun still starts its children clean), the repo importable, plus `extra`."""
    environ = {k: v for k, v in os.environ.items()
               if k not in _LAUNCHER_NAMES and not k.startswith(_LAUNCHER_PREFIXES)}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), environ.get("PYTHONPATH")]))
    environ["OMP_NUM_THREADS"] = "1"
    return {**environ, **extra}


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(low: int = 1024, high: int = 65535) -> int:
    """A port in [low, high) nobody listens on right now."""
    for _ in range(200):
        port = random.randrange(low, high)
        if port_is_free(port):
            return port
    raise RuntimeError(f"no free port in [{low}, {high})")


# Worker scripts get a results directory as their first argument and report through one file per
# rank: lines the ranks print to a shared stdout can interleave.
REPORT = """
import json, os, sys
def report(record):
    path = os.path.join(sys.argv[1], f"rank{record['rank']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)
"""

def read_reports(directory: Path) -> list[dict]:
    """The ranks' reports, in rank order."""
    return [json.loads(p.read_text()) for p in sorted(directory.glob("rank*.json"))]
