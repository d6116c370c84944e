"""``inspect --run``: the training samples a run read at a step or stream position, decoded.

A training sample is a ``seq_len + 1``-token window of the run's (blended, packed or
document-aligned) training split, not a document of a ``.bin``; the stability monitor's spike
warning names the step, its stream positions and the sample indices they map to. This rebuilds
the run's data from the config.toml the run recorded, through the trainer's own
``build_run_data`` and global sampler (``train.seed``), and decodes the samples with the run's
tokenizer.

Step ``n`` read the stream positions ``[(n - 1) * B, n * B)`` of ``B = train.global_batch``
whatever the world size (``megabeta.data.sampler``), skipped steps included. config.toml is the
last launch's: for a run resumed with another global batch, look up the positions of the spike
warning with ``--position`` instead of ``--step``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import numpy as np

from data_tools.tokenizer import Tokenizer, load_tokenizer
from megabeta.data.build import TrainValData, build_run_data
from megabeta.data.errors import DataError
from megabeta.data.sample import MaskedSample

if TYPE_CHECKING:
    from megabeta.config import TrainConfig


@dataclass(frozen=True)
class RunQuery:
    """Which samples of a run to show: exactly one of ``step``, ``position``, ``sample``."""

    run_dir: str
    """The run's directory (holds the config.toml the trainer recorded)."""
    step: int | None = None
    """Every sample of this optimizer step (counted from 1)."""
    position: int | None = None
    """The sample at this position of the run's global sample stream."""
    sample: int | None = None
    """This index of the training split."""
    tokenizer: str | None = None
    """Model to decode with, instead of the run's."""


@dataclass(frozen=True)
class RunSample:
    """One training sample as the run read it."""

    position: int | None
    """In the global sample stream (None when looked up by index)."""
    index: int
    """In the training split."""
    tokens: np.ndarray
    """int64 [seq_len + 1]"""
    mask: np.ndarray | None
    """uint8 [seq_len + 1], 1 = scored target; None when every target is scored."""


@dataclass
class RunData:
    """A run's recorded config, its rebuilt data, the samples asked for and the tokenizer."""

    config: TrainConfig
    config_path: Path
    data: TrainValData
    samples: list[RunSample]
    tokenizer: Tokenizer | None
    tokenizer_note: str
    """Which tokenizer decodes, or why none does."""


def load_run_config(run_dir: str | Path) -> tuple[TrainConfig, Path]:
    """The config.toml a run recorded, and its path; DataError naming what is missing."""
    from megabeta.config import load_config
    from megabeta.model.config import ConfigError

    run = Path(run_dir)
    if not run.is_dir():
        raise DataError(f"--run {run_dir}: no such run directory; pass the run_dir of a training "
                        "run (the folder holding its config.toml and metrics.jsonl)")
    path = run / "config.toml"
    if not path.is_file():
        raise DataError(f"--run {run_dir}: no config.toml in it; the trainer writes one at start, "
                        "pass the run_dir of a run that got past its set-up")
    try:
        return load_config(path), path
    except ConfigError as err:
        raise DataError(f"{path}: {err}") from None


def run_samples(query: RunQuery) -> RunData:
    """The samples ``query`` names, read through the run's data pipeline as the trainer built
    it. DataError naming the flag for a position outside the run or the training split."""
    config, config_path = load_run_config(query.run_dir)
    recorded = config.data.tokenizer
    if recorded and not query.tokenizer and not Path(recorded).is_file():
        raise DataError(f"{config_path}: data.tokenizer = {recorded!r} is not here; pass "
                        "--tokenizer MODEL, the tokenizer the run was trained with")
    data = build_run_data(config.data, block_size=config.model.block_size,
                          tokenizer=query.tokenizer or "")
    sampler = data.train_sampler(1, 0, config.train.seed)
    batch = config.train.global_batch
    last = config.train.steps * batch
    if query.step is not None:
        if not 1 <= query.step <= config.train.steps:
            raise DataError(f"--step {query.step}: {config_path} trains train.steps = "
                            f"{config.train.steps} steps; pass a step in 1..{config.train.steps}")
        positions = range((query.step - 1) * batch, query.step * batch)
        picks = [(p, sampler.sample_at(p)) for p in positions]
    elif query.position is not None:
        if not 0 <= query.position < last:
            raise DataError(f"--position {query.position}: the run's {config.train.steps} steps "
                            f"of {batch} samples read the stream positions 0..{last - 1} "
                            f"({config_path}); pass one of them")
        picks = [(query.position, sampler.sample_at(query.position))]
    else:
        size = len(data.train)
        if not 0 <= query.sample < size:
            raise DataError(f"--sample {query.sample}: the run's training split has {size:,} "
                            f"samples (0..{size - 1}); pass a sample index of the spike warning's "
                            "`dataset samples`")
        picks = [(None, query.sample)]
    samples = [_read(data, position, index) for position, index in picks]
    tokenizer_path = query.tokenizer or data.tokenizer_record(recorded).get("path")
    if not tokenizer_path:
        return RunData(config, config_path, data, samples, None,
                       "none recorded (no data.tokenizer, no sidecar naming one); pass "
                       "--tokenizer to decode")
    return RunData(config, config_path, data, samples, load_tokenizer(tokenizer_path),
                   str(tokenizer_path))


def _read(data: TrainValData, position: int | None, index: int) -> RunSample:
    item = data.train[index]
    if isinstance(item, MaskedSample):
        return RunSample(position, index, np.asarray(item.tokens), np.asarray(item.mask))
    return RunSample(position, index, np.asarray(item), None)


def inspect_run(query: RunQuery, out: TextIO) -> None:
    """Print the run's data settings and the samples ``query`` names, decoded."""
    run = run_samples(query)
    data, config = run.config.data, run.config
    weights = f" (weights {', '.join(map(str, data.weights))})" if data.weights else ""
    print(f"run        {query.run_dir}  (config {run.config_path})", file=out)
    print(f"data       {', '.join(data.path)}{weights}: seq_len {data.seq_len}, align "
          f"{data.align}, val_fraction {data.val_fraction}, train.seed {config.train.seed}: "
          f"{len(run.data.train):,} training samples", file=out)
    if query.step is not None:
        first = run.samples[0].position
        print(f"step {query.step:<5} stream positions [{first}, {first + len(run.samples)}) of "
              f"train.global_batch {config.train.global_batch}", file=out)
    print(f"tokenizer  {run.tokenizer_note}", file=out)
    for sample in run.samples:
        where = "" if sample.position is None else f"position {sample.position}: "
        scored = "" if sample.mask is None else f", {int(sample.mask[1:].sum())} scored targets"
        print(f"sample     {where}training sample {sample.index} ({len(sample.tokens)} tokens"
              f"{scored})", file=out)
        ids = sample.tokens.tolist()
        if run.tokenizer is None:
            print(f"  ids      {ids}", file=out)
            continue
        print(f"  text     {run.tokenizer.decode(ids)!r}", file=out)
        if sample.mask is not None:
            # mask[0] is no target (nothing precedes the first token), so it is not shown.
            targets = [i for i, m in zip(ids[1:], sample.mask[1:].tolist()) if m]
            print(f"  scored   {run.tokenizer.decode(targets)!r}", file=out)


__all__ = ["RunData", "RunQuery", "RunSample", "inspect_run", "load_run_config", "run_samples"]
