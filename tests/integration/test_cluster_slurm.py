"""The trainer on a real SLURM cluster (two slurmd "nodes" on this host, tests/support/slurm_cluster.py):
jobs written by launch/slurm.py train with `megabeta.train` like torchrun does, bit for bit;
preempted by SIGUSR1 they save, requeue and finish like an uninterrupted run; DeepSpeed ZeRO-1 and
a plain srun launch (no torchrun) work the same way. Skipped with a message where SLURM cannot run;
CI (MEGABETA_REQUIRE_SLURM=1) fails instead."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.slurm_cluster import Cluster, local_cluster, require_cluster, wait_for
from support.train_helpers import REPO, TINY, launch, losses, train_records

_spec = importlib.util.spec_from_file_location("launch_slurm", REPO / "launch" / "slurm.py")
slurm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(slurm)

STEPS = 40
"""Long enough (a few seconds of steps) for a signal to land mid-run."""

pytestmark = pytest.mark.slow


def train_args(tiny_data: tuple[Path, Path], run_dir: Path, *extra: str) -> list[str]:
    prefix, tokenizer = tiny_data
    return [*TINY, f"--train.steps={STEPS}", "--optim.lr=1e-2", "--parallel.backend=fsdp",
            "--checkpoint.interval=0", f"--data.path={prefix}", f"--data.tokenizer={tokenizer}",
            f"--run_dir={run_dir}", *extra]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require_cluster()
    with local_cluster(tmp_path_factory.mktemp("slurm")) as running:
        yield running


@pytest.fixture(scope="module")
def torchrun_run(tiny_data, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same training on 2 ranks under torchrun, uninterrupted: the reference."""
    run_dir = tmp_path_factory.mktemp("torchrun") / "run"
    launch(train_args(tiny_data, run_dir), nproc=2)
    return run_dir


def submit(cluster: Cluster, tmp_path: Path, flags: list[str], args: list[str]) -> tuple[str, Path]:
    """Write a job with launch/slurm.py (2 nodes × 1 rank, CPU) and submit it; (job id, log)."""
    script = tmp_path / "job.sbatch"
    slurm.main(["--nodes", "2", "--gpus-per-node", "0", "--nproc-per-node", "1",
                "--output", f"{tmp_path}/%j.out", "--sbatch=--open-mode=append", *flags,
                "--write", str(script), "--", *args])
    job = cluster.submit(script, cwd=tmp_path)
    return job, tmp_path / f"{job}.out"


def test_job_trains_like_torchrun(cluster: Cluster, torchrun_run: Path, tiny_data,
                                  tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job, log = submit(cluster, tmp_path, [], train_args(tiny_data, run_dir))
    state = cluster.wait_done(job, 240, log)
    assert state["JobState"] == "COMPLETED", log.read_text()[-3000:]
    assert losses(run_dir) == losses(torchrun_run)  # bitwise: same ranks, same data order
    assert len(losses(run_dir)) == STEPS
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step_{STEPS:08d}"
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))


def test_usr1_saves_requeues_and_finishes_like_an_uninterrupted_run(
        cluster: Cluster, torchrun_run: Path, tiny_data, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # --requeue alone: the generator turns on the trainer's requeue and resume.
    job, log = submit(cluster, tmp_path, ["--requeue"], train_args(tiny_data, run_dir))
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(train_records(run_dir)) >= 3, 120,
             lambda: f"job {job} to train 3 steps\n{log.read_text() if log.exists() else ''}")
    cluster.run("scancel", "--signal=USR1", job)
    state = cluster.wait_done(job, 300, log)
    text = log.read_text()
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", text[-3000:]
    assert "SIGUSR1 received: stopping at this step boundary" in text, text
    assert f"requeued SLURM job {job}" in text and "resumed from" in text, text
    stopped = int(text.split("resumed from")[1].split("step_")[1][:8])
    assert 3 <= stopped < STEPS, "the signal must land mid-run for this test to mean anything"
    assert [r["step"] for r in train_records(run_dir)] == list(range(1, STEPS + 1))
    assert losses(run_dir) == losses(torchrun_run)


def test_deepspeed_zero1_job(cluster: Cluster, torchrun_run: Path, tiny_data,
                             tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job, log = submit(cluster, tmp_path, [], train_args(
        tiny_data, run_dir, "--parallel.backend=deepspeed", "--parallel.zero_stage=1"))
    state = cluster.wait_done(job, 300, log)
    assert state["JobState"] == "COMPLETED", log.read_text()[-3000:]
    ours, reference = losses(run_dir), losses(torchrun_run)
    assert ours.keys() == reference.keys()
    # Another optimizer implementation: the same function, not the same bits.
    assert all(abs(ours[s] - reference[s]) <= 1e-3 for s in ours), (ours, reference)
    assert (run_dir / "checkpoints" / f"step_{STEPS:08d}" / "model" / "engine").is_dir()


def test_plain_srun_launch_without_torchrun(cluster: Cluster, torchrun_run: Path, tiny_data,
                                            tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job, log = submit(cluster, tmp_path, ["--launcher", "srun"], train_args(tiny_data, run_dir))
    state = cluster.wait_done(job, 240, log)
    text = log.read_text()
    assert state["JobState"] == "COMPLETED", text[-3000:]
    assert "torchrun" not in (tmp_path / "job.sbatch").read_text().split("HEAD_ADDR=$")[-1]
    assert losses(run_dir) == losses(torchrun_run)
