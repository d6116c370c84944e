"""The sbatch generator: its #SBATCH lines and command, and what the script does when run with
stand-ins for scontrol/srun/torchrun (no SLURM needed; test_cluster_slurm.py runs the scripts on
a real cluster)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO

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
        "-m megabeta.train --config 'configs/my run.toml' --optim.lr=3e-4 "
        "--checkpoint.requeue=true --resume=auto")  # what --requeue asks of the trainer
    assert "RDZV_PORT=$((20000 + SLURM_JOB_ID % 10000))" in script


@pytest.mark.parametrize("train_args, module, added", [
    (["--config", "c.toml"], [], ["--checkpoint.requeue=true", "--resume=auto"]),
    (["--config", "c.toml", "--resume=runs/x/checkpoints/step_00000100"], [],
     ["--checkpoint.requeue=true"]),
    (["--config", "c.toml", "--checkpoint.requeue=false", "--resume", "auto"], [], []),
    (["--config", "c.toml"], ["--module", "my.eval"], []),  # only megabeta.train knows the flags
])
def test_requeue_turns_on_the_trainers_requeue_and_resume(train_args: list[str],
                                                           module: list[str],
                                                           added: list[str]) -> None:
    script, _ = slurm.generate(["--gpus-per-node", "0", "--requeue", *module, "--", *train_args])
    command = re.sub(r"\\\n\s*", "", script).rstrip()
    assert command.endswith(" ".join(train_args + added))
    without, _ = slurm.generate(["--gpus-per-node", "0", *module, "--", *train_args])
    assert re.sub(r"\\\n\s*", "", without).rstrip().endswith(" ".join(train_args))


def test_srun_launcher_runs_one_task_per_rank_without_torchrun() -> None:
    script, _ = slurm.generate(["--nodes", "2", "--gpus-per-node", "4", "--launcher", "srun",
                                "--cpus-per-task", "8", "--", "--config", "c.toml"])
    assert sbatch_lines(script) == ["--job-name=megabeta", "--nodes=2", "--ntasks-per-node=4",
                                    "--gpus-per-node=4", "--cpus-per-task=8",
                                    "--output=%x-%j.out"]
    command = re.sub(r"\\\n\s*", "", script)
    assert 'export MASTER_ADDR="$HEAD_ADDR" MASTER_PORT="$RDZV_PORT"' in command
    assert re.search(r'^srun --nodes="\$SLURM_NNODES" --ntasks-per-node=4 --kill-on-bad-exit=1 '
                     r"--cpus-per-task=8 python3 -m megabeta.train --config c.toml$", command,
                     flags=re.M)
    assert "torchrun" not in command


def test_scripts_pass_bash_syntax_check(tmp_path: Path) -> None:
    for i, argv in enumerate([FULL, ["--gpus-per-node", "0", "--", "--config", "c.toml"],
                              ["--gpus-per-node", "0", "--launcher", "srun", *FULL[-4:]]]):
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
