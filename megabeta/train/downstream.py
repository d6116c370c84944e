"""Downstream evals during training: task files of `megabeta tasks make` (`eval.tasks`, exact
match, sharded across ranks) and lm-evaluation-harness tasks (`eval.lm_eval_tasks`, on rank 0),
every `eval.downstream_interval` steps and at the end, logged as `eval/<task>/<metric>`.

Everything they need is checked when the run starts, before the first step: the tokenizer, every
task file (read, encoded, each document within the model's context), that lm-eval is installed
and knows every task name. An eval then runs on a copy of the model that shares nothing with the
training's execution: built on the meta device (no initialisation, no random draws), given the
full parameters (under FSDP2 gathered from every rank's shards), eager, in eval mode, without
gradients. It saves and restores Python's, NumPy's, torch's and CUDA's global generators around
itself (the harness reseeds all of them), and touches neither the data loader nor the optimizer,
so a run with downstream evals takes bitwise the steps of one without, resumed or not.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from data_tools.tokenizer import Tokenizer, load_tokenizer
from megabeta.checkpoint.manager import capture_rng, restore_rng
from megabeta.config import TrainConfig
from megabeta.data import DataError
from megabeta.extras import require
from megabeta.model import ConfigError, DecoderLM, ExecutionConfig, build_model
from megabeta.tasks.document import TaskFileError
from megabeta.tasks.evaluate import read_encoded, score_encoded


class DownstreamEvals:
    """The run's downstream evals, checked at start-up; `run(model)` scores one state of it."""

    def __init__(self, config: TrainConfig, tokenizer: dict[str, str], *, rank: int,
                 world_size: int, device: torch.device) -> None:
        """`tokenizer`: the run's tokenizer record (path, sha256). ConfigError naming the
        [eval] key for anything that would fail later."""
        settings = config.eval
        self.rank, self.world_size, self.device = rank, world_size, device
        self.batch_size = config.train.micro_batch
        if config.parallel.backend == "deepspeed" and config.parallel.zero_stage == 3:
            raise ConfigError("eval.tasks / eval.lm_eval_tasks with parallel.zero_stage = 3: "
                              "the full parameters are not gathered under ZeRO-3; evaluate "
                              "saved checkpoints with `megabeta tasks eval` / `megabeta eval "
                              "--lm-eval` instead, or use parallel.backend = fsdp")
        self.tokenizer = self._tokenizer(tokenizer)
        try:
            self.documents = read_encoded(settings.tasks, self.tokenizer,
                                          config.model.max_seq_len, flag="eval.tasks")
        except TaskFileError as err:
            raise ConfigError(str(err)) from None
        # Task names in order of first appearance, the same on every rank: the all-reduce's order.
        self.task_names = list(dict.fromkeys(d.task for d in self.documents))
        self.harness = None
        if settings.lm_eval_tasks:
            # Checked on every rank (not only rank 0, which runs them): a bad name stops all.
            require("lm_eval", "eval", "eval.lm_eval_tasks")
            from megabeta.infer import lm_eval as harness
            from megabeta.infer.loading import UsageError

            try:
                self.harness = harness.find_tasks(settings.lm_eval_tasks,
                                                  settings.lm_eval_include,
                                                  names_flag="eval.lm_eval_tasks",
                                                  include_flag="eval.lm_eval_include")
            except UsageError as err:
                raise ConfigError(str(err)) from None
            self.limit = settings.lm_eval_limit or None
            if self.limit is not None and self.limit >= 1:
                self.limit = int(self.limit)
            self.num_fewshot = (None if settings.lm_eval_num_fewshot < 0
                                else settings.lm_eval_num_fewshot)

    def _tokenizer(self, record: dict[str, str]) -> Tokenizer:
        path = record.get("path", "")
        if not path:
            raise ConfigError("eval.tasks / eval.lm_eval_tasks need the run's tokenizer: set "
                              "data.tokenizer (the dataset's sidecar names none)")
        try:
            return load_tokenizer(path)
        except DataError as err:
            raise ConfigError(f"eval.tasks / eval.lm_eval_tasks need the run's tokenizer: {err}"
                              "; set data.tokenizer to it") from None

    def describe(self) -> str:
        parts = []
        if self.task_names:
            parts.append(f"{len(self.documents)} task documents ({', '.join(self.task_names)}) "
                         f"over {self.world_size} rank(s)")
        if self.harness is not None:
            parts.append(f"lm-eval {','.join(self.harness.names)} on rank 0")
        return "; ".join(parts)

    @torch.no_grad()
    def run(self, model: nn.Module) -> dict[str, float]:
        """`<task>/<metric>` of the training `model` as it is now (a collective: every rank
        calls it), plus `downstream_s`, the seconds it took."""
        start = time.perf_counter()
        rng = capture_rng()
        try:
            copy = self._eval_copy(model)
            metrics = self._score_tasks(copy)
            if self.harness is not None and self.rank == 0:
                metrics.update(self._run_harness(copy))
            del copy
        finally:
            restore_rng(rng)
        if self.world_size > 1 and self.harness is not None:
            dist.barrier()  # the other ranks wait for rank 0's harness
        metrics["downstream_s"] = time.perf_counter() - start
        return metrics

    def _eval_copy(self, model: nn.Module) -> DecoderLM:
        """An eager, unsharded model with `model`'s parameters, on this rank's device. Under
        FSDP2 the gather is a collective; otherwise the copy shares the parameters' storage."""
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        with torch.device("meta"):
            copy = build_model(model.config, ExecutionConfig())
        copy.load_state_dict(state, assign=True)
        return copy.to(self.device).eval()

    def _score_tasks(self, model: DecoderLM) -> dict[str, float]:
        if not self.documents:
            return {}
        shard = self.documents[self.rank::self.world_size]
        scores = score_encoded(model, shard, pad_id=max(self.tokenizer.pad_id, 0),
                               batch_size=self.batch_size, device=self.device)
        counts = torch.tensor([[scores[t].answers, scores[t].correct] if t in scores else [0, 0]
                               for t in self.task_names], dtype=torch.float64,
                              device=self.device)
        if self.world_size > 1:
            dist.all_reduce(counts)
        return {f"{task}/accuracy": float(correct / answers)
                for task, (answers, correct) in zip(self.task_names, counts.tolist()) if answers}

    def _run_harness(self, model: DecoderLM) -> dict[str, Any]:
        from megabeta.infer import lm_eval as harness

        lm = harness.MegabetaLM(model, self.tokenizer, batch_size=self.batch_size)
        # No bootstrap: only the metrics are logged, not their standard errors.
        results = harness.run_tasks(lm, self.harness, limit=self.limit,
                                    num_fewshot=self.num_fewshot, bootstrap_iters=0)
        return harness.metric_values(results)


def build_downstream(config: TrainConfig, tokenizer: dict[str, str], *, rank: int,
                     world_size: int, device: torch.device) -> DownstreamEvals | None:
    """The run's downstream evals, or None when [eval] names none."""
    if not config.eval.tasks and not config.eval.lm_eval_tasks:
        return None
    return DownstreamEvals(config, tokenizer, rank=rank, world_size=world_size, device=device)


__all__ = ["DownstreamEvals", "build_downstream"]
