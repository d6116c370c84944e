"""`make demo` in its quick form: every stage, from raw text to generated text, end to end."""

from __future__ import annotations

import subprocess
import sys

from support.train_helpers import REPO, train_records


def test_quick_demo_runs_every_stage(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-m", "megabeta.demo", "--quick",
                           f"--workdir={tmp_path}"], capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    run = tmp_path / "run"
    records = train_records(run)
    assert records[-1]["loss"] < records[0]["loss"]
    assert (tmp_path / "data" / "stdlib.bin").stat().st_size > 0
    assert list((run / "tb").glob("events.out.tfevents.*"))
    assert (run / "checkpoints" / "latest").read_text() == "step_00000020"
    assert "loss: step" in done.stdout and "(falls)" in done.stdout
    assert "tensorboard --logdir" in done.stdout
