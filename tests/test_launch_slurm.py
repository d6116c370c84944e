"""The sbatch generator: its #SBATCH lines and command, and what the script does when run with
stand-ins for scontrol/srun/torchrun (no SLURM needed)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from dist_helpers import free_port, launcher_free_environ, port_is_free

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("launch_slurm", REPO / "launch" / "slurm.py")
slurm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(slurm)

FULL = ["--nodes", "2", "--gpus-per-node", "8", "--cpus-per-task", "32", "--partition", "gpu",
        "--account", "proj7", "--time", "1-00:00:00", "--job-name", "pretrain", "--requeue",
        "--signal-seconds", "300", "--output", "logs/%x-%j.out", "--sbatch=--qos=high",
        "--", "--config", "configs/my run.toml", "--optim.lr=3e-4"]


def sbatch_lines(script: str) -> list[str]:
    return re.findall(r"^#SBATCH (.*)$", script, flags=re.M)


def test_flags_become_sbatch_lines_and_the_torchrun_command() -> None:
    script, _ = slurm.generate(FULL)
    assert sbatch_lines(script) == [
        "--job-name=pretrain", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8",
        "--cpus-per-task=32", "--partition=gpu", "--account=proj7", "--time=1-00:00:00",
        "--output=logs/%x-%j.out", "--requeue", "--signal=USR1@300", "--qos=high"]
    command = re.sub(r"\\\n\s*", "", script)  # join continuation lines
    assert re.search(r"^srun --nodes=\"\$SLURM_NNODES\" --ntasks-per-node=1 .*--cpus-per-task=32 ",
                     command, flags=re.M)
    assert ('torchrun --nnodes="$SLURM_NNODES" --nproc_per_node=8 --rdzv_backend=c10d '
            '--rdzv_endpoint="$HEAD_ADDR:$RDZV_PORT"') in command
    assert command.rstrip().endswith(
        "-m megabeta.train --config 'configs/my run.toml' --optim.lr=3e-4")
    assert "RDZV_PORT=$((20000 + SLURM_JOB_ID % 10000))" in script


def test_scripts_pass_bash_syntax_check(tmp_path: Path) -> None:
    for i, argv in enumerate([FULL, ["--gpus-per-node", "0", "--", "--config", "c.toml"]]):
        path = tmp_path / f"job{i}.sbatch"
        path.write_text(slurm.generate(argv)[0])
        check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr


def test_minimal_cpu_job_requests_nothing_it_was_not_asked_for() -> None:
    script, _ = slurm.generate(["--gpus-per-node", "0", "--port", "29555",
                                "--", "--config", "c.toml"])
    assert sbatch_lines(script) == ["--job-name=megabeta", "--nodes=1", "--ntasks-per-node=1",
                                    "--output=%x-%j.out"]
    assert "--nproc_per_node=1 " in script and "RDZV_PORT=29555\n" in script
    assert "source " not in script and "export " not in script


@pytest.mark.parametrize("text, seconds", [
    ("90", 5400), ("10:30", 630), ("2:00:00", 7200), ("1-12", 129600), ("1-0:30", 88200),
    ("2-00:00:05", 172805), ("UNLIMITED", None),
])
def test_time_limit_formats(text: str, seconds: int | None) -> None:
    assert slurm.time_limit_seconds(text) == seconds


@pytest.mark.parametrize("argv, message", [
    (["--", "--config", "c.toml"], "--gpus-per-node"),
    (["--gpus-per-node", "8"], "no training arguments"),
    (["--gpus-per-node", "8", "--nodes", "0", "--", "x"], "--nodes must be >= 1"),
    (["--gpus-per-node", "8", "--time", "2 hours", "--", "x"], "--time '2 hours'"),
    (["--gpus-per-node", "8", "--time", "2h", "--", "x"], "expected MIN"),
    (["--gpus-per-node", "8", "--time", "5", "--signal-seconds", "300", "--", "x"],
     "--signal-seconds 300 is not before the end of --time 5"),
    (["--gpus-per-node", "8", "--partition", "", "--", "x"], "--partition ''"),
    (["--gpus-per-node", "8", "--env", "1X=2", "--", "x"], "--env '1X=2'"),
    (["--gpus-per-node", "8", "--sbatch=qos=high", "--", "x"], "--sbatch 'qos=high'"),
    (["--gpus-per-node", "8", "--port", "70000", "--", "x"], "--port must be <= 65535"),
    (["--gpus-per-node", "8", "--", "--config", "a\nb"], "line break"),
])
def test_bad_flags_are_refused_by_name(argv: list[str], message: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        slurm.generate(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


FAKE_TORCHRUN = """#!{python}
import json, os, signal, sys
print("TORCHRUN " + json.dumps({{"argv": sys.argv[1:],
    "usr1_ignored": signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN,
    "venv": os.environ.get("VENV_MARK"), "nccl": os.environ.get("NCCL_SOCKET_IFNAME")}}))
"""
FAKE_SRUN = """#!/bin/bash
while [[ "$1" == --* ]]; do echo "SRUN $1"; shift; done
exec "$@"
"""
FAKE_SCONTROL = """#!/bin/bash
case "$1 $2" in
  "show hostnames") [ "$3" = "n[3-4]" ] && printf 'n3\\nn4\\n' ;;
  "show node") echo "NodeName=$3 Arch=x86_64"; echo "   NodeAddr=10.0.0.${3#n} NodeHostName=$3" ;;
esac
"""


def _run_generated(tmp_path: Path, scontrol: str, extra_flags: list[str]) -> tuple[list[str], dict]:
    """Run a generated script with stand-ins on PATH; return srun's options and torchrun's view."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in [("torchrun", FAKE_TORCHRUN.format(python=sys.executable)),
                       ("srun", FAKE_SRUN), ("scontrol", scontrol),
                       ("hostname", "#!/bin/sh\necho batchhost\n")]:
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text("export VENV_MARK=active\n")
    script = tmp_path / "job.sbatch"
    script.write_text(slurm.generate(
        ["--nodes", "2", "--gpus-per-node", "4", "--venv", str(venv),
         "--env", "NCCL_SOCKET_IFNAME=ib0", *extra_flags,
         "--", "--config", "configs/a b.toml", "--train.steps=5"])[0])
    environ = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               "SLURM_JOB_NODELIST": "n[3-4]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "1234"}
    run = subprocess.run(["bash", str(script)], env=environ, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    srun = [line.split(" ", 1)[1] for line in run.stdout.splitlines() if line.startswith("SRUN ")]
    [torchrun] = [json.loads(line.split(" ", 1)[1]) for line in run.stdout.splitlines()
                  if line.startswith("TORCHRUN ")]
    return srun, torchrun


def test_generated_script_resolves_head_address_and_runs_torchrun(tmp_path: Path) -> None:
    srun, torchrun = _run_generated(tmp_path, FAKE_SCONTROL, [])
    assert srun == ["--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert torchrun["argv"] == [
        "--nnodes=2", "--nproc_per_node=4", "--rdzv_backend=c10d",
        "--rdzv_endpoint=10.0.0.3:21234",  # the first node's NodeAddr, port from the job id
        "--rdzv_id=1234", "-m", "megabeta.train", "--config", "configs/a b.toml", "--train.steps=5"]
    assert torchrun["usr1_ignored"], "SIGUSR1 would kill torchrun and the whole step"
    assert (torchrun["venv"], torchrun["nccl"]) == ("active", "ib0")


def test_generated_script_falls_back_to_the_batch_host(tmp_path: Path) -> None:
    _, torchrun = _run_generated(tmp_path, "#!/bin/sh\nexit 1\n", ["--port", "29700"])
    assert "--rdzv_endpoint=batchhost:29700" in torchrun["argv"]


def test_runs_as_a_script_and_writes_an_executable_file(tmp_path: Path) -> None:
    out = tmp_path / "train.sbatch"
    argv = ["--gpus-per-node", "2", "--write", str(out), "--", "--config", "c.toml"]
    run = subprocess.run([sys.executable, str(REPO / "launch" / "slurm.py"), *argv],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "" and f"sbatch {out}" in run.stderr
    assert out.read_text() == slurm.generate(argv)[0]
    assert out.stat().st_mode & stat.S_IXUSR
    assert [p.name for p in tmp_path.iterdir()] == ["train.sbatch"]  # no temporary left behind


# ---------------------------------------------------------------- a real SLURM cluster (opt-in)

SLURM_CONF = """\
ClusterName=megabeta-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=bf_interval=1,sched_interval=2
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
KillWait=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
NodeName=n[1-2] NodeHostname={host} NodeAddr=127.0.0.1 Port=[{node_port}-{node_port_2}] \
CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""

E2E_WORKER = """
import json, os, sys, time
import torch, torch.distributed as dist
from megabeta.parallel.env import init_distributed, destroy_distributed, setup_logging
from megabeta.train.signals import PreemptionHandler, maybe_requeue
out = sys.argv[1]
env = init_distributed("gloo", timeout_s=120)
setup_logging(env)
run = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
total = torch.tensor([float(env.rank + 1)])
dist.all_reduce(total)
with PreemptionHandler() as preempt:
    for step in range(600 if run == 0 else 3):
        time.sleep(0.1)
        if step == 2 and env.rank == 0 and run == 0:
            open(os.path.join(out, "ready"), "w").close()
        if preempt.should_stop():
            break
    record = {"run": run, "rank": env.rank, "world": env.world_size, "sum": total.item(),
              "step": step, "received": preempt.received.name if preempt.received else None}
    with open(os.path.join(out, "results.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\\n")
    if preempt.stopping and maybe_requeue(True) and env.is_rank0:
        with open(os.path.join(out, "results.jsonl"), "a") as f:
            f.write(json.dumps({"run": run, "requeued": True}) + "\\n")
destroy_distributed()
"""


def _wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds} s waiting for {what}")
        time.sleep(0.25)


@pytest.fixture
def slurm_cluster(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A throwaway controller and two slurmd "nodes" on this host; yields the environment to use."""
    if os.environ.get("MEGABETA_SLURM_TESTS") != "1":
        pytest.skip("set MEGABETA_SLURM_TESTS=1 to run against a throwaway local SLURM cluster")
    tools = ("slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo", "squeue")
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.fail(f"MEGABETA_SLURM_TESTS=1 but {', '.join(missing)} not on PATH: install "
                    "slurmctld slurmd slurm-client (Debian)")
    root = tmp_path / "slurm"
    for sub in ("state", "run", "log", "spool-n1", "spool-n2"):
        (root / sub).mkdir(parents=True)
    node_port = free_port(17000, 40000)
    while not port_is_free(node_port + 1):  # slurmd ports form a range
        node_port = free_port(17000, 40000)
    conf = root / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=socket.gethostname(), root=root, ctld_port=free_port(),
                                      node_port=node_port, node_port_2=node_port + 1,
                                      cpus=os.cpu_count()))
    environ = {**launcher_free_environ(SLURM_CONF=str(conf)),
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    try:
        subprocess.run(["slurmctld", "-f", str(conf)], env=environ, check=True, timeout=30)
        for node in ("n1", "n2"):
            subprocess.run(["slurmd", "-f", str(conf), "-N", node], env=environ, check=True,
                           timeout=30)
        _wait_for(lambda: subprocess.run(["sinfo", "-h", "-o", "%T"], env=environ, text=True,
                                         capture_output=True).stdout.split() == ["idle"],
                  30, "both nodes idle")
        yield environ
    finally:
        # Jobs first, then the node daemons, the controller last: a job step that cannot report
        # its end to the controller keeps retrying, and holds its slurmd, forever.
        subprocess.run(["scancel", "--full", "--partition=debug"], env=environ, timeout=30)
        _wait_for(lambda: subprocess.run(["squeue", "-h"], env=environ, text=True,
                                         capture_output=True).stdout.strip() == "", 60, "no jobs")
        for pattern in ("slurmd-*.pid", "slurmctld.pid"):
            for pidfile in (root / "run").glob(pattern):
                os.kill(int(pidfile.read_text()), signal.SIGTERM)
            _wait_for(lambda: not list((root / "run").glob(pattern)), 30, f"{pattern} to go")


@pytest.mark.slow
def test_slurm_job_preempted_by_usr1_saves_and_requeues(slurm_cluster: dict[str, str],
                                                        tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "mb_e2e_worker.py").write_text(E2E_WORKER)
    script = tmp_path / "job.sbatch"
    slurm.main(["--nodes", "2", "--gpus-per-node", "0", "--nproc-per-node", "1", "--requeue",
                "--output", f"{tmp_path}/%j.out", "--sbatch=--open-mode=append",
                "--env", f"PYTHONPATH={work}{os.pathsep}{REPO}", "--module", "mb_e2e_worker",
                "--write", str(script), "--", str(work)])
    submit = subprocess.run(["sbatch", "--parsable", str(script)], env=slurm_cluster, text=True,
                            capture_output=True, timeout=30)
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip()
    results = work / "results.jsonl"

    def records() -> list[dict]:
        lines = results.read_text().splitlines() if results.exists() else []
        return [json.loads(line) for line in lines]

    def log() -> str:
        return (tmp_path / f"{job}.out").read_text() if (tmp_path / f"{job}.out").exists() else ""

    try:
        _wait_for(lambda: (work / "ready").exists(), 90, f"job {job} to start training\n{log()}")
        subprocess.run(["scancel", "--signal=USR1", job], env=slurm_cluster, check=True, timeout=30)
        _wait_for(lambda: sum(r.get("run") == 1 and "rank" in r for r in records()) == 2, 120,
                  f"the requeued run to finish\n{log()}")
    finally:
        subprocess.run(["scancel", job], env=slurm_cluster, timeout=30)
    first = sorted((r for r in records() if r["run"] == 0 and "rank" in r), key=lambda r: r["rank"])
    assert [r["rank"] for r in first] == [0, 1] and all(r["sum"] == 3.0 for r in first), records()
    assert first[0]["step"] == first[1]["step"] < 599  # one decision, same step, early
    assert [r["received"] for r in first] == ["SIGUSR1", "SIGUSR1"]  # torchrun survived it
    assert {"run": 0, "requeued": True} in records()
    second = [r for r in records() if r["run"] == 1 and "rank" in r]
    assert all(r["step"] == 2 and r["received"] is None for r in second), records()
    assert "SIGUSR1 received: stopping at this step boundary" in log()
