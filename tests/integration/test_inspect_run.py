"""`megabeta-data inspect --run RUN --step N | --position P | --sample I`: the training samples a
run read, rebuilt from its config.toml. Checked against the batches the trainer actually fed (a
blend of two datasets, document-aligned so the samples carry loss masks), and its errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.train_helpers import TINY

from data_tools.cli import main as data_main
from data_tools.inspect_run import RunQuery, run_samples
from data_tools.tokenizer import load_tokenizer
from megabeta.config import load_config
from megabeta.data import MaskedSample, collate_tokens, split_batch
from megabeta.train import loop

STEPS = 3


@pytest.fixture(scope="module")
def fed(tiny_data, tmp_path_factory) -> tuple[Path, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A 3-step run and the (inputs, targets) of every step, as the trainer fed them."""
    prefix, tokenizer = tiny_data
    run_dir = tmp_path_factory.mktemp("inspect") / "run"
    config = load_config(TINY[0].partition("=")[2], [
        *TINY[1:], f"--data.path={prefix},{prefix}", "--data.weights=1,3",
        "--data.align=document", f"--data.tokenizer={tokenizer}", f"--run_dir={run_dir}",
        f"--train.steps={STEPS}", "--checkpoint.interval=0", "--checkpoint.save_at_end=false"])
    steps = []
    accumulate = loop.accumulate_step

    def recording(engine, micro_batches, device, world_size):
        inputs, targets = zip(*map(split_batch, micro_batches))
        steps.append((torch.cat(inputs), torch.cat(targets)))
        return accumulate(engine, micro_batches, device, world_size)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see conftest's one_torch_thread (a module-scoped run here)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(loop, "accumulate_step", recording)
            loop.Trainer(config).train()
    finally:
        torch.set_num_threads(threads)
    return run_dir, steps


def as_batch(samples) -> tuple[torch.Tensor, torch.Tensor]:
    return split_batch(collate_tokens([s.tokens if s.mask is None else
                                       MaskedSample(s.tokens, s.mask) for s in samples]))


def test_each_step_shows_the_samples_the_trainer_fed(fed):
    run_dir, steps = fed
    assert len(steps) == STEPS
    for step, (inputs, targets) in enumerate(steps, start=1):
        run = run_samples(RunQuery(str(run_dir), step=step))
        assert [s.position for s in run.samples] == list(range(4 * step - 4, 4 * step))
        shown_inputs, shown_targets = as_batch(run.samples)
        assert torch.equal(shown_inputs, inputs) and torch.equal(shown_targets, targets)
        # One sample looked up by its stream position or by its index is the same sample.
        third = run.samples[2]
        (by_position,) = run_samples(RunQuery(str(run_dir), position=third.position)).samples
        (by_index,) = run_samples(RunQuery(str(run_dir), sample=third.index)).samples
        assert by_position.index == by_index.index == third.index
        assert (by_index.tokens == third.tokens).all() and (by_index.mask == third.mask).all()


def test_the_command_decodes_them_with_the_run_tokenizer(fed, tiny_data, capsys):
    run_dir, _ = fed
    assert data_main(["inspect", "--run", str(run_dir), "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert "step 2     stream positions [4, 8) of train.global_batch 4" in out
    assert "align document" in out and "(weights 1.0, 3.0)" in out
    processor = load_tokenizer(tiny_data[1])
    for sample in run_samples(RunQuery(str(run_dir), step=2)).samples:
        assert (f"position {sample.position}: training sample {sample.index} "
                f"({len(sample.tokens)} tokens") in out
        assert f"  text     {processor.decode(sample.tokens.tolist())!r}" in out


@pytest.mark.parametrize("args, message", [
    (["--run", "{missing}", "--step", "1"], "--run {missing}: no such run directory"),
    (["--run", "{run}", "--step", "0"], "--step 0: {run}/config.toml trains train.steps = 3 "
                                        "steps; pass a step in 1..3"),
    (["--run", "{run}", "--step", "4"], "--step 4:"),
    (["--run", "{run}", "--position", "12"], "--position 12: the run's 3 steps of 4 samples "
                                             "read the stream positions 0..11"),
    (["--run", "{run}", "--sample", "-1"], "--sample -1: the run's training split has"),
])
def test_a_position_outside_the_run_is_a_clear_error(fed, tmp_path, capsys, args, message):
    run_dir, _ = fed
    names = {"run": run_dir, "missing": tmp_path / "nowhere"}
    assert data_main(["inspect", *(a.format(**names) for a in args)]) == 2
    assert f"error: {message.format(**names)}" in capsys.readouterr().err


def test_flags_of_a_run_need_a_run(tiny_data, capsys):
    with pytest.raises(SystemExit) as caught:
        data_main(["inspect", str(tiny_data[0]), "--step", "3"])
    assert caught.value.code == 2
    assert "--step picks a sample of a training run: add --run RUN_DIR" in capsys.readouterr().err
