"""The stability monitor (an injected spike is logged, skipped, or stops the run with the last
good state saved), the straggler report, the memory split, and beta_1.2's dials."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megabeta.config import load_config
from megabeta.model import ConfigError, ModelConfig, build_model
from megabeta.train.dials import attention_shares, parameter_dials
from megabeta.train.loop import Trainer, TrainingStopped
from megabeta.train.monitor import RunningWindow, find_straggler
from support.train_helpers import TINY_CONFIG, TINY_OVERRIDES, snapshot_steps, train_records

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPIKE_STEP = 5  # 1-based: the step whose gradients and loss are blown up
MONITOR = ["--train.steps=5", "--monitor.spike_window=10", "--monitor.spike_min_steps=3",
           "--monitor.loss_zscore=20", "--monitor.grad_norm_zscore=20", "--logging.interval=5",
           "--checkpoint.interval=0", "--monitor.beta_dials=false", "--eval.batches=1"]


def spiking_trainer(tiny_data, run_dir, *extra: str) -> Trainer:
    """A single-process trainer whose step SPIKE_STEP has 1000x its loss and gradients."""
    prefix, _ = tiny_data
    config = load_config(TINY_CONFIG, [*TINY_OVERRIDES, f"--data.path={prefix}",
                                       f"--run_dir={run_dir}", "--checkpoint.save_at_end=false",
                                       *MONITOR, *extra])
    trainer = Trainer(config)
    clean = trainer.engine.forward_backward

    def forward_backward(*args, **kwargs):
        loss = clean(*args, **kwargs)
        if trainer.state.step + 1 == SPIKE_STEP:
            for p in trainer.engine.model.parameters():
                p.grad.mul_(1000.0)
            return loss * 1000.0
        return loss

    trainer.engine.forward_backward = forward_backward
    return trainer


def test_running_window_zscore() -> None:
    window = RunningWindow(3)
    for value in (1.0, 2.0, 3.0, 4.0):  # the window keeps 2, 3, 4
        window.add(value)
    assert window.zscore(3.0, min_values=4) is None
    assert window.zscore(3.0 + 2 * math.sqrt(2 / 3), min_values=3) == pytest.approx(2.0)
    window.add(math.nan)  # non-finite values never enter
    assert list(window.values) == [2.0, 3.0, 4.0]


@pytest.mark.parametrize("action", ["skip", "log"])
def test_injected_spike_is_reported_and_skipped_or_applied(action, tiny_data, tmp_path,
                                                           capsys) -> None:
    trainer = spiking_trainer(tiny_data, tmp_path, f"--monitor.spike_action={action}")
    snapshots = snapshot_steps(trainer)
    trainer.train()
    warnings = [line for line in capsys.readouterr().out.splitlines() if "spike at step" in line]
    assert len(warnings) == 1, warnings
    message = warnings[0]
    assert f"spike at step {SPIKE_STEP}" in message and "grad_norm" in message
    # The data position of the step: the stream positions of its 4 samples.
    start = (SPIKE_STEP - 1) * 4
    assert f"stream positions [{start}, {start + 4})" in message
    assert f"(megabeta-data inspect --run {trainer.run_dir} --step {SPIKE_STEP})" in message
    # Per-layer norms before clipping: their root sum of squares is the step's grad norm.
    norms = dict(part.rsplit(" ", 1) for part in message.split("grad norms per layer: ")[1]
                 .split(", "))
    assert set(norms) == {"layers.0", "layers.1", "other"}
    total = float(message.split("grad_norm ")[1].split(" ")[0])
    assert math.sqrt(sum(float(v) ** 2 for v in norms.values())) == pytest.approx(total, rel=1e-3)
    records = {r["step"]: r for r in train_records(tmp_path)}
    assert records[SPIKE_STEP]["spike"] == 1
    unchanged = all(torch.equal(a, b) for a, b in zip(snapshots[SPIKE_STEP - 2],
                                                      snapshots[SPIKE_STEP - 1]))
    assert unchanged == (action == "skip")
    assert records[SPIKE_STEP]["skipped"] == (1 if action == "skip" else 0)


def test_spike_stop_saves_the_last_good_state(tiny_data, tmp_path) -> None:
    trainer = spiking_trainer(tiny_data, tmp_path, "--monitor.spike_action=stop")
    snapshots = snapshot_steps(trainer)
    with pytest.raises(TrainingStopped, match=f"spike at step {SPIKE_STEP}.*saved to"):
        trainer.train()
    saved = tmp_path / "checkpoints" / f"step_{SPIKE_STEP:08d}"
    assert saved.is_dir(), sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    # What was saved is the state before the spike's update.
    resumed = Trainer(load_config(TINY_CONFIG, [*TINY_OVERRIDES, f"--data.path={tiny_data[0]}",
                                                f"--run_dir={tmp_path}", "--resume=auto",
                                                *MONITOR]))
    assert resumed.state.step == SPIKE_STEP
    assert all(torch.equal(a, b) for a, b in zip(snapshots[SPIKE_STEP - 2],
                                                 resumed.engine.model.parameters()))


def test_find_straggler_names_the_slow_rank() -> None:
    even = [(1.0, 0.001), (1.02, 0.002), (0.99, 0.001)]
    assert find_straggler(even, 1.5) is None
    slow_data = [(1.0, 0.001), (1.0, 0.6), (1.0, 0.002)]
    assert "rank 1 data wait" in find_straggler(slow_data, 1.5)
    slow_step = [(1.0, 0.0), (1.0, 0.0), (3.2, 0.0), (1.1, 0.0)]
    assert "rank 2 step time" in find_straggler(slow_step, 1.5)
    # Sub-10 ms differences are noise whatever their ratio.
    assert find_straggler([(0.01, 0.0001), (0.01, 0.0009)], 1.5) is None


def test_memory_split_and_dials_are_logged(tiny_data, tmp_path) -> None:
    prefix, _ = tiny_data
    config = load_config(TINY_CONFIG, [*TINY_OVERRIDES, f"--data.path={prefix}",
                                       f"--run_dir={tmp_path}", "--train.steps=2",
                                       "--logging.interval=2", "--checkpoint.save_at_end=false"])
    trainer = Trainer(config)
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    memory = next(r for r in records if r.get("split") == "memory")
    params = sum(p.numel() * 4 for p in trainer.engine.model.parameters()) / 2**30
    assert memory["params_gib"] == pytest.approx(params)
    # A gradient may be a view of a larger buffer, whose whole storage is what it holds.
    assert params <= memory["grads_gib"] <= 1.05 * params
    assert memory["optimizer_gib"] >= 2 * params  # AdamW's two moments (and its step counts)
    assert memory["activations_gib"] > 0
    dials = next(r for r in records if r.get("split") == "dials")
    for layer in range(2):
        shares = [v for k, v in dials.items() if k.startswith(f"mass/layer{layer}/")]
        assert sum(shares) == pytest.approx(1.0, abs=1e-5)
        assert f"b_sigma/layer{layer}" in dials and f"e_K_norm/layer{layer}" in dials
        assert 0 < dials[f"diversity/layer{layer}/value_varying"] <= 1
        assert f"entropy/layer{layer}/finished" in dials and f"top_key/layer{layer}" in dials
    assert dials["seconds"] > 0
    # Per-layer gradient norms at every log step, before clipping: they make up the total.
    norms = next(r for r in records if r.get("split") == "grad_norm")
    step = next(r for r in records if "split" not in r and r["step"] == norms["step"])
    assert {"layers.0", "layers.1", "other"} <= set(norms)
    assert math.sqrt(sum(v * v for k, v in norms.items() if k not in ("step", "split"))) == \
        pytest.approx(step["grad_norm"], rel=1e-4)
    assert not (tmp_path / "profile").exists()  # profile.steps empty: no profiler, no traces
    off = tmp_path / "off"
    Trainer(load_config(TINY_CONFIG, [*TINY_OVERRIDES, f"--data.path={prefix}",
                                      f"--run_dir={off}", "--train.steps=2",
                                      "--logging.interval=2", "--monitor.beta_dials=false",
                                      "--checkpoint.save_at_end=false"])).train()
    assert '"split": "dials"' not in (off / "metrics.jsonl").read_text()


def small_beta12(**kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    config = ModelConfig(arch="beta12", vocab_size=50, d_model=32, hidden_dim=64, num_heads=2,
                         num_layers=3, block_size=4, max_seq_len=16, depth_window=2,
                         **kwargs)
    model = build_model(config).double()
    with torch.no_grad():  # extras away from their zero start, so every dial moves
        for layer in model.layers:
            a = layer.attention
            for p in (a.e_k, a.e_v, a.f_q, a.depth_bias, a.self_bias):
                p.normal_()
    return model


def test_dials_read_the_parameters_and_the_explicit_softmax() -> None:
    model = small_beta12()
    scalars, histograms = parameter_dials(model)
    theta = model.layers[1].attention.depth_bias
    assert scalars["lambda/layer1/head0"] == pytest.approx(2.0 * float(torch.sigmoid(theta[0].detach())))
    assert scalars["b_sigma/layer2"] == pytest.approx(float(model.layers[2].attention.self_bias.detach()))
    assert scalars["e_V_norm/layer0"] == pytest.approx(float(model.layers[0].attention.e_v.detach().norm()))
    assert histograms["lambda"].shape == (3 * 2,)
    tokens = torch.randint(0, 50, (2, 16))
    before = model.attention_backend
    logits = model(tokens)
    shares = attention_shares(model, tokens)
    assert model.attention_backend is before  # the model's own backend is back
    assert torch.allclose(model(tokens), logits)
    # Layer 0 reads finished layers 0, 1, 2; layer 2 only its own (top(l) = L - 1).
    assert {k for k in shares if k.startswith("layer0/")} == {
        "layer0/finished_d0", "layer0/finished_d1", "layer0/finished_d2", "layer0/in_block",
        "layer0/self"}
    assert {k for k in shares if k.startswith("layer2/")} == {
        "layer2/finished_d0", "layer2/in_block", "layer2/self"}
    for layer in range(3):
        assert sum(v for k, v in shares.items() if k.startswith(f"layer{layer}/")) == \
            pytest.approx(1.0, abs=1e-9)
    # A huge self bias draws (nearly) all the mass onto the self slot.
    with torch.no_grad():
        model.layers[1].attention.self_bias.fill_(50.0)
    assert attention_shares(model, tokens)["layer1/self"] == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("override, key", [
    ("--monitor.spike_action=pause", "monitor.spike_action"),
    ("--monitor.straggler_ratio=0.5", "monitor.straggler_ratio"),
    ("--monitor.hang_seconds=-1", "monitor.hang_seconds"),
    ("--monitor.spike_min_steps=1", "monitor.spike_min_steps"),
    ("--profile.steps=5-3", "profile.steps"),
    ("--monitor.probe_batch=5", "monitor.probe_batch"),
    ("--profile.steps=every:0", "profile.steps"),
    ("--profile.steps=soon", "profile.steps"),
])
def test_bad_monitor_and_profile_settings_name_the_key(override, key) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_deepspeed_refuses_a_spike_action_it_cannot_take() -> None:
    with pytest.raises(ConfigError, match=r"monitor\.spike_action.*DeepSpeed"):
        load_config(None, ["--parallel.backend=deepspeed", "--monitor.spike_action=skip"])
