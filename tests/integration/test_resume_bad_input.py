"""Resuming from damaged checkpoints and with another schedule horizon (issue 19 §4, §6).

`--resume=auto` checks the newest checkpoint cheaply (the shards DCP's .metadata names, with
their sizes; train_state.json; the RNG files) and falls back to the newest usable one with a
warning naming what is wrong; an explicit `--resume=PATH` to a damaged one is a one-line error
naming the file and the usable checkpoints. A resumed run whose schedule horizon differs from the
checkpoint's warns with both learning rates; `schedule.total_steps` keeps the original one.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from megabeta.checkpoint import CheckpointError, CheckpointManager, TrainState
from megabeta.checkpoint.manager import capture_rng, check_checkpoint
from megabeta.config import OptimConfig, ScheduleConfig, load_config
from megabeta.model import ConfigError
from megabeta.train.schedule import horizon_change_warning, lr_at
from support.train_helpers import TINY, launch, losses, train_records

NEWEST, OLDER = "step_00000006", "step_00000003"


@pytest.fixture(scope="module")
def run6(tiny_data, tmp_path_factory) -> Path:
    """A 6-step run: checkpoints at steps 3 and 6."""
    prefix, tokenizer = tiny_data
    run_dir = tmp_path_factory.mktemp("resume_bad") / "run"
    launch([*TINY, f"--data.path={prefix}", f"--data.tokenizer={tokenizer}",
            f"--run_dir={run_dir}"])
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == [OLDER, NEWEST]
    return run_dir


def copy_run(run6: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(run6, run)
    return run


def shard(checkpoint: Path) -> Path:
    return sorted((checkpoint / "model").glob("*.distcp"))[0]


def cut(file: Path, keep: int | None = None) -> None:
    data = file.read_bytes()
    file.write_bytes(data[:len(data) // 2 if keep is None else keep])


# damage(checkpoint dir), what the message must name
DAMAGES = {
    "shard_truncated": (lambda c: cut(shard(c)), "__0_0.distcp is truncated"),
    "shard_deleted": (lambda c: shard(c).unlink(), "__0_0.distcp is missing"),
    "metadata_deleted": (lambda c: (c / "model" / ".metadata").unlink(), ".metadata is missing"),
    "metadata_truncated": (lambda c: cut(c / "model" / ".metadata", 10),
                           ".metadata cannot be read"),
    "state_deleted": (lambda c: (c / "train_state.json").unlink(), "train_state.json is missing"),
    "state_damaged": (lambda c: (c / "train_state.json").write_text("{"),
                      "train_state.json is damaged"),
    "rng_deleted": (lambda c: (c / "rng" / "rank_00000.pt").unlink(), "rank_00000.pt is missing"),
    "rng_truncated": (lambda c: cut(c / "rng" / "rank_00000.pt"),
                      "rank_00000.pt is truncated or damaged"),
}


@pytest.fixture()
def megabeta_log(monkeypatch, caplog):
    """caplog sees the "megabeta" logger (setup_logging may have stopped its propagation)."""
    monkeypatch.setattr(logging.getLogger("megabeta"), "propagate", True)
    with caplog.at_level(logging.WARNING, logger="megabeta"):
        yield caplog


@pytest.mark.parametrize("kind", DAMAGES)
def test_auto_skips_a_damaged_newest_checkpoint(kind: str, run6: Path, tmp_path: Path,
                                                megabeta_log) -> None:
    damage, named = DAMAGES[kind]
    run = copy_run(run6, tmp_path)
    damage(run / "checkpoints" / NEWEST)
    path, state = CheckpointManager(run, keep=2).resolve("auto")
    assert path.name == OLDER and state.step == 3
    assert f"--resume=auto: skipping {NEWEST}: " in megabeta_log.text
    assert named in megabeta_log.text
    assert f"resuming from {run / 'checkpoints' / OLDER}, the newest usable" in megabeta_log.text


@pytest.mark.parametrize("kind", DAMAGES)
def test_an_explicit_damaged_checkpoint_is_a_clear_error(kind: str, run6: Path,
                                                         tmp_path: Path) -> None:
    damage, named = DAMAGES[kind]
    run = copy_run(run6, tmp_path)
    damage(run / "checkpoints" / NEWEST)
    with pytest.raises(CheckpointError) as caught:
        CheckpointManager(tmp_path / "elsewhere", keep=2).resolve(str(run / "checkpoints" / NEWEST))
    message = str(caught.value)
    assert named in message and "\n" not in message
    assert f"usable checkpoints: {run / 'checkpoints' / OLDER}: pass one with --resume=PATH" \
        in message
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(run6: Path,
                                                                tmp_path: Path) -> None:
    run = copy_run(run6, tmp_path)
    for name in (OLDER, NEWEST):
        shard(run / "checkpoints" / name).unlink()
    with pytest.raises(CheckpointError, match=rf"no usable checkpoint in .*\(damaged: {NEWEST}, "
                                              rf"{OLDER}; "):
        CheckpointManager(run, keep=2).resolve("auto")
    with pytest.raises(CheckpointError, match="no other usable checkpoint next to it"):
        CheckpointManager(run, keep=2).resolve(str(run / "checkpoints" / NEWEST))
    assert CheckpointManager(tmp_path / "fresh", keep=2).resolve("auto") is None


def test_auto_takes_the_newest_good_checkpoint_without_a_warning(run6: Path,
                                                                 megabeta_log) -> None:
    path, state = CheckpointManager(run6, keep=2).resolve("auto")
    assert path.name == NEWEST and state.step == 6 and state.schedule_horizon == 6
    assert megabeta_log.text == ""


def _deepspeed_checkpoint(root: Path) -> Path:
    """The layout of a 2-rank ZeRO checkpoint (tiny files with the names DeepSpeed writes)."""
    checkpoint = root / "step_00000005"
    engine = checkpoint / "model" / "engine"
    engine.mkdir(parents=True)
    (checkpoint / "rng").mkdir()
    torch.save({"module": {"w": torch.zeros(4)}}, engine / "mp_rank_00_model_states.pt")
    for rank in range(2):
        torch.save({"state": torch.ones(2)},
                   engine / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        torch.save(capture_rng(), checkpoint / "rng" / f"rank_{rank:05d}.pt")
    (checkpoint / "model" / "latest").write_text("engine")
    (checkpoint / "train_state.json").write_text(json.dumps(asdict(
        TrainState(step=5, backend="deepspeed", world_size=2))))
    return checkpoint


@pytest.mark.parametrize("damage,named", [
    (lambda e: (e / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink(),
     "no optimizer states of rank 1"),
    (lambda e: cut(e / "mp_rank_00_model_states.pt"), "mp_rank_00_model_states.pt is truncated"),
    (lambda e: (e / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b""),
     "zero_pp_rank_0_mp_rank_00_optim_states.pt is empty"),
    (lambda e: (e / "mp_rank_00_model_states.pt").unlink(), "holds no *model_states.pt file"),
    (lambda e: shutil.rmtree(e), "engine is missing"),
], ids=["optim_rank_deleted", "model_truncated", "optim_empty", "model_deleted", "no_engine"])
def test_deepspeed_checkpoints_are_checked_too(damage, named: str, tmp_path: Path) -> None:
    checkpoint = _deepspeed_checkpoint(tmp_path)
    assert check_checkpoint(checkpoint).step == 5
    damage(checkpoint / "model" / "engine")
    with pytest.raises(CheckpointError, match="is damaged: ") as caught:
        check_checkpoint(checkpoint)
    assert named in str(caught.value)


# ---- the CLI: exit status, one line, no traceback --------------------------------------------

def _args(tiny_data, run: Path, *extra: str) -> list[str]:
    prefix, tokenizer = tiny_data
    return [*TINY, f"--data.path={prefix}", f"--data.tokenizer={tokenizer}", f"--run_dir={run}",
            *extra]


def error_line(stderr: str) -> str:
    """The one `error:` line of stderr, and nothing of it on further lines."""
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert not stderr.split(errors[0], 1)[1].strip(), stderr[-3000:]
    return errors[0]


def test_train_resume_auto_falls_back_and_continues_exactly(run6: Path, tiny_data,
                                                            tmp_path: Path) -> None:
    run = copy_run(run6, tmp_path)
    cut(shard(run / "checkpoints" / NEWEST))
    done = launch(_args(tiny_data, run, "--resume=auto"))
    assert f"--resume=auto: skipping {NEWEST}: checkpoint " in done.stdout
    assert "__0_0.distcp is truncated" in done.stdout
    assert f"resumed from {run / 'checkpoints' / OLDER} at step 3" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr
    assert losses(run) == losses(run6)  # steps 4-6 again, bitwise
    assert check_checkpoint(run / "checkpoints" / NEWEST).step == 6  # rewritten whole


def test_train_resume_from_a_damaged_path_is_one_clear_line(run6: Path, tiny_data,
                                                            tmp_path: Path) -> None:
    run = copy_run(run6, tmp_path)
    damaged = run / "checkpoints" / NEWEST
    (damaged / "model" / ".metadata").unlink()
    done = launch(_args(tiny_data, tmp_path / "new", f"--resume={damaged}"), check=False)
    assert done.returncode == 2
    error = error_line(done.stderr)
    assert error.startswith(f"error: checkpoint {damaged} is damaged: model/.metadata is missing")
    assert f"usable checkpoints: {run / 'checkpoints' / OLDER}" in error
    assert "Traceback" not in done.stdout + done.stderr


def test_shards_that_pass_the_check_but_fail_to_load_are_one_clear_line(run6: Path, tiny_data,
                                                                        tmp_path: Path) -> None:
    """Same size, other bytes: only loading finds it; DCP's exception text (every rank's
    traceback) is reduced to its cause."""
    run = copy_run(run6, tmp_path)
    damaged = run / "checkpoints" / NEWEST
    size = shard(damaged).stat().st_size
    shard(damaged).write_bytes(b"\0" * size)
    done = launch(_args(tiny_data, tmp_path / "new", f"--resume={damaged}"), check=False)
    assert done.returncode == 2
    error = error_line(done.stderr)
    assert error.startswith(f"error: could not load model/optimizer shards from "
                            f"{damaged / 'model'}: ")
    assert f"usable checkpoints: {run / 'checkpoints' / OLDER}" in error
    assert "Traceback" not in done.stdout + done.stderr


# ---- the schedule's horizon on resume ---------------------------------------------------------

def test_total_steps_sets_the_horizon() -> None:
    optim = OptimConfig(lr=1.0)
    kept = ScheduleConfig(warmup_steps=2, total_steps=12)
    for step in range(20):
        assert lr_at(step, 20, optim, kept) == lr_at(step, 12, optim, ScheduleConfig(warmup_steps=2))
    assert lr_at(15, 20, optim, kept) == pytest.approx(0.1)  # the floor past the horizon
    with pytest.raises(ConfigError, match="schedule.total_steps = -1"):
        load_config(None, ["--schedule.total_steps=-1"])


def test_horizon_change_warning_gives_both_rates() -> None:
    optim, schedule = OptimConfig(lr=1e-3), ScheduleConfig(warmup_steps=2)
    text = horizon_change_warning(6, 6, 10, optim, schedule)
    now, was = lr_at(6, 10, optim, schedule), lr_at(6, 6, optim, schedule)
    assert f"the lr is {now:.3g} now, {was:.3g} on the original schedule" in text
    assert "over 6 steps, this run decays over 10 (train.steps = 10)" in text
    assert "--schedule.total_steps=6" in text
    assert horizon_change_warning(6, 10, 10, optim, schedule) is None  # same horizon
    assert horizon_change_warning(6, 0, 10, optim, schedule) is None  # not recorded (old)
    assert horizon_change_warning(6, 6, 10, optim, ScheduleConfig(kind="constant")) is None
    kept = ScheduleConfig(warmup_steps=2, total_steps=6)
    assert horizon_change_warning(6, 6, 10, optim, kept) is None


def _lrs(run: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in train_records(run)}


def test_resume_with_more_steps_warns_and_total_steps_keeps_the_schedule(
        run6: Path, tiny_data, tmp_path: Path) -> None:
    config = load_config(run6 / "config.toml")
    optim, schedule = config.optim, config.schedule
    extended = copy_run(run6, tmp_path / "a")
    done = launch(_args(tiny_data, extended, "--resume=auto", "--train.steps=10"))
    now, was = lr_at(6, 10, optim, schedule), lr_at(6, 6, optim, schedule)
    assert "the learning-rate schedule changes on resume: the checkpoint was trained with a " \
           "cosine schedule over 6 steps, this run decays over 10 (train.steps = 10)" in done.stdout
    assert f"the lr is {now:.3g} now, {was:.3g} on the original" in done.stdout
    assert "pass --schedule.total_steps=6" in done.stdout
    assert _lrs(extended)[7] == pytest.approx(lr_at(6, 10, optim, schedule))

    kept = copy_run(run6, tmp_path / "b")
    done = launch(_args(tiny_data, kept, "--resume=auto", "--train.steps=10",
                        "--schedule.total_steps=6"))
    assert "schedule changes on resume" not in done.stdout
    floor = optim.lr * schedule.min_lr_ratio
    assert [_lrs(kept)[s] for s in range(7, 11)] == pytest.approx([floor] * 4)
    saved = json.loads((kept / "checkpoints" / "step_00000010" / "train_state.json").read_text())
    assert saved["schedule_horizon"] == 6
