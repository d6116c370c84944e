"""Checkpoints are committed durably (every file fsynced, then renamed, then the directory
fsynced; `latest` the same way) and read without running code from them (RNG files, DCP
metadata and entries under an allowlist)."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from support.dist_helpers import launcher_free_environ
from megabeta.checkpoint.manager import (CheckpointError, capture_rng, check_checkpoint,
                                         load_rng_file, restore_rng)
from support.train_helpers import REPO, TINY
from support import SCRIPTS

RECORD = SCRIPTS / "record_fsync.py"


def recorded_run(tiny_data, tmp_path: Path, nproc: int, *extra: str) -> tuple[Path, list[dict]]:
    """Train the tiny model (saves at steps 3 and 6) with fsync/replace recorded; (run dir,
    every process's events in time order)."""
    prefix, tokenizer = tiny_data
    run_dir, events_dir = tmp_path / "run", tmp_path / "events"
    events_dir.mkdir()
    args = [*TINY, f"--data.path={prefix}", f"--data.tokenizer={tokenizer}",
            f"--run_dir={run_dir}", *extra]
    launcher = ([] if nproc == 1 else
                ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"])
    done = subprocess.run([sys.executable, *launcher, str(RECORD), str(events_dir), "--", *args],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=launcher_free_environ())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    events = [json.loads(line) for f in events_dir.glob("events_*.jsonl")
              for line in f.read_text().splitlines()]
    return run_dir, sorted(events, key=lambda e: e["t"])


def assert_committed_durably(run_dir: Path, events: list[dict]) -> None:
    root = run_dir / "checkpoints"
    checkpoints = sorted(root.glob("step_*"))
    assert [p.name for p in checkpoints] == ["step_00000003", "step_00000006"]
    synced_at: dict[int, list[int]] = {}
    for e in events:
        if e["op"] == "fsync":
            synced_at.setdefault(e["ino"], []).append(e["t"])
    root_synced = synced_at.get(root.stat().st_ino, [])
    for final in checkpoints:
        [rename] = [e for e in events if e["op"] == "replace" and e["dst"] == str(final)]
        assert rename["src"] == f"{final}.tmp"
        entries = [final, *final.rglob("*")]
        assert len(entries) > 5
        for entry in entries:
            # every file's data and every directory's entries on disk before the rename
            assert any(t < rename["t"] for t in synced_at.get(entry.stat().st_ino, [])), entry
        # the rename itself made durable before anything else is committed
        assert any(t > rename["t"] for t in root_synced), f"{root} not fsynced after the rename"
        [pointer] = [e for e in events if e["op"] == "replace" and e["dst"] == str(root / "latest")
                     and e["t"] > rename["t"]][:1]
        assert any(rename["t"] < t < pointer["t"] for t in root_synced)
        # `latest`'s data synced before it is renamed into place, the rename synced after
        assert any(e["op"] == "fsync" and e["path"].startswith(str(root / ".latest.tmp-"))
                   and rename["t"] < e["t"] < pointer["t"] for e in events)
        assert any(t > pointer["t"] for t in root_synced)
    assert (root / "latest").read_text() == "step_00000006"


@pytest.fixture(scope="module")
def dcp_run(tiny_data, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """A single-process run (DCP checkpoints) with its fsync/replace events."""
    return recorded_run(tiny_data, tmp_path_factory.mktemp("dcp"), 1)


def test_dcp_save_syncs_every_file_then_renames_then_syncs_the_directory(dcp_run) -> None:
    assert_committed_durably(*dcp_run)


@pytest.mark.slow
def test_deepspeed_ranks_sync_their_own_files(tiny_data, tmp_path: Path) -> None:
    run_dir, events = recorded_run(tiny_data, tmp_path, 2, "--parallel.backend=deepspeed",
                                   "--parallel.zero_stage=1")
    assert_committed_durably(run_dir, events)
    assert list((run_dir / "checkpoints" / "step_00000006" / "model" / "engine").glob(
        "zero_pp_rank_1_*")), "rank 1's optimizer shard is part of the checkpoint"


# ---------------------------------------------------------------- reading without running code

class RunsCode:
    """Unpickling this runs a shell command (what a malicious checkpoint file would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_rng_states_round_trip_as_plain_tensors(tmp_path: Path) -> None:
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()  # a cached Gaussian is part of NumPy's state
    file = tmp_path / "rng.pt"
    torch.save(capture_rng(), file)
    draws = (random.random(), np.random.standard_normal(), torch.rand(2))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_rng(load_rng_file(file))
    again = (random.random(), np.random.standard_normal(), torch.rand(2))
    assert draws[:2] == again[:2] and torch.equal(draws[2], again[2])
    torch.load(file, weights_only=True)  # nothing but tensors, numbers and strings inside


def test_rng_files_of_the_first_format_still_load(tmp_path: Path) -> None:
    random.seed(4), np.random.seed(5)
    file = tmp_path / "old.pt"
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(),
                "torch": torch.get_rng_state()}, file)
    draws = (random.random(), np.random.random())
    restore_rng(load_rng_file(file))
    assert (random.random(), np.random.random()) == draws


def test_an_rng_file_that_would_run_code_is_refused(tmp_path: Path) -> None:
    marker, file = tmp_path / "ran", tmp_path / "rank_00000.pt"
    torch.save({"python": RunsCode(marker), "numpy": {}, "torch": torch.get_rng_state()}, file)
    with pytest.raises(CheckpointError, match=r"rank_00000.pt holds objects other than RNG "
                                              r"states .*refusing to load it: it could run code"):
        load_rng_file(file)
    assert not marker.exists()


def test_resume_refuses_a_crafted_checkpoint_before_running_it(dcp_run, tiny_data,
                                                               tmp_path: Path) -> None:
    """A checkpoint whose DCP metadata and RNG file would run code: `check_checkpoint` (which
    --resume=auto runs on every candidate) names the file, and nothing runs."""
    run_dir, _ = dcp_run
    crafted = tmp_path / "crafted"
    shutil.copytree(run_dir / "checkpoints" / "step_00000006", crafted)
    marker = tmp_path / "ran"
    (crafted / "model" / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(CheckpointError, match=r"model/.metadata cannot be read \(UnpicklingError: "
                                              r"refusing to load posix.system"):
        check_checkpoint(crafted)
    shutil.copy(run_dir / "checkpoints" / "step_00000006" / "model" / ".metadata",
                crafted / "model" / ".metadata")
    torch.save({"python": RunsCode(marker)}, crafted / "rng" / "rank_00000.pt")
    prefix, tokenizer = tiny_data
    done = subprocess.run([sys.executable, "-m", "megabeta.train", *TINY,
                           f"--data.path={prefix}", f"--data.tokenizer={tokenizer}",
                           f"--run_dir={tmp_path / 'again'}", f"--resume={crafted}"],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=launcher_free_environ())
    assert done.returncode != 0
    assert "rank_00000.pt holds objects other than RNG states" in done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert not marker.exists()
