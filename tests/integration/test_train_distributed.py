"""Training on 2 CPU ranks (gloo): FSDP2 and DeepSpeed ZeRO against one process, bounded
collectives, bitwise resume, resume at another world size, and preemption by a signal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.dist_helpers import launcher_free_environ
from support.train_helpers import TINY, launch, losses, train_records
from support import REPO, SCRIPTS

STEPS = ["--train.steps=6", "--optim.lr=1e-2"]


def args_for(tiny_data, run_dir: Path, *extra: str) -> list[str]:
    prefix, tokenizer = tiny_data
    return [*TINY, *STEPS, f"--data.path={prefix}", f"--data.tokenizer={tokenizer}",
            f"--run_dir={run_dir}", *extra]


@pytest.fixture(scope="module")
def single_run(tiny_data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("dist") / "single"
    launch(args_for(tiny_data, run_dir))
    return run_dir


@pytest.fixture(scope="module")
def fsdp_run(tiny_data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("dist") / "fsdp"
    launch(args_for(tiny_data, run_dir, "--parallel.backend=fsdp"), nproc=2)
    return run_dir


def assert_close_losses(a: Path, b: Path, tol: float) -> None:
    la, lb = losses(a), losses(b)
    assert la.keys() == lb.keys() and len(la) == 6
    for step in la:
        assert abs(la[step] - lb[step]) <= tol, (step, la[step], lb[step])


def test_fsdp_matches_single_process(single_run: Path, fsdp_run: Path) -> None:
    assert_close_losses(single_run, fsdp_run, 1e-4)


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_zero_matches_single_process(stage: int, single_run: Path, tiny_data,
                                               tmp_path: Path) -> None:
    launch(args_for(tiny_data, tmp_path, "--parallel.backend=deepspeed",
                    f"--parallel.zero_stage={stage}"), nproc=2)
    assert_close_losses(single_run, tmp_path, 1e-4)


@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
def test_wavefront_trains_like_the_block_schedule(backend: str, single_run: Path, tiny_data,
                                                  tmp_path: Path) -> None:
    """The wavefront schedule with per-wave checkpointing, sharded (FSDP2; DeepSpeed ZeRO-1),
    follows the single-process block schedule's losses."""
    stage = ["--parallel.zero_stage=1"] if backend == "deepspeed" else []
    launch(args_for(tiny_data, tmp_path, f"--parallel.backend={backend}", *stage,
                    "--execution.schedule=wavefront", "--execution.activation_checkpoint=wave"),
           nproc=2)
    assert_close_losses(single_run, tmp_path, 1e-4)


DOCUMENTS = ["--data.align=block", "--data.document_mask=true"]


def test_document_masked_training_on_deepspeed_matches_single_process(
        single_run: Path, tiny_data, tmp_path: Path) -> None:
    """data.document_mask with block-aligned packing (spec §7) through DeepSpeed ZeRO-1 on two
    ranks: the ids reach the model (the losses are not the unmasked run's) and follow the
    single process's."""
    launch(args_for(tiny_data, tmp_path / "single", *DOCUMENTS))
    launch(args_for(tiny_data, tmp_path / "ds", *DOCUMENTS, "--parallel.backend=deepspeed",
                    "--parallel.zero_stage=1"), nproc=2)
    assert_close_losses(tmp_path / "single", tmp_path / "ds", 1e-4)
    assert losses(tmp_path / "single") != losses(single_run)


@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
def test_resume_is_bitwise_exact_on_two_ranks(backend: str, tiny_data, tmp_path: Path) -> None:
    extra = [f"--parallel.backend={backend}", "--parallel.zero_stage=1"]
    full, parts = tmp_path / "full", tmp_path / "parts"
    launch(args_for(tiny_data, full, *extra), nproc=2)
    launch(args_for(tiny_data, parts, *extra, "--train.exit_after=3"), nproc=2)
    launch(args_for(tiny_data, parts, *extra, "--resume=auto"), nproc=2)
    assert losses(parts) == losses(full)


# 2 -> 1 on DeepSpeed and 1 -> 2 on FSDP: each direction once, each checkpoint format once.
@pytest.mark.parametrize("backend,first,second", [("fsdp", 1, 2), ("deepspeed", 2, 1)])
def test_resume_at_another_world_size(backend: str, first: int, second: int, fsdp_run: Path,
                                      tiny_data, tmp_path: Path) -> None:
    """The global batch is fixed, so the sample stream is the same whatever the world size:
    the resumed run consumes exactly the samples of the uninterrupted one. DCP reshards FSDP
    checkpoints; DeepSpeed's go through its universal-checkpoint conversion."""
    extra = [f"--parallel.backend={backend}", "--parallel.zero_stage=1"]
    reference = fsdp_run if first == 2 else tmp_path / "full"
    if first == 1:
        launch(args_for(tiny_data, reference, *extra))
    launch(args_for(tiny_data, tmp_path / "parts", *extra, "--train.exit_after=3"), nproc=first)
    launch(args_for(tiny_data, tmp_path / "parts", *extra, "--resume=auto"), nproc=second)
    resumed = {r["step"]: r for r in train_records(tmp_path / "parts")}
    expected = {r["step"]: r for r in train_records(reference)}
    assert [resumed[s]["samples"] for s in range(1, 7)] == [
        expected[s]["samples"] for s in range(1, 7)] == [4 * s for s in range(1, 7)]
    assert_close_losses(reference, tmp_path / "parts", 1e-4)


@pytest.mark.parametrize("backend,checkpoint,schedule", [
    ("fsdp", "block", "block"), ("zero3", "block", "block"), ("fsdp", "wave", "wavefront"),
    ("zero3", "wave", "wavefront")])
def test_parameters_gathered_a_bounded_number_of_times(backend: str, checkpoint: str,
                                                       schedule: str) -> None:
    """8 blocks call each of 3 layers 8 times per step (the wavefront: its waves read per-pass
    stacks of the layers' weights); still at most one all-gather per FSDP unit (3 layers +
    root) per step and one reduce-scatter each (ZeRO-3: from the second step on, after
    DeepSpeed has recorded the module trace)."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(SCRIPTS / "count_collectives.py"), backend, checkpoint,
         schedule],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["blocks"] == 8 and result["layers"] == 3
    units = result["layers"] + 1
    for step in result["steps"][1:]:
        assert step["total"]["gather"] <= 2 * units
        assert 1 <= step["total"]["scatter"] <= units
    if backend == "fsdp":
        assert result["steps"][0]["total"] == {"gather": units, "scatter": units}


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_skips_a_nonfinite_step(stage: int) -> None:
    """Injected NaN loss and gradients on 2 ranks: the ZeRO step leaves every parameter as it was
    and reports itself not applied (the trainer counts it as skipped); the next step updates."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(SCRIPTS / "nonfinite_deepspeed.py"), str(stage)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    clean, poisoned, after = json.loads(done.stdout.strip().splitlines()[-1])
    assert clean == {"poisoned": False, "applied": True, "changed": True, "finite": True}
    assert poisoned == {"poisoned": True, "applied": False, "changed": False, "finite": True}
    assert after == {"poisoned": False, "applied": True, "changed": True, "finite": True}


@pytest.mark.parametrize("backend", ["ddp", "fsdp", "deepspeed"])
def test_execution_compile_is_applied_under_every_engine(backend: str) -> None:
    """execution.compile = true compiles the model's recompute unit (the executor, built when
    the model is placed) whatever engine wraps it, DeepSpeed's included; the compiled step's
    loss is the eager one's."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(SCRIPTS / "engine_compiles.py"), backend],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["graphs"] >= 1, result
    assert abs(result["compiled"] - result["eager"]) < 1e-5, result


def test_sigterm_saves_at_a_step_boundary_and_the_run_resumes(tiny_data, tmp_path: Path) -> None:
    """SIGTERM reaches one rank only; both agree to stop after the same step, save, exit 0."""
    run_dir = tmp_path / "run"
    args = args_for(tiny_data, run_dir, "--parallel.backend=fsdp", "--train.steps=400",
                    "--checkpoint.interval=0", "--schedule.warmup_steps=1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "megabeta.train", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=REPO)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(train_records(run_dir)) < 3):
        time.sleep(0.2)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                             text=True).stdout.split()
    assert len(workers) == 2, workers
    os.kill(int(workers[-1]), signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-3000:]
    stopped = train_records(run_dir)[-1]["step"]
    assert 3 <= stopped < 400
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step_{stopped:08d}"
    launch([*args, "--resume=auto", "--train.steps=" + str(stopped + 2)], nproc=2)
    assert train_records(run_dir)[-1]["step"] == stopped + 2


def test_mpirun_trains_like_torchrun(fsdp_run: Path, tiny_data, tmp_path: Path) -> None:
    """Two ranks started by Open MPI's mpirun (ranks from OMPI_COMM_WORLD_*, gloo): the same
    losses as torchrun's, bit for bit."""
    mpirun = Path(sys.executable).parent / "mpirun"
    if not mpirun.exists():
        pytest.skip("no mpirun next to this Python: pip install 'megabeta[mpi]'")
    env = launcher_free_environ(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                                OMPI_MCA_rmaps_base_oversubscribe="1")
    run_dir = tmp_path / "mpirun"
    cmd = [str(mpirun), "-n", "2", "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", sys.executable,
           "-m", "megabeta.train", *args_for(tiny_data, run_dir, "--parallel.backend=fsdp")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert losses(run_dir) == losses(fsdp_run)
    state = json.loads((run_dir / "checkpoints" / "step_00000006" / "train_state.json").read_text())
    assert state["world_size"] == 2
    assert "[rank 1]" not in done.stdout + done.stderr  # rank 0 logs, the other stays quiet
