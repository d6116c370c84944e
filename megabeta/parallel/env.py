"""Who this process is in the job, whatever started it, and the process group built on that.

Launchers describe a job in different variables: torchrun sets RANK/WORLD_SIZE/LOCAL_*, plain
``srun`` sets SLURM_* (and no LOCAL_WORLD_SIZE, MASTER_ADDR or MASTER_PORT), mpirun sets
OMPI_COMM_WORLD_* or PMI_*. `discover` reads whichever is there into one `DistEnv`, so training
code never looks at the launcher again. Precedence, and why:

1. torchrun's variables: torchrun inside srun or mpirun is common, and the inner launcher is the one
   whose ranks the processes are.
2. mpirun's (OMPI_COMM_WORLD_*, then PMI_*): mpirun inside an sbatch script inherits the batch
   shell's SLURM_PROCID=0, which is the same stale value on every rank.
3. SLURM's, for a task of an ``srun`` step (SLURM_STEP_ID set). The batch shell itself also carries
   SLURM_PROCID/SLURM_NTASKS, but it is one process, not N tasks.
4. mpi4py, only when an MPI launch is hinted (PMIX_RANK, PMI_FD, ...) or the program already
   imported ``mpi4py.MPI``: initialising MPI in a plain process can abort on some systems.
5. A single process.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

DEFAULT_PORT = 29500
"""Rendezvous port of a single process (unused) and torchrun's own default."""

SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 10000
"""Ports derived from SLURM_JOB_ID fall in [20000, 30000): unprivileged and below Linux's
ephemeral range (32768+), so an outgoing connection will not have taken it."""

_MPI_LAUNCH_HINTS = ("PMIX_RANK", "PMI_FD", "MV2_COMM_WORLD_RANK", "ALPS_APP_PE")


class DistEnvError(RuntimeError):
    """The launcher's variables are missing or contradict each other; the message names them."""


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, independent of the launcher that started it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str
    """"torchrun", "slurm", "mpi" or "single"."""
    local_rank_name: str = field(default="local rank", compare=False, repr=False)
    """Where `local_rank` came from ("LOCAL_RANK", "SLURM_LOCALID", ...), for error messages."""
    local_world_name: str = field(default="local world size", compare=False, repr=False)
    """Where `local_world_size` came from ("LOCAL_WORLD_SIZE", "SLURM_TASKS_PER_NODE", ...)."""

    @property
    def is_rank0(self) -> bool:
        """Rank 0 logs, writes shared files and talks to the scheduler."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        """More than one process: a process group is needed."""
        return self.world_size > 1


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand SLURM's compressed host list ("gpu[01-03,07],cpu5") in order, without `scontrol`.

    Zero padding follows the lower bound ("[08-10]" gives 08, 09, 10) and several bracket groups
    in one name give their product ("r[1-2]n[1-2]" gives r1n1, r1n2, r2n1, r2n2), as in SLURM.
    Raises ValueError on malformed text.
    """
    hosts: list[str] = []
    for item in _split_top_level(hostlist):
        pieces = re.split(r"\[([^\[\]]*)\]", item)
        choices = [[p] if i % 2 == 0 else _expand_ranges(p) for i, p in enumerate(pieces)]
        hosts.extend("".join(parts) for parts in itertools.product(*choices))
    return hosts


def _split_top_level(hostlist: str) -> list[str]:
    """Split at commas outside brackets, checking the brackets pair up and do not nest."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(hostlist):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' at position {i} in host list {hostlist!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"']' without '[' at position {i} in host list {hostlist!r}")
        elif ch == "," and depth == 0:
            items.append(hostlist[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unclosed '[' in host list {hostlist!r}")
    items.append(hostlist[start:])
    if any(not item.strip() or item != item.strip() for item in items):
        raise ValueError(f"empty name or stray blank in host list {hostlist!r}")
    return items


def _expand_ranges(ranges: str) -> list[str]:
    """"01-03,07" -> ["01", "02", "03", "07"]."""
    out: list[str] = []
    for token in ranges.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", token)
        if m is None:
            raise ValueError(f"bad range {token!r} in '[{ranges}]': expected N or N-M with digits")
        lo, hi = int(m[1]), int(m[2] if m[2] is not None else m[1])
        if hi < lo:
            raise ValueError(f"range {token!r} in '[{ranges}]' runs backwards")
        out.extend(str(n).zfill(len(m[1])) for n in range(lo, hi + 1))
    return out


def expand_tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM's tasks-per-node list ("2(x3),1" gives [2, 2, 2, 1]); ValueError if bad."""
    counts: list[int] = []
    for token in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", token.strip())
        if m is None:
            raise ValueError(f"bad entry {token!r} in {spec!r}: expected N or N(xK)")
        counts.extend([int(m[1])] * int(m[2] or 1))
    return counts


def slurm_port(job_id: int) -> int:
    """Rendezvous port every task of a job derives alike from its id, so none has to be agreed."""
    return SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN


def discover(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read rank, world and rendezvous address from the launcher's variables (see module doc).

    `environ` defaults to `os.environ`. Under mpirun without MASTER_ADDR/MASTER_PORT this is a
    collective over MPI (rank 0 broadcasts its address and a free port): call it on every rank.
    Raises DistEnvError naming the variables when they are missing or inconsistent.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        return _from_torchrun(env)
    if "OMPI_COMM_WORLD_RANK" in env:
        return _from_openmpi(env)
    if "PMI_RANK" in env and env.get("SLURM_PROCID") != env["PMI_RANK"]:
        # Equal values mean srun started us directly with a PMI plugin: SLURM's variables say more.
        return _from_pmi(env)
    if "SLURM_PROCID" in env and _in_srun_step(env):
        return _from_slurm(env)
    if _mpi_launch_hinted(env):
        found = _from_mpi4py(env)
        if found is not None:
            return found
    return _checked("single", 0, 1, 0, 1,
                    addr=_need(env, "MASTER_ADDR", 1), port=_need_port(env, 1))


def _in_srun_step(env: Mapping[str, str]) -> bool:
    return "SLURM_STEP_ID" in env or "SLURM_STEPID" in env


def _from_torchrun(env: Mapping[str, str]) -> DistEnv:
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    missing = [n for n in names if n not in env]
    if missing:
        present = [n for n in names if n in env]
        raise DistEnvError(
            f"incomplete torchrun variables: {', '.join(present)} set but not "
            f"{', '.join(missing)}. torchrun sets all four; set the missing ones, or unset RANK "
            "and WORLD_SIZE so the srun/mpirun variables are used."
        )
    rank, world, local_rank, local_world = (_int(env, n) for n in names)
    return _checked("torchrun", rank, world, local_rank, local_world, *names,
                    addr=_need(env, "MASTER_ADDR", world), port=_need_port(env, world))


def _from_openmpi(env: Mapping[str, str]) -> DistEnv:
    names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
             "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
    rank, world, local_rank, local_world = (_int(env, n) for n in names)
    return _with_mpi_master(env, rank, world, local_rank, local_world, names)


def _from_pmi(env: Mapping[str, str]) -> DistEnv:
    rank, world = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
    local_rank_name = _first_present(env, "MPI_LOCALRANKID", "PMI_LOCAL_RANK")
    local_size_name = _first_present(env, "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE")
    if local_rank_name and local_size_name:
        local_rank, local_world = _int(env, local_rank_name), _int(env, local_size_name)
    else:
        comm = _mpi_comm()
        if comm is None:
            raise DistEnvError(
                "PMI_RANK/PMI_SIZE are set but not the local rank (MPI_LOCALRANKID or "
                "PMI_LOCAL_RANK, with MPI_LOCALNRANKS or PMI_LOCAL_SIZE), and mpi4py is not "
                "usable to find it: install mpi4py or launch with torchrun."
            )
        local_rank, local_world = _mpi_local(comm)
        local_rank_name, local_size_name = "node-local rank (mpi4py)", "node-local size (mpi4py)"
    names = ("PMI_RANK", "PMI_SIZE", local_rank_name, local_size_name)
    return _with_mpi_master(env, rank, world, local_rank, local_world, names)


def _from_slurm(env: Mapping[str, str]) -> DistEnv:
    rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    local_rank = _int(env, "SLURM_LOCALID")
    local_world, local_world_name = _slurm_local_world(env)
    addr = env.get("MASTER_ADDR")
    if not addr:
        # A step's task 0 runs on the step's first node, which is the job's first only when the
        # step spans the whole job: prefer the step's own list.
        name = _first_present(env, "SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
        if name is None:
            raise DistEnvError("none of MASTER_ADDR, SLURM_STEP_NODELIST, SLURM_NODELIST or "
                               "SLURM_JOB_NODELIST is set: cannot tell where rank 0 runs")
        try:
            addr = expand_hostlist(env[name])[0]
        except ValueError as err:
            raise DistEnvError(f"{name}={env[name]!r}: {err}") from None
    if "MASTER_PORT" in env:
        port = _port(env, "MASTER_PORT")
    elif "SLURM_JOB_ID" in env:
        port = slurm_port(_int(env, "SLURM_JOB_ID"))
    else:
        raise DistEnvError("neither MASTER_PORT nor SLURM_JOB_ID is set: "
                           "cannot pick a rendezvous port")
    return _checked("slurm", rank, world, local_rank, local_world,
                    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", local_world_name,
                    addr=addr, port=port)


def _slurm_local_world(env: Mapping[str, str]) -> tuple[int, str]:
    """Tasks on this node: plain srun sets no LOCAL_WORLD_SIZE, so read SLURM's per-node layout."""
    list_name = _first_present(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    counts: list[int] = []
    if list_name is not None:
        try:
            counts = expand_tasks_per_node(env[list_name])
        except ValueError as err:
            raise DistEnvError(f"{list_name}={env[list_name]!r}: {err}") from None
        if "SLURM_NODEID" in env:
            node = _int(env, "SLURM_NODEID")
            if node >= len(counts):
                raise DistEnvError(f"SLURM_NODEID={node} but {list_name}={env[list_name]!r} "
                                   f"describes only {len(counts)} node(s)")
            return counts[node], list_name
    if "SLURM_NTASKS_PER_NODE" in env:
        return _int(env, "SLURM_NTASKS_PER_NODE"), "SLURM_NTASKS_PER_NODE"
    if counts and len(set(counts)) == 1:
        return counts[0], list_name
    raise DistEnvError(
        "cannot tell how many tasks run on this node: set SLURM_NTASKS_PER_NODE, or "
        "SLURM_TASKS_PER_NODE together with SLURM_NODEID (srun sets both)"
        + (f"; {list_name}={env[list_name]!r} is uneven" if counts else "")
    )


def _from_mpi4py(env: Mapping[str, str]) -> DistEnv | None:
    """The job as MPI itself sees it, for MPI launchers whose variables are not read above."""
    comm = _mpi_comm()
    if comm is None or comm.Get_size() == 1:
        return None
    local_rank, local_world = _mpi_local(comm)
    names = ("MPI rank (mpi4py)", "MPI size (mpi4py)",
             "node-local rank (mpi4py)", "node-local size (mpi4py)")
    return _with_mpi_master(env, comm.Get_rank(), comm.Get_size(), local_rank, local_world, names)


def _with_mpi_master(env: Mapping[str, str], rank: int, world: int, local_rank: int,
                     local_world: int, names: tuple[str, ...]) -> DistEnv:
    """Fill in the rendezvous address MPI launchers do not set: rank 0's, broadcast over MPI."""
    _checked("mpi", rank, world, local_rank, local_world, *names, addr="", port=DEFAULT_PORT)
    addr = env.get("MASTER_ADDR") or None
    port = _port(env, "MASTER_PORT") if "MASTER_PORT" in env else None
    if addr is None and local_world == world:
        addr = "127.0.0.1"  # every rank is on this node
    if addr is None or port is None:
        comm = _mpi_comm()
        if comm is None:
            raise DistEnvError(
                f"{names[0]}/{names[1]} are set but not MASTER_ADDR/MASTER_PORT, and mpi4py is not "
                "usable to agree on them: export MASTER_ADDR=<rank 0's host> MASTER_PORT=29500 "
                "(mpirun -x passes them on) or install mpi4py with an MPI library."
            )
        if comm.Get_size() != world or comm.Get_rank() != rank:
            raise DistEnvError(
                f"{names[0]}={rank}, {names[1]}={world} but MPI says rank {comm.Get_rank()} of "
                f"{comm.Get_size()}: the variables are stale (inherited from an outer launcher?)"
            )
        proposal = (addr or socket.gethostname(), port or _free_port()) if rank == 0 else None
        addr, port = comm.bcast(proposal, root=0)
    return _checked("mpi", rank, world, local_rank, local_world, *names, addr=addr, port=port)


def _mpi_launch_hinted(env: Mapping[str, str]) -> bool:
    return "mpi4py.MPI" in sys.modules or any(name in env for name in _MPI_LAUNCH_HINTS)


def _mpi_comm() -> Any:
    """mpi4py's COMM_WORLD, or None when mpi4py or its MPI library is missing (both optional)."""
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError):
        return None
    return MPI.COMM_WORLD


def _mpi_local(comm: Any) -> tuple[int, int]:
    """Rank and size among the processes sharing this node's memory."""
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return local.Get_rank(), local.Get_size()
    finally:
        local.Free()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _first_present(env: Mapping[str, str], *names: str) -> str | None:
    return next((n for n in names if n in env), None)


def _int(env: Mapping[str, str], name: str) -> int:
    if name not in env:
        raise DistEnvError(f"{name} is not set")
    try:
        return int(env[name])
    except ValueError:
        raise DistEnvError(f"{name}={env[name]!r} is not an integer") from None


def _port(env: Mapping[str, str], name: str) -> int:
    port = _int(env, name)
    if not 1 <= port <= 65535:
        raise DistEnvError(f"{name}={port} is not a TCP port (1-65535)")
    return port


def _need(env: Mapping[str, str], name: str, world: int) -> str:
    if env.get(name):
        return env[name]
    if world > 1:
        raise DistEnvError(f"{name} is not set but WORLD_SIZE={world}: set it to rank 0's address")
    return "127.0.0.1"


def _need_port(env: Mapping[str, str], world: int) -> int:
    if "MASTER_PORT" in env:
        return _port(env, "MASTER_PORT")
    if world > 1:
        raise DistEnvError(f"MASTER_PORT is not set but WORLD_SIZE={world}: set a free port")
    return DEFAULT_PORT


def _checked(launcher: str, rank: int, world: int, local_rank: int,
             local_world: int, rank_name: str = "rank", world_name: str = "world size",
             local_rank_name: str = "local rank", local_world_name: str = "local world size",
             *, addr: str, port: int) -> DistEnv:
    """Build the DistEnv, refusing numbers that cannot describe a real job."""
    def bad(what: str) -> DistEnvError:
        return DistEnvError(f"inconsistent {launcher} variables: {what}")

    if world < 1:
        raise bad(f"{world_name}={world} must be >= 1")
    if not 0 <= rank < world:
        raise bad(f"{rank_name}={rank} must be in [0, {world_name}={world})")
    if not 1 <= local_world <= world:
        raise bad(f"{local_world_name}={local_world} must be in [1, {world_name}={world}]")
    if not 0 <= local_rank < local_world:
        raise bad(f"{local_rank_name}={local_rank} must be in "
                  f"[0, {local_world_name}={local_world})")
    return DistEnv(rank, world, local_rank, local_world, addr, port, launcher,
                   local_rank_name, local_world_name)


_active: DistEnv | None = None
_exported: list[str] = []
"""The variables `init_distributed` set for a one-rank group, which `destroy_distributed` unsets."""


def init_distributed(backend: str = "auto", timeout_s: float = 600,
                     group_for_one: bool = False) -> DistEnv:
    """Discover this process's place and, for more than one process, join the process group.

    The rendezvous goes through env:// with the discovered values exported (MASTER_ADDR,
    MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), so libraries that read them later
    (DeepSpeed, DCP) agree. backend "auto" means nccl when CUDA is available, else gloo; with nccl
    the process's GPU is selected first, by `choose_device` (the trainer's choice too, so the
    group and the model use the same GPU). Calling again returns the same DistEnv.
    `group_for_one` starts a one-rank group for a single process too (FSDP2, DDP and DeepSpeed
    need one), over an in-memory store.
    """
    global _active
    group_up = dist.is_available() and dist.is_initialized()
    # Cached, unless a one-rank group is asked for now that an earlier caller went without.
    if _active is not None and (group_up or not (_active.is_distributed or group_for_one)):
        return _active
    env = discover()
    if group_up:  # somebody else started the group: accept it if it agrees with the launcher
        if (env.rank, env.world_size) != (dist.get_rank(), dist.get_world_size()):
            raise DistEnvError(
                f"the process group is rank {dist.get_rank()} of {dist.get_world_size()} but "
                f"the {env.launcher} variables say rank {env.rank} of {env.world_size}"
            )
        _active = env
        return env
    if env.world_size == 1:
        _warn_if_batch_shell(os.environ)
        if group_for_one:
            # Libraries (DeepSpeed) read these; `destroy_distributed` takes back the ones set
            # here, or a later library in this process (accelerate) would rendezvous by them.
            one_rank = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
            _exported.extend(name for name in one_rank if name not in os.environ)
            for name in _exported:
                os.environ[name] = one_rank[name]
            backend = _resolve_backend(backend)
            if backend == "nccl":
                torch.cuda.set_device(_nccl_device(env))
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0,
                                    world_size=1, timeout=timedelta(seconds=timeout_s))
    else:
        if not dist.is_available():
            raise DistEnvError(f"world size {env.world_size} needs torch.distributed, "
                               "which this torch build lacks")
        backend = _resolve_backend(backend)
        if backend == "nccl":
            torch.cuda.set_device(_nccl_device(env))
        os.environ.update(
            MASTER_ADDR=env.master_addr, MASTER_PORT=str(env.master_port), RANK=str(env.rank),
            WORLD_SIZE=str(env.world_size), LOCAL_RANK=str(env.local_rank),
            LOCAL_WORLD_SIZE=str(env.local_world_size),
        )
        dist.init_process_group(backend=backend, init_method="env://", rank=env.rank,
                                world_size=env.world_size, timeout=timedelta(seconds=timeout_s))
        if env.is_rank0:
            log.info("process group up: %d ranks via %s, backend %s, rendezvous %s:%d",
                     env.world_size, env.launcher, backend, env.master_addr, env.master_port)
    _active = env
    return env


def _warn_if_batch_shell(env: Mapping[str, str]) -> None:
    """A batch script running the trainer without srun gets one process, not the tasks asked for."""
    if "SLURM_PROCID" in env and not _in_srun_step(env) and env.get("SLURM_NTASKS", "1") != "1":
        log.warning("SLURM_NTASKS=%s but this process is the batch shell's, not an srun task: "
                    "running as a single process; start the trainer with srun "
                    "(see launch/README.md)",
                    env["SLURM_NTASKS"])


def _resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise DistEnvError("backend 'nccl' needs CUDA, which is not available: "
                           "use 'gloo' or 'auto'")
    return backend


def choose_device(env: DistEnv, cuda_count: int | None = None,
                  visible: str | None = None) -> torch.device:
    """The device this rank computes on; `init_distributed` selects the same one for nccl.

    `cuda_count` defaults to torch.cuda.device_count() (0 without CUDA), `visible` to
    CUDA_VISIBLE_DEVICES. One function for the trainer and the process group, because the answer
    is not always ``cuda:<local rank>``:

    - no GPU visible (none present, or CUDA_VISIBLE_DEVICES=""): cpu;
    - at least one GPU per rank on the node (count >= local world size): ``cuda:<local rank>``
      (torchrun, mpirun, plain srun on a node whose GPUs every task sees);
    - exactly one GPU visible: ``cuda:0``. ``srun --gpus-per-task=1`` (or a wrapper setting
      CUDA_VISIBLE_DEVICES per rank) shows each task only its own GPU, which CUDA numbers 0
      whatever its physical index and whatever SLURM_LOCALID is; ``cuda:<local rank>`` would not
      exist there.
    - otherwise (several GPUs, but fewer than the ranks on this node) DistEnvError. This is
      checked against the local world size, not just this rank's local rank, so every rank of the
      node fails alike instead of the low ranks going on to wait for the others in a collective.
    """
    if cuda_count is None:
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cuda_count <= 0 or (visible is not None and not visible.strip()):
        return torch.device("cpu")
    if cuda_count >= env.local_world_size:
        return torch.device("cuda", env.local_rank)
    if cuda_count == 1:
        return torch.device("cuda", 0)
    shown = "unset" if visible is None else repr(visible)
    raise DistEnvError(
        f"{env.local_rank_name}={env.local_rank} with {env.local_world_size} ranks on this node "
        f"(from {env.local_world_name}), but only {cuda_count} GPUs are visible "
        f"(CUDA_VISIBLE_DEVICES={shown}): launch at most one rank per visible GPU "
        f"(e.g. torchrun --nproc_per_node={cuda_count}, srun --ntasks-per-node={cuda_count}), "
        "or give each rank its own GPU (srun --gpus-per-task=1, or set CUDA_VISIBLE_DEVICES "
        "per rank)"
    )


def _nccl_device(env: DistEnv) -> torch.device:
    """`choose_device`, which nccl needs to be a GPU."""
    device = choose_device(env)
    if device.type != "cuda":
        raise DistEnvError("backend 'nccl' needs a GPU but none is visible "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): "
                           "use 'gloo' or 'auto'")
    return device


def destroy_distributed() -> None:
    """Leave the process group (if any), so a clean exit does not hang or warn, and unset the
    variables set for a one-rank group."""
    global _active
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _active = None
    while _exported:
        os.environ.pop(_exported.pop(), None)
