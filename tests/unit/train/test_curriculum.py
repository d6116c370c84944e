"""`train.block_size_schedule` (train/curriculum.py): the stage of each step, the config's
checks, the model at a stage's block size (c = T is the standard Transformer, spec §4.1, and
the model's own c comes back), the compiled and graphed executors re-keyed by the block size,
and a curriculum run that resumes exactly where it stopped."""

from __future__ import annotations

import json

import pytest
import torch

from megabeta.config import load_config
from megabeta.kernels import cpu_attention
from megabeta.kernels.ops import LaunchCount
from megabeta.model import ConfigError
from megabeta.model.graphs import EagerCapture
from megabeta.train.curriculum import block_size_at, training_block_size
from megabeta.train.loop import Trainer
from support.compile_counts import fresh_dynamo
from support.model_helpers import assert_trains_like, graphed, tiny_model, tokens
from support.train_helpers import TINY_CONFIG, TINY_OVERRIDES, train_records

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_each_step_trains_in_its_stage() -> None:
    schedule = [[0, 64], [3, 16], [5, 8]]
    assert [block_size_at(schedule, s) for s in range(7)] == [64, 64, 64, 16, 16, 8, 8]
    assert block_size_at([], 4) is None


@pytest.mark.parametrize("value, why", [
    ("[[0, 32], [4, 4]]", "last stage's block size 4 must be model.block_size = 8"),
    ("[[1, 32], [4, 8]]", "must start at 0 and increase"),
    ("[[0, 32], [0, 8]]", "must start at 0 and increase"),
    ("[[0, 32], [6, 8]]", "at or after train.steps = 6"),
    ("[[0, 0], [4, 8]]", r"\[0, 0\] is not a \[step >= 0, block_size >= 1\] pair"),
    ("[[0, 32, 1], [4, 8]]", "is not a"),
])
def test_a_bad_schedule_is_refused_naming_the_key(value: str, why: str) -> None:
    with pytest.raises(ConfigError, match=r"train\.block_size_schedule = .*" + why):
        load_config(TINY_CONFIG, [*TINY_OVERRIDES, f"--train.block_size_schedule={value}"])
    with pytest.raises(ConfigError, match="needs model.arch = 'beta12'"):
        load_config(TINY_CONFIG, [*TINY_OVERRIDES, "--model.arch=standard",
                                  "--train.block_size_schedule=[[0, 32], [4, 8]]"])
    config = load_config(TINY_CONFIG, [*TINY_OVERRIDES,
                                       "--train.block_size_schedule=[[0, 32], [4, 8]]"])
    assert config.train.block_size_schedule == [[0, 32], [4, 8]]


@pytest.mark.parametrize("schedule", ["block", "wavefront"])
def test_a_stage_computes_the_model_at_its_block_size_and_gives_the_own_back(schedule) -> None:
    model = tiny_model(block_size=3, schedule=schedule)
    whole = tiny_model(block_size=19)  # the same weights at c = T: spec §4.1's standard model
    x = tokens(length=19)
    own = model(x)
    with training_block_size(model, 19):
        assert torch.equal(model(x), whole(x))
        assert model.config.block_size == 19
    assert model.config.block_size == 3
    assert torch.equal(model(x), own)
    assert not torch.allclose(own, whole(x))
    with training_block_size(model, None):
        assert model.config.block_size == 3


@pytest.mark.parametrize("schedule, unit", [("block", "block"), ("wavefront", "wave")])
def test_the_graphed_pass_is_keyed_by_the_block_size(schedule: str, unit: str) -> None:
    """A stage's block size changes the plan: new graphs are recorded for it, and going back
    replays the first stage's (same batch and length: only the block size tells them apart)."""
    capture = EagerCapture()
    model = graphed(tiny_model(torch.float32, attention="triton", elementwise_kernels="triton",
                               activation_checkpoint=unit, schedule=schedule, block_size=3),
                    capture)
    x, y = tokens(length=12), tokens(length=12, seed=2)
    with LaunchCount(run=False):
        model(x, y).backward()
        first = capture.captured
        with training_block_size(model, 6):
            model(x, y).backward()
        second = capture.captured
        assert second > first
        replays = capture.replays
        model(x, y).backward()
        assert capture.captured == second and capture.replays - replays == first


@pytest.mark.skipif(not cpu_attention.build(), reason="the fused C++ kernels do not build here")
def test_the_compiled_unit_trains_each_stage_like_eager() -> None:
    model = tiny_model(attention="cpu", activation_checkpoint="block", block_size=4,
                       compile=True)
    eager = tiny_model(attention="cpu", activation_checkpoint="block", block_size=4)
    model.executor.allow_block_sizes(2)
    fresh_dynamo()
    stages = {0: 8, 1: 4, 2: 8}

    def stage(step: int) -> None:
        for m in (model, eager):
            m.config = m.config.replace(block_size=stages[step])

    assert_trains_like(model, eager, steps=3, length=16, before_step=stage,
                       tolerance=dict(rtol=1e-11, atol=1e-13))


def test_a_curriculum_run_logs_its_stages_and_resumes_exactly(tiny_data, tmp_path) -> None:
    prefix, _ = tiny_data
    schedule = "--train.block_size_schedule=[[0, 32], [2, 16], [4, 8]]"

    def run(run_dir, *extra: str) -> None:
        Trainer(load_config(TINY_CONFIG, [*TINY_OVERRIDES, f"--data.path={prefix}",
                                          f"--run_dir={run_dir}", schedule, "--train.steps=6",
                                          "--checkpoint.interval=0", "--monitor.beta_dials=false",
                                          "--optim.lr=1e-2", *extra])).train()

    run(tmp_path / "full")
    full = {r["step"]: r for r in train_records(tmp_path / "full")}
    assert [full[s]["block_size"] for s in range(1, 7)] == [32, 32, 16, 16, 8, 8]
    run(tmp_path / "cut", "--train.exit_after=3")
    run(tmp_path / "cut", "--resume=auto")
    cut = {r["step"]: r for r in train_records(tmp_path / "cut")}
    assert {s: cut[s]["loss"] for s in full} == {s: full[s]["loss"] for s in full}
    assert [cut[s]["block_size"] for s in range(1, 7)] == [32, 32, 16, 16, 8, 8]
    # The saved model is the spec's function at the model's own c.
    saved = (tmp_path / "full" / "config.toml").read_text()
    assert "block_size = 8" in saved
    without = tmp_path / "plain"
    Trainer(load_config(TINY_CONFIG, [*TINY_OVERRIDES, f"--data.path={prefix}",
                                      f"--run_dir={without}", "--train.steps=2",
                                      "--checkpoint.interval=0", "--monitor.beta_dials=false",
                                      "--optim.lr=1e-2"])).train()
    plain = train_records(without)
    assert "block_size" not in plain[0]
    # Stage 1 (c = 32 = T) is another function than c = 8: its first loss differs.
    assert plain[0]["loss"] != full[1]["loss"]
    json.dumps(full)  # the records are plain JSON
