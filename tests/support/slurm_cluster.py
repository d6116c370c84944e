"""A throwaway SLURM cluster on this host: one controller and two slurmd "nodes" (n1, n2), private
ports and directories, torn down even when a test fails. Facts: shared/guide/environment.md."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from support.dist_helpers import free_port, launcher_free_environ, port_is_free

REQUIRE_VARIABLE = "MEGABETA_REQUIRE_SLURM"
"""Set to 1 (CI does) to fail instead of skip when SLURM cannot run here."""

TOOLS = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo", "squeue")

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


def wait_for(condition: Callable[[], bool], seconds: float, what: Callable[[], str] | str) -> None:
    """Poll `condition` until true; AssertionError naming `what` after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            detail = what() if callable(what) else what
            raise AssertionError(f"timed out after {seconds} s waiting for {detail}")
        time.sleep(0.25)


def unavailable() -> str | None:
    """Why a local cluster cannot run here, or None."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return (f"{', '.join(missing)} not on PATH: install Debian's slurmctld slurmd "
                "slurm-client to run the SLURM tests")
    if os.geteuid() != 0:
        return "the throwaway SLURM daemons run as root; run the SLURM tests as root"
    return None


def require_cluster() -> None:
    """Skip (or, under MEGABETA_REQUIRE_SLURM=1, fail) when no cluster can run here."""
    reason = unavailable()
    if reason is None:
        return
    if os.environ.get(REQUIRE_VARIABLE) == "1":
        pytest.fail(f"{REQUIRE_VARIABLE}=1 but {reason}")
    pytest.skip(reason)


class Cluster:
    """The running cluster: its environment, and jobs submitted to it."""

    def __init__(self, root: Path, environ: dict[str, str]) -> None:
        self.root, self.environ = root, environ

    def run(self, *command: str, check: bool = True) -> str:
        done = subprocess.run(command, env=self.environ, capture_output=True, text=True,
                              timeout=60)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(command)} exited {done.returncode}: "
                                 f"{done.stderr.strip()}\n{self.logs()}")
        return done.stdout

    def submit(self, script: Path, cwd: Path) -> str:
        done = subprocess.run(["sbatch", "--parsable", str(script)], env=self.environ,
                              cwd=cwd, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().split(";")[0]

    def job(self, job: str) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, Restarts, ExitCode, ...)."""
        text = self.run("scontrol", "show", "job", "-o", job, check=False)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_done(self, job: str, seconds: float, log: Path) -> dict[str, str]:
        """Wait until `job` has ended (not pending, running, requeued or completing)."""
        busy = {"PENDING", "RUNNING", "REQUEUED", "COMPLETING", "CONFIGURING", "REQUEUE_HOLD",
                "REQUEUE_FED", "SUSPENDED", ""}
        wait_for(lambda: self.job(job).get("JobState", "") not in busy, seconds,
                 lambda: f"job {job} to end ({self.job(job).get('JobState')})\n"
                         f"{_tail(log)}\n{self.logs()}")
        return self.job(job)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{_tail(p)}" for p in sorted((self.root / "log").glob("*")))


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else f"({path} not written)"


@contextmanager
def local_cluster(root: Path) -> Iterator[Cluster]:
    """Start the controller and both nodes under `root`; tear everything down on exit."""
    for sub in ("state", "run", "log", "spool-n1", "spool-n2"):
        (root / sub).mkdir(parents=True)
    node_port = free_port(17000, 40000)
    while not port_is_free(node_port + 1):  # slurmd ports form a range
        node_port = free_port(17000, 40000)
    conf = root / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=socket.gethostname(), root=root, ctld_port=free_port(),
                                      node_port=node_port, node_port_2=node_port + 1,
                                      cpus=os.cpu_count()))
    environ = launcher_free_environ(SLURM_CONF=str(conf))  # PATH: conftest.py's
    cluster = Cluster(root, environ)
    try:
        subprocess.run(["slurmctld", "-f", str(conf)], env=environ, check=True, timeout=30)
        for node in ("n1", "n2"):
            subprocess.run(["slurmd", "-f", str(conf), "-N", node], env=environ, check=True,
                           timeout=30)
        wait_for(lambda: subprocess.run(["sinfo", "-h", "-o", "%T"], env=environ, text=True,
                                        capture_output=True).stdout.split() == ["idle"],
                 30, lambda: f"both nodes idle\n{cluster.logs()}")
        yield cluster
    finally:
        # Jobs first, then the node daemons, the controller last: a job step that cannot report
        # its end to the controller keeps retrying, and holds its slurmd, forever.
        if (root / "run" / "slurmctld.pid").exists():
            subprocess.run(["scancel", "--full", "--partition=debug"], env=environ, timeout=30)
            wait_for(lambda: subprocess.run(["squeue", "-h"], env=environ, text=True,
                                            capture_output=True).stdout.strip() == "", 60,
                     "no jobs")
        for pattern in ("slurmd-*.pid", "slurmctld.pid"):
            for pidfile in (root / "run").glob(pattern):
                os.kill(int(pidfile.read_text()), signal.SIGTERM)
            wait_for(lambda: not list((root / "run").glob(pattern)), 30, f"{pattern} to go")
