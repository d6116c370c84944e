"""The training loop: set up, then step, log, evaluate, checkpoint, until done or preempted.

    setup:  ranks → device → seeds → data → model (vocab from the data) → engine → resume
    step:   lr → micro-batches (forward, backward) → clip, skip if non-finite, update → log
            (the step's loss is the mean over the scored targets of all its micro-batches on all
            ranks, and its gradients are that mean's: `accumulate_step`)
    every:  eval.interval → evaluate; eval.downstream_interval → downstream evals (task files,
            lm-eval tasks: downstream.py); checkpoint.interval → save
    signal: SIGTERM / SIGUSR1 / SIGINT → finish the step, save, (requeue under SLURM), exit 0
    watch:  profiler, memory split, spikes, stragglers, hangs, beta_1.2's dials: the hooks of
            `Diagnostics` (diagnostics.py), configured by [profile] and [monitor]
"""

from __future__ import annotations

import functools
import logging
import math
import os
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException as DCPCheckpointException

from megabeta.checkpoint import CheckpointError, CheckpointManager, TrainState
from megabeta.checkpoint.export import load_model, read_source
from megabeta.checkpoint.manager import describe_load_error
from megabeta.config import TrainConfig, config_to_dict, save_config
from megabeta.data import (
    MaskedBatch,
    StatefulLoader,
    batch_documents,
    build_run_data,
    count_scored,
    split_batch,
)
from megabeta.data.loader import Batch
from megabeta.engine import Engine, build_engine
from megabeta.engine.base import document_kwargs
from megabeta.infer.evaluate import evaluate
from megabeta.model import ConfigError, ModelConfig, build_model, count_parameters
from megabeta.model.flops import training_flops
from megabeta.parallel.env import choose_device, init_distributed
from megabeta.train.curriculum import block_size_at, training_block_size
from megabeta.train.diagnostics import Diagnostics
from megabeta.model.documents import require_document_mask_support
from megabeta.train.downstream import build_downstream
from megabeta.train.logs import setup_logging
from megabeta.train.metrics import MetricsLogger, device_peak_flops, memory_gib
from megabeta.train.schedule import horizon_change_warning, lr_at, schedule_horizon
from megabeta.train.signals import PreemptionHandler, maybe_requeue
from megabeta.train.trackers import build_trackers
from megabeta.train.watchdog import enable_flight_recorder

log = logging.getLogger("megabeta")


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (too many skipped steps, a spike with monitor.spike_action =
    stop, out of memory); the message says why."""


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=False)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def _all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        value = value.clone()
        dist.all_reduce(value)
    return value


def accumulate_step(engine: Engine, micro_batches: list[Batch], device: torch.device,
                    world_size: int) -> float:
    """Forward and backward of one optimizer step's micro-batches on this rank; returns the
    step's loss: the sum of the per-token losses over the scored targets of every micro-batch
    of every rank, over their global count N. The accumulated (and, by the engine, rank-averaged)
    gradients are that mean's, so neither depends on the world size or the accumulation.

    Each micro-batch's mean is weighted by its scored count n_m (engine/base.py's `scale`). N of
    plain batches is known from their shapes (every rank's are equally full); masked batches
    are counted here, on the host before they move, and N is all-reduced once. With every
    micro-batch equally full the weights are exactly 1/A, as with a per-micro-batch mean.
    """
    counts = [count_scored(batch) for batch in micro_batches]
    if any(isinstance(batch, MaskedBatch) for batch in micro_batches):
        total = int(_all_reduce_sum(torch.tensor(sum(counts), dtype=torch.int64, device=device)))
    else:
        total = sum(counts) * world_size
    # No scored target in the whole step: zero gradients and loss 0 rather than 0/0.
    total = max(total, 1)
    summed = []
    for index, (batch, count) in enumerate(zip(micro_batches, counts)):
        batch = batch.to(device, non_blocking=True)
        inputs, targets = split_batch(batch)
        loss = engine.forward_backward(inputs, targets, last=index == len(micro_batches) - 1,
                                       scale=count * world_size / total,
                                       **document_kwargs(batch_documents(batch)))
        summed.append(loss.double() * count)
    return float(_all_reduce_sum(torch.stack(summed).sum())) / total


class Trainer:
    """One training run of `config` on this process's rank."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        if config.monitor.hang_seconds > 0:
            enable_flight_recorder()  # before the process group exists, or NCCL ignores it
        self.env = init_distributed(config.parallel.dist_backend,
                                    group_for_one=config.parallel.backend != "single")
        setup_logging(self.env)
        self.device = choose_device(self.env)
        # Nothing is written until set-up has succeeded, so a run that fails at start-up (a data,
        # config or checkpoint error) leaves no empty run directory behind.
        self.run_dir = Path(config.run_dir)
        seed_everything(config.train.seed, config.train.deterministic)
        self.grad_accumulation = config.grad_accumulation(self.env.world_size)
        self._setup_data()
        # Before the checkpoint and the model: a bad task file or task name costs no start-up.
        self.downstream = build_downstream(config,
                                           self.data.tokenizer_record(config.data.tokenizer),
                                           rank=self.env.rank, world_size=self.env.world_size,
                                           device=self.device)
        self.checkpoints = CheckpointManager(self.run_dir, config.checkpoint.keep)
        resume = self.checkpoints.resolve(config.resume)
        if resume is not None:
            self._check_compatible(resume[1])
        # Same seed on every rank: identical initial weights. The engine moves the model to the
        # device, where its attention backend is chosen (DecoderLM._select_kernels).
        model = build_model(config.model, config.execution)
        if config.model.init_from and resume is None:
            self._initialise_from(model, config.model.init_from)
        if config.data.document_mask:
            require_document_mask_support(model)
        self.engine = build_engine(
            model, config, self.device, grad_accumulation=self.grad_accumulation,
            resharding=resume is not None and resume[1].world_size != self.env.world_size)
        if config.train.block_size_schedule:
            # The executor on the model's device (chosen when it was placed there).
            self.engine.model.executor.allow_block_sizes(len(config.train.block_size_schedule))
            log.info("block-size curriculum (train.block_size_schedule): %s",
                     ", ".join(f"c = {c} from step {s}"
                               for s, c in config.train.block_size_schedule))
        self.state = TrainState(backend=config.parallel.backend, world_size=self.env.world_size,
                                model_config=asdict(config.model),
                                tokenizer=self.data.tokenizer_record(config.data.tokenizer),
                                schedule_horizon=schedule_horizon(config.train.steps,
                                                                  config.schedule))
        if resume is not None:
            self._resume(*resume)
        if self.env.is_rank0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(config, self.run_dir / "config.toml")
        dtype = torch.bfloat16 if config.train.precision == "bf16" else torch.float32
        self.peak_flops, peak_source = device_peak_flops(self.device, dtype)
        self.step_flops = config.train.global_batch * training_flops(config.model,
                                                                     config.data.seq_len)
        log.info("run %s | %s on %d rank(s) (%s) | %s | %d params | accumulation %d | "
                 "peak %.3g FLOP/s per rank (%s) | attention %s", self.run_dir,
                 config.parallel.backend, self.env.world_size, self.env.launcher,
                 config.model.arch, count_parameters(config.model), self.grad_accumulation,
                 self.peak_flops, peak_source, self.engine.model.attention_backend.name)
        if self.downstream is not None:
            log.info("downstream evals (%s): %s",
                     f"every {config.eval.downstream_interval} steps and at the end"
                     if config.eval.downstream_interval else "at the end",
                     self.downstream.describe())

    # ---- set-up -----------------------------------------------------------------------------------
    def _setup_data(self) -> None:
        config = self.config
        if not config.data.path:
            raise ConfigError("data.path is empty: pass --data.path=PREFIX (a dataset made by "
                              "`megabeta-data tokenize`)")
        if config.data.tokenizer and not Path(config.data.tokenizer).is_file():
            raise ConfigError(f"data.tokenizer = {config.data.tokenizer!r}: no such file; pass the "
                              "tokenizer (.model or tokenizer.json) the dataset was tokenized "
                              "with, or leave it empty")
        self.data = build_run_data(config.data, block_size=config.model.block_size)
        vocab = self.data.vocab_size
        if config.model.vocab_size == -1:
            vocab = self.data.require_vocab_size("model.vocab_size = -1")
            config.model = config.model.replace(vocab_size=vocab)
        elif vocab is not None and config.model.vocab_size < vocab:
            raise ConfigError(f"model.vocab_size = {config.model.vocab_size} is smaller than the "
                              f"dataset's vocabulary ({vocab}); set -1 to take it from the data")
        self.sampler = self.data.train_sampler(self.env.world_size, self.env.rank,
                                               config.train.seed)
        self.loader = StatefulLoader(self.data.train, self.sampler, config.train.micro_batch,
                                     num_workers=config.data.num_workers)

    def _check_compatible(self, saved: TrainState) -> None:
        """Refuse a checkpoint this run cannot continue: another engine, or a model whose
        parameters or function differ (execution settings, dropout and max_seq_len may change)."""
        if saved.backend != self.config.parallel.backend:
            raise CheckpointError(f"checkpoint was written by parallel.backend = "
                                  f"{saved.backend!r}, this run uses "
                                  f"{self.config.parallel.backend!r}; resume with the same backend "
                                  "(or `megabeta export` it and start from the export)")
        changed = self.config.model.identity_changes(saved.model_config)
        if changed:
            was = ModelConfig.from_saved(saved.model_config)
            diffs = ", ".join(f"model.{k} = {getattr(was, k)!r} in the checkpoint, "
                              f"{getattr(self.config.model, k)!r} now" for k in changed)
            raise CheckpointError(f"cannot resume: {diffs}; these define the parameters or the "
                                  "function, resume with the values the checkpoint was trained "
                                  "with")
        warning = horizon_change_warning(saved.step, saved.schedule_horizon,
                                         self.config.train.steps, self.config.optim,
                                         self.config.schedule)
        if warning and self.env.is_rank0:
            log.warning("%s", warning)

    def _initialise_from(self, model: torch.nn.Module, path: str) -> None:
        """Load the weights of the model at `path` (model.init_from): the same parameters and
        function as this run's model, and a tokenizer the run's data was made with."""
        source = read_source(path)
        changed = self.config.model.identity_changes(asdict(source.model_config))
        if changed:
            diffs = ", ".join(f"model.{k} = {getattr(source.model_config, k)!r} there, "
                              f"{getattr(self.config.model, k)!r} here" for k in changed)
            raise CheckpointError(f"model.init_from = {path!r}: {diffs}; leave these fields out "
                                  "(they come from the model) or start from a model of this "
                                  "shape")
        model_sha = source.tokenizer.get("sha256")
        data_sha = self.data.tokenizer_record(self.config.data.tokenizer).get("sha256")
        if model_sha and data_sha and model_sha != data_sha:
            raise ConfigError(f"model.init_from = {path!r}: its model was trained with another "
                              f"tokenizer (sha256 {model_sha[:16]}…) than data.path was "
                              f"tokenized with ({data_sha[:16]}…): its token ids would stand "
                              "for other text. Tokenize the data with the model's tokenizer "
                              f"({source.tokenizer.get('path', '?')})")
        model.load_state_dict(load_model(path).state_dict())
        log.info("initialised the weights from %s", path)

    def _resume(self, path: Path, saved: TrainState) -> None:
        try:
            self.engine.load(path / "model")
        except (Exception, DCPCheckpointException) as err:  # noqa: BLE001 - any failure here
            # means an unusable checkpoint (DCP's exception derives from BaseException). One line
            # of it, not its text: DCP's message embeds every rank's traceback.
            log.debug("loading %s failed", path / "model", exc_info=True)
            raise CheckpointError(f"could not load model/optimizer shards from {path / 'model'}: "
                                  f"{describe_load_error(err)}; its shards may be damaged or "
                                  "written by another run"
                                  f"{self.checkpoints.alternatives_hint(path)}") from None
        self.loader.load_state_dict(saved.data)
        exact_rng = self.checkpoints.load_rng(path, self.env.world_size)
        if not exact_rng:
            log.warning("checkpoint %s was written by %d ranks, this run has %d: RNG streams "
                        "restart from the seed", path, saved.world_size, self.env.world_size)
        self.state.step, self.state.tokens_seen = saved.step, saved.tokens_seen
        self.state.skipped_steps = saved.skipped_steps
        log.info("resumed from %s at step %d (%d tokens seen)", path, saved.step,
                 saved.tokens_seen)

    # ---- the loop ---------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Run to `train.steps` (or a stop signal). Returns the last logged metrics, with
        `"preempted": True` when a stop signal ended the run."""
        metrics = MetricsLogger(self.run_dir, enabled=self.env.is_rank0,
                                trackers=lambda: build_trackers(
                                    self.run_dir, self.config.logging,
                                    config_to_dict(self.config)))
        diagnostics = Diagnostics(self.config, self.run_dir, rank=self.env.rank,
                                  world_size=self.env.world_size, device=self.device,
                                  model=self.engine.model,
                                  optimizer=getattr(self.engine, "optimizer", None))
        try:
            return self._loop(metrics, diagnostics)
        except torch.OutOfMemoryError:
            raise TrainingStopped(f"out of memory at step {self.state.step + 1} on rank "
                                  f"{self.env.rank}: "
                                  f"{diagnostics.out_of_memory(self.state.step + 1)}") from None
        finally:
            # The one way out, whatever ended the loop: a save in flight completes, metrics flush.
            diagnostics.close()
            self.checkpoints.finalize()
            metrics.close()

    def _loop(self, metrics: MetricsLogger, diagnostics: Diagnostics) -> dict[str, Any]:
        config = self.config
        batches = iter(self.loader)
        skipped_in_a_row = 0
        last: dict[str, Any] = {}
        tokens_per_step = config.train.global_batch * config.data.seq_len
        first_step = self.state.step
        probe: torch.Tensor | None = None
        with PreemptionHandler() as preemption:
            while self.state.step < config.train.steps:
                step = self.state.step + 1
                diagnostics.begin(step)
                start = time.perf_counter()
                lr = lr_at(self.state.step, config.train.steps, config.optim, config.schedule)
                self.engine.set_lr(lr)
                positions = (self.sampler.samples_consumed,)
                micro_batches = [next(batches) for _ in range(self.grad_accumulation)]
                positions += (self.sampler.samples_consumed,)
                data_seconds = time.perf_counter() - start
                if probe is None:
                    probe = self._probe(micro_batches[0])
                diagnostics.enter("forward_backward")
                block_size = block_size_at(config.train.block_size_schedule, self.state.step)
                with diagnostics.measuring(), training_block_size(self.engine.model, block_size):
                    loss = accumulate_step(self.engine, micro_batches, self.device,
                                           self.env.world_size)
                accept = diagnostics.gate(step, loss)
                diagnostics.enter("optimizer")
                result = self.engine.step(math.isfinite(loss), accept)
                grad_norm, applied = result.grad_norm, result.applied
                spike = diagnostics.spike()
                self.state.step = step
                self.state.tokens_seen += tokens_per_step
                if applied:
                    skipped_in_a_row = 0
                else:
                    skipped_in_a_row += 1
                    self.state.skipped_steps += 1
                    if spike is None:
                        log.warning("step %d skipped: loss %s, grad norm %s (%d in a row)",
                                    step, loss, grad_norm, skipped_in_a_row)
                if spike is not None:
                    diagnostics.report_spike(spike, positions, [self.sampler.sample_at(p)
                                                                for p in range(*positions)])
                seconds = time.perf_counter() - start
                diagnostics.end(step, data_seconds, seconds,
                                last=step >= config.train.steps)
                if step % config.logging.interval == 0 or not applied or spike is not None:
                    last = {"loss": loss, "lr": lr, "grad_norm": grad_norm,
                            "tokens_per_s": tokens_per_step / seconds, "s_per_batch": seconds,
                            "mfu": self.step_flops / seconds / self.env.world_size
                            / self.peak_flops,
                            "memory_gib": memory_gib(self.device),
                            "tokens": self.state.tokens_seen,
                            "samples": self.sampler.samples_consumed,
                            "skipped": self.state.skipped_steps,
                            **({"block_size": block_size} if block_size is not None else {}),
                            **({"spike": 1} if spike is not None else {})}
                    metrics.log(step, last)
                if step % config.logging.interval == 0:
                    for prefix, scalars, histograms in diagnostics.on_log(step, probe):
                        metrics.log(step, scalars, prefix=prefix, quiet=True)
                        metrics.histograms(step, histograms, prefix=prefix)
                if spike is not None and config.monitor.spike_action == "stop":
                    diagnostics.enter("checkpoint")
                    path = self.save()
                    raise TrainingStopped(
                        f"spike at step {step} (monitor.spike_action = stop): its update was "
                        f"skipped and the last good state saved to {path}; inspect the data "
                        f"position logged above, then resume (--resume=auto continues after "
                        f"that batch) or lower optim.lr")
                if skipped_in_a_row >= config.train.max_nonfinite:
                    what = "non-finite" if spike is None else "skipped (non-finite or spike)"
                    raise TrainingStopped(
                        f"{skipped_in_a_row} {what} steps in a row (train.max_nonfinite = "
                        f"{config.train.max_nonfinite}) at step {step}: lower optim.lr, "
                        "check the data, or resume from an earlier checkpoint")
                done = step >= config.train.steps
                if config.eval.interval and step % config.eval.interval == 0 and not done:
                    diagnostics.enter("eval")
                    metrics.log(step, self.evaluate(), prefix="eval")
                interval = config.eval.downstream_interval
                if self.downstream is not None and interval and step % interval == 0 and not done:
                    diagnostics.enter("eval")
                    metrics.log(step, self.downstream.run(self.engine.model), prefix="eval")
                exit_now = (config.train.exit_after and not done
                            and step - first_step >= config.train.exit_after)
                if preemption.should_stop() or exit_now:
                    log.info("%s: saving at step %d and exiting",
                                "train.exit_after reached" if exit_now else "preempted", step)
                    diagnostics.enter("checkpoint")
                    self.save()
                    self.checkpoints.finalize()
                    if not exit_now:
                        maybe_requeue(config.checkpoint.requeue)
                        last["preempted"] = True
                    return last
                if config.checkpoint.interval and step % config.checkpoint.interval == 0 and not done:
                    diagnostics.enter("checkpoint")
                    self.save()
        diagnostics.enter("eval")
        final_eval = self.evaluate()
        if final_eval:
            metrics.log(self.state.step, final_eval, prefix="eval")
            last.update({f"eval_{k}": v for k, v in final_eval.items()})
        if self.downstream is not None:
            metrics.log(self.state.step, self.downstream.run(self.engine.model), prefix="eval")
        if config.checkpoint.save_at_end:
            self.save()
        return last

    def _probe(self, batch: Batch) -> torch.Tensor:
        """The fixed probe batch of beta_1.2's attention-mass dials: the first
        `monitor.probe_batch` inputs of this launch's first micro-batch."""
        inputs, _ = split_batch(batch)
        return inputs[:self.config.monitor.probe_batch].to(self.device)

    def save(self) -> Path:
        self.state.data = self.loader.state_dict()
        write = functools.partial(self.engine.save,
                                  async_save=self.config.checkpoint.async_save)
        return self.checkpoints.save(self.state.step, self.state, write)

    def evaluate(self) -> dict[str, float]:
        """Mean loss and perplexity over the validation split (or `eval.batches` of it)."""
        if self.data.val is None:
            return {}
        model = self.engine.model
        was_training = model.training
        model.eval()
        try:
            result = evaluate(self.engine.eval_loss, self.data.val,
                              self.data.val_sampler(self.env.world_size, self.env.rank),
                              batch_size=self.config.train.micro_batch,
                              max_batches=self.config.eval.batches, device=self.device)
        finally:
            model.train(was_training)
        return {"loss": result["loss"], "ppl": result["ppl"]}


def run(config: TrainConfig) -> dict[str, Any]:
    """Train `config` on this rank; the entry point of `megabeta train`."""
    return Trainer(config).train()


__all__ = ["Trainer", "TrainingStopped", "accumulate_step", "run"]
