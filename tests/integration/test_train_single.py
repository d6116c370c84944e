"""`megabeta train` on one process: learning, metrics, TensorBoard, exact resume, bad input."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from megabeta.config import load_config
from support.model_helpers import tiny_model
from support.train_helpers import TINY, launch, losses, train_records


@pytest.fixture(scope="module")
def full_run(tiny_data, tmp_path_factory) -> Path:
    """An uninterrupted 12-step run (checkpoints at 3, 6, 9, 12)."""
    prefix, tokenizer = tiny_data
    run_dir = tmp_path_factory.mktemp("single") / "run"
    launch([*TINY, f"--data.path={prefix}", f"--data.tokenizer={tokenizer}",
            f"--run_dir={run_dir}", "--train.steps=12", "--optim.lr=1e-2"])
    return run_dir


def test_loss_falls_and_metrics_are_complete(full_run: Path) -> None:
    records = train_records(full_run)
    assert [r["step"] for r in records] == list(range(1, 13))
    for r in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "s_per_batch", "mfu",
                "memory_gib"} <= r.keys()
        assert math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert records[0]["lr"] < records[1]["lr"]  # warm-up


def test_tensorboard_events_hold_the_scalars(full_run: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(full_run / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/mfu",
            "eval/loss", "eval/ppl"} <= tags
    logged = [e.value for e in events.Scalars("train/loss")]
    assert logged == pytest.approx(list(losses(full_run).values()), rel=1e-6)


def test_saved_config_reloads_to_the_same_run(full_run: Path) -> None:
    config = load_config(full_run / "config.toml")
    assert config.train.steps == 12 and config.model.d_model == 32
    assert config.model.vocab_size == 300  # taken from the dataset sidecar


def test_checkpoints_are_complete_and_pruned(full_run: Path) -> None:
    root = full_run / "checkpoints"
    assert (root / "latest").read_text() == "step_00000012"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000009", "step_00000012"]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_resume_is_bitwise_exact(async_save: bool, full_run: Path, tiny_data,
                                 tmp_path: Path) -> None:
    prefix, tokenizer = tiny_data
    args = [*TINY, f"--data.path={prefix}", f"--data.tokenizer={tokenizer}",
            f"--run_dir={tmp_path}", "--train.steps=12", "--optim.lr=1e-2",
            f"--checkpoint.async_save={async_save}"]
    launch([*args, "--train.exit_after=5"])
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000005"
    launch([*args, "--resume=auto"])
    assert losses(tmp_path) == losses(full_run)  # every step, bitwise


def test_resume_accepts_execution_changes(full_run: Path, tiny_data, tmp_path: Path) -> None:
    """Activation checkpointing (block -> none), the attention backend and max_seq_len say how
    the model runs, not what it is: a run resumes across a change of them and continues the
    uninterrupted run's losses (to float32 rounding: other kernels add in another order)."""
    prefix, tokenizer = tiny_data
    done = launch([*TINY, f"--data.path={prefix}", f"--data.tokenizer={tokenizer}",
                   f"--run_dir={tmp_path}", "--train.steps=12", "--optim.lr=1e-2",
                   f"--resume={full_run / 'checkpoints' / 'step_00000009'}",
                   "--execution.activation_checkpoint=none", "--execution.attention=reference",
                   "--model.max_seq_len=256"])
    assert "attention reference" in done.stdout
    resumed, full = losses(tmp_path), losses(full_run)
    assert sorted(resumed) == [10, 11, 12]
    for step in resumed:
        assert resumed[step] == pytest.approx(full[step], abs=1e-5)


@pytest.mark.parametrize("override,field", [("--model.d_model=48", "model.d_model = 32"),
                                            ("--model.block_size=4", "model.block_size = 8")])
def test_resume_refuses_a_different_model(override: str, field: str, full_run: Path, tiny_data,
                                          tmp_path: Path) -> None:
    """A change of a field that shapes the parameters or the function is refused, naming it."""
    prefix, _ = tiny_data
    done = launch([*TINY, f"--data.path={prefix}", f"--run_dir={tmp_path}", override,
                   f"--resume={full_run / 'checkpoints' / 'step_00000009'}"], check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"cannot resume: {field} in the checkpoint" in done.stderr


def test_dcp_checkpoint_converts_with_torch_tools(full_run: Path, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(full_run / "checkpoints" / "step_00000012" / "model", tmp_path / "c.pt")
    state = torch.load(tmp_path / "c.pt", weights_only=False)
    assert state["model"]["tok_embeddings.weight"].shape == (300, 32)
    assert "layers.0.attention.self_bias" in state["model"] and "optim" in state


def test_export_eval_and_generate(full_run: Path, tiny_data, tmp_path: Path, capsys) -> None:
    from megabeta.checkpoint.export import load_model
    from megabeta.cli import main

    prefix, tokenizer = tiny_data
    checkpoint = full_run / "checkpoints" / "step_00000012"
    assert main(["export", f"--checkpoint={checkpoint}", f"--output={tmp_path / 'm.safetensors'}"]) == 0
    exported, sharded = load_model(tmp_path / "m.safetensors"), load_model(checkpoint)
    for (name, a), (_, b) in zip(exported.state_dict().items(), sharded.state_dict().items()):
        assert torch.equal(a, b), name
    assert main(["eval", f"--checkpoint={tmp_path / 'm.safetensors'}", f"--data.path={prefix}",
                 "--seq-len=32", "--val-fraction=0.1"]) == 0
    assert "ppl" in capsys.readouterr().out
    assert main(["generate", f"--checkpoint={checkpoint}", "--prompt=alpha beta",
                 "--max-new-tokens=8", "--temperature=0"]) == 0  # tokenizer from the run config
    assert capsys.readouterr().out.startswith("alpha beta")


def test_bad_checkpoints_and_configs_are_clear_errors(full_run: Path, tiny_data,
                                                      tmp_path: Path) -> None:
    prefix, tokenizer = tiny_data
    args = [*TINY, f"--data.path={prefix}", f"--run_dir={tmp_path / 'r'}"]
    truncated = tmp_path / "truncated"
    shutil.copytree(full_run / "checkpoints" / "step_00000012", truncated)
    for shard in (truncated / "model").glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])
    done = launch([*args, f"--resume={truncated}"], check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"checkpoint {truncated} is damaged: " in done.stderr and "is truncated" in done.stderr

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    done = launch([*args, f"--resume={foreign}"], check=False)
    assert done.returncode == 2 and "is not a megabeta checkpoint" in done.stderr

    done = launch([*args, "--optim.learning_rate=1"], check=False)
    assert done.returncode == 2 and "unknown config key 'optim.learning_rate'" in done.stderr

    other_tokenizer = tmp_path / "other.model"
    other_tokenizer.write_bytes(tokenizer.read_bytes() + b"x")
    done = launch([*args, f"--data.tokenizer={other_tokenizer}"], check=False)
    assert done.returncode == 2 and "tokenizer" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("flag,tolerance", [("--train.precision=bf16", 5e-2)], ids=["bf16"])
def test_variant_trains_like_the_eager_fp32_run(flag: str, tolerance: float, full_run: Path,
                                                tiny_data, tmp_path: Path) -> None:
    """train.precision=bf16 (autocast; the GPU setting, the same code path on this CPU): losses
    follow the fp32 run's at bf16's precision, and are not its losses."""
    prefix, _ = tiny_data
    launch([*TINY, f"--data.path={prefix}", f"--run_dir={tmp_path}", "--train.steps=12",
            "--optim.lr=1e-2", flag, "--train.exit_after=3"], timeout=600)
    variant, eager = losses(tmp_path), losses(full_run)
    assert len(variant) == 3
    for step in variant:
        assert variant[step] == pytest.approx(eager[step], abs=tolerance)
    if "bf16" in flag:
        assert any(variant[step] != eager[step] for step in variant)


def test_the_cli_leaves_its_process_group_after_a_finished_run(tiny_data, tmp_path) -> None:
    """`megabeta train` ends the process group before the interpreter's teardown, where gloo
    torn down at exit could abort a rank whose work was done; the one-rank group's variables
    are taken back with it."""
    import torch.distributed as dist

    from megabeta.train.cli import main as train_main

    prefix, _ = tiny_data
    environ = dict(os.environ)
    assert train_main([*TINY, f"--data.path={prefix}", "--checkpoint.save_at_end=false",
                       "--parallel.backend=fsdp", "--train.steps=2",
                       f"--run_dir={tmp_path / 'run'}"]) == 0
    assert not dist.is_initialized()
    assert dict(os.environ) == environ
