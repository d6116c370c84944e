"""Run configuration: dataclass sections loaded from TOML, with `--section.key=value` overrides.

Every field has a default and a one-line doc (the string under it); `megabeta train --help-config`
prints them all. A config is validated once, at start-up, and saved into the run directory as
`config.toml`, which loads back to the same config.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import tomli_w

from megabeta.config_loader import (field_docs, field_types, flatten, parse_overrides,
                                    read_toml, renamed, typed_tables)
from megabeta.model.config import (MOVED_FIELDS, RESUMABLE_FIELDS, ConfigError, ModelConfig,
                                   get_preset)
from megabeta.model.execution import ExecutionConfig
from megabeta.storage.durable import write_durably

ModelReader = Callable[[str], ModelConfig]
"""The config of the model at a path (`model.init_from`), read without its weights."""


@dataclass
class DataConfig:
    """Where the tokens come from."""

    path: list[str] = field(default_factory=list)
    """Dataset prefixes (PREFIX.bin/.idx made by `megabeta-data tokenize`); comma-separated on the CLI."""
    weights: list[float] = field(default_factory=list)
    """Blend weights, one per path; empty = proportional to size."""
    seq_len: int = 256
    """Tokens per training sample (each sample reads seq_len + 1 tokens)."""
    val_fraction: float = 0.01
    """Share of each dataset's documents (its last ones) held out for evaluation."""
    tokenizer: str = ""
    """Tokenizer of the run (.model or tokenizer.json): datasets made by another are refused; used to decode."""
    num_workers: int = 1
    """DataLoader worker processes per rank (0 = load in the training process)."""
    verify_token_ids: bool = False
    """Scan every token id against the vocabulary at start-up (O(tokens))."""
    align: str = "packed"
    """`packed` (cut across documents), `block` (packed, each document at a multiple of model.block_size; needs document_mask) or `document` (one per sample, from its start; longer documents are left out and counted)."""
    document_mask: bool = False
    """Give the model each token's document id (int32, from the .idx) so no token attends to another document (spec §7)."""


@dataclass
class TrainLoopConfig:
    """The step loop."""

    steps: int = 100
    """Optimizer steps to run (the run ends at this step)."""
    global_batch: int = 8
    """Sequences per optimizer step, over all ranks and accumulation steps."""
    micro_batch: int = 4
    """Sequences per forward/backward on one rank; accumulation = global / (micro * world)."""
    seed: int = 1234
    """Seed of parameters, data order and every RNG."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms (bitwise-repeatable runs, slower kernels)."""
    precision: str = "fp32"
    """`fp32` or `bf16` (autocast for the forward; parameters and optimizer stay fp32)."""
    max_nonfinite: int = 5
    """Stop the run after this many non-finite steps in a row (each one is skipped)."""
    exit_after: int = 0
    """Save and exit 0 after this many steps of this launch (time-sliced queues); 0 = off."""
    block_size_schedule: list[list[int]] = field(default_factory=list)
    """beta12: [[step, block_size], ...] from step 0, the last at model.block_size, e.g. [[0, 256], [300, 32]]: train at each block size from its step on (train/curriculum.py); empty = model.block_size throughout."""


@dataclass
class OptimConfig:
    """AdamW with decay on matrices only (norm weights, biases and beta_1.2's extras undecayed)."""

    lr: float = 3e-4
    """Peak learning rate."""
    weight_decay: float = 0.1
    """Decoupled weight decay of the decay group."""
    beta1: float = 0.9
    """Adam β1."""
    beta2: float = 0.95
    """Adam β2."""
    eps: float = 1e-8
    """Adam ε."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""


@dataclass
class ScheduleConfig:
    """Learning-rate schedule over train.steps (or schedule.total_steps)."""

    kind: str = "cosine"
    """`cosine` (warmup + cosine), `linear` (warmup + linear decay), `wsd` (warmup-stable-decay) or `constant`."""
    warmup_steps: int = 10
    """Linear warm-up steps from 0 to optim.lr."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of optim.lr."""
    decay_fraction: float = 0.2
    """`wsd` only: share of the schedule's steps spent in the final decay."""
    total_steps: int = 0
    """Steps the schedule decays over (0 = train.steps); extending a run, keep its original horizon here."""


@dataclass
class ParallelConfig:
    """How the model is distributed; the model code knows nothing of it."""

    backend: str = "single"
    """`single`, `ddp`, `fsdp` (FSDP2) or `deepspeed` (ZeRO)."""
    dist_backend: str = "auto"
    """torch.distributed backend: `auto` (nccl on GPU, gloo on CPU), `gloo` or `nccl`."""
    fsdp_param_dtype: str = "fp32"
    """FSDP2 MixedPrecisionPolicy parameter dtype: `fp32` or `bf16`."""
    fsdp_reduce_dtype: str = "fp32"
    """FSDP2 gradient reduction dtype: `fp32` or `bf16`."""
    zero_stage: int = 1
    """DeepSpeed ZeRO stage 1, 2 or 3."""
    deepspeed_optimizer: str = "torch"
    """`torch` (torch.optim.AdamW handed to the engine) or `deepspeed` (its own AdamW)."""


@dataclass
class CheckpointConfig:
    """Sharded checkpoints under <run_dir>/checkpoints."""

    interval: int = 0
    """Save every N steps (0 = only at the end and on preemption)."""
    keep: int = 3
    """Keep the newest K complete checkpoints."""
    async_save: bool = False
    """FSDP/DDP/single: write with dcp.async_save, overlapping the next steps."""
    save_at_end: bool = True
    """Save after the last step."""
    requeue: bool = False
    """Under SLURM, requeue the job (scontrol requeue) after saving on a stop signal."""


@dataclass
class LoggingConfig:
    """What rank 0 reports."""

    interval: int = 1
    """Log every N steps (stdout, TensorBoard, metrics.jsonl)."""
    tensorboard: bool = True
    """Write TensorBoard events under <run_dir>/tb."""
    wandb: bool = False
    """Also send every scalar and histogram to Weights & Biases (megabeta[wandb]; WANDB_MODE=offline works)."""
    wandb_project: str = "megabeta"
    """W&B project."""
    wandb_entity: str = ""
    """W&B entity (team or user); empty = your default entity."""


@dataclass(frozen=True)
class StepSelection:
    """Which steps are profiled: the range first…last, or every `every`-th step."""

    first: int = 0
    last: int = 0
    every: int = 0

    def starts(self, step: int) -> bool:
        """Whether a profiled range starts at `step`."""
        return step == self.first if self.first else bool(self.every) and step % self.every == 0

    def ends(self, step: int) -> bool:
        """Whether the range running at `step` ends with it."""
        return step == self.last if self.first else True


def parse_steps(spec: str) -> StepSelection | None:
    """`profile.steps`: `A-B`, `every:N` or empty (None: profiling off)."""
    spec = spec.strip()
    if not spec:
        return None
    try:
        if spec.startswith("every:"):
            every = int(spec.removeprefix("every:"))
            if every >= 1:
                return StepSelection(every=every)
        else:
            first, sep, last = spec.partition("-")
            first_step, last_step = int(first), int(last if sep else first)
            if 1 <= first_step <= last_step:
                return StepSelection(first=first_step, last=last_step)
    except ValueError:
        pass
    raise ConfigError(f"profile.steps = {spec!r}: must be A-B (steps A to B inclusive, "
                      "1 <= A <= B, e.g. 100-102), a single step N, every:N, or empty (off)")


@dataclass
class ProfileConfig:
    """torch.profiler traces and CUDA memory snapshots of chosen steps (megabeta/train/profiling.py)."""

    steps: str = ""
    """Steps to profile: `A-B` (inclusive, e.g. `100-102`), `every:N` (each N-th step) or `` (off)."""
    record_shapes: bool = False
    """Record operator input shapes (bigger traces; groups the table by shape)."""
    with_stack: bool = False
    """Record Python stacks of operators (much bigger traces)."""
    top_ops: int = 15
    """Rows of the top-operators-by-self-time table rank 0 prints per profiled range."""
    memory_snapshot: bool = False
    """CUDA: record the allocator's history from the start; dump snapshots (pytorch.org/memory_viz) after each profiled range and on out-of-memory, under RUN/profile."""


@dataclass
class MonitorConfig:
    """Stability, straggler and hang monitors and beta_1.2's dials (megabeta/train/monitor.py, watchdog.py, dials.py)."""

    spike_window: int = 50
    """Steps of the running window the loss and grad-norm z-scores are taken against (0 = no spike detection)."""
    spike_min_steps: int = 10
    """Steps in the window before spikes are judged (the start of a run is not a spike)."""
    loss_zscore: float = 6.0
    """A loss this many standard deviations above the window's mean is a spike."""
    grad_norm_zscore: float = 6.0
    """A gradient norm this many standard deviations above the window's mean is a spike."""
    spike_action: str = "log"
    """On a spike: `log` (warn, apply the step), `skip` (no update, counted like a non-finite step) or `stop` (no update, save, exit 3)."""
    straggler_ratio: float = 1.5
    """Every log interval: name the slowest rank when its step or data-wait time exceeds this times the median (0 = off)."""
    hang_seconds: float = 0.0
    """Watchdog: a step running longer than this names rank and collective, dumps every thread's stack (0 = off)."""
    beta_dials: bool = True
    """beta_1.2 only: every log interval log λ, θ, b_σ, |e_K|, |e_V|, |f| and, on the probe, attention mass, entropy and top key per group and the finished K/V's diversity per layer (train/dials.py)."""
    probe_batch: int = 1
    """Sequences of the fixed probe batch the probe dials are measured on."""
    collapse_cosine: float = 0.95
    """Warn when a layer's finished values' mean cosine between earlier positions exceeds this (beta_dials; 1 = all one vector; > 1 = never)."""
    layer_grad_norms: bool = True
    """Log the gradient norm of every layer (and of the rest) every log interval (split `grad_norm`)."""


@dataclass
class EvalConfig:
    """Periodic evaluation on the validation split, and downstream evals (task files, lm-eval tasks)."""

    interval: int = 0
    """Evaluate every N steps (0 = only at the end)."""
    batches: int = 8
    """Micro-batches per evaluation (per rank); 0 = the whole validation split."""
    downstream_interval: int = 0
    """Run the downstream evals (eval.tasks, eval.lm_eval_tasks) every N steps and at the end (0 = only at the end)."""
    tasks: list[str] = field(default_factory=list)
    """Task files of `megabeta tasks make` scored for exact-match accuracy, sharded across ranks (needs the run's tokenizer)."""
    lm_eval_tasks: list[str] = field(default_factory=list)
    """lm-evaluation-harness task names run on rank 0 (megabeta[eval]), e.g. hellaswag,arc_easy."""
    lm_eval_include: str = ""
    """Folder of task YAML files for eval.lm_eval_tasks of your own (the harness's include path)."""
    lm_eval_limit: float = 0.0
    """Documents per lm-eval task: a count, or a share when < 1 (0 = all)."""
    lm_eval_num_fewshot: int = -1
    """Few-shot examples per lm-eval prompt (-1 = each task's own, else 0)."""


def _schedule_problem(schedule: list[list[int]], *, arch: str, block_size: int, steps: int,
                      ) -> str | None:
    """What is wrong with `schedule` for a run of `steps` steps of a model of `arch` and
    `block_size` (a sentence for the ConfigError), or None."""
    if not schedule:
        return None
    if arch != "beta12":
        return (f"a block-size curriculum needs model.arch = 'beta12' (model.arch = {arch!r} "
                "has no blocks); leave it empty")
    for pair in schedule:
        if len(pair) != 2 or pair[0] < 0 or pair[1] < 1:
            return (f"{pair} is not a [step >= 0, block_size >= 1] pair; write e.g. "
                    f"[[0, 256], [300, {block_size}]]")
    starts = [start for start, _ in schedule]
    if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])):
        return "the steps must start at 0 and increase"
    if schedule[-1][1] != block_size:
        return (f"the last stage's block size {schedule[-1][1]} must be model.block_size = "
                f"{block_size}: the trained model is the spec's function at its own c")
    if starts[-1] >= steps:
        return (f"the last stage starts at step {starts[-1]}, at or after train.steps = {steps}: "
                "the model would never train at its own block size")
    return None


@dataclass
class TrainConfig:
    """A whole training run."""

    run_dir: str = "runs/default"
    """Directory of this run: config, metrics, TensorBoard, checkpoints."""
    resume: str = ""
    """`` (start fresh), `auto` (newest complete checkpoint in run_dir, if any) or a checkpoint path."""
    model: ModelConfig = field(default_factory=ModelConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)

    def _validate_block_align(self) -> None:
        """data.align = block: documents start at multiples of beta_1.2's block size c. Without
        blocks (another arm, or c >= seq_len, one block per sample) there is nothing to align
        to: spec §7, the mask alone makes packed equal to alone, so that is what to ask for."""
        d, m = self.data, self.model
        instead = ("use data.align = packed with data.document_mask = true, which is exact "
                   "without padding when a sample is one block (spec §7)")
        if not d.document_mask:
            raise ConfigError("data.align = 'block' needs data.document_mask = true: alignment "
                              "makes a document's logits equal to those of the document alone "
                              "only under the document mask (spec §7)")
        if m.arch != "beta12":
            raise ConfigError(f"data.align = 'block' with model.arch = {m.arch!r}: that arm has "
                              f"no blocks to align to; {instead}")
        if m.block_size >= d.seq_len:
            raise ConfigError(f"data.align = 'block' with model.block_size = {m.block_size} >= "
                              f"data.seq_len = {d.seq_len}: one block per sample; {instead}")
        if m.block_size >= 1 and d.seq_len % m.block_size:  # a bad block_size: the model says
            raise ConfigError(f"data.seq_len = {d.seq_len}: data.align = 'block' needs a "
                              f"multiple of model.block_size = {m.block_size}, so that a "
                              "sample's blocks are the stream's; pass "
                              f"--data.seq_len={d.seq_len // m.block_size * m.block_size}")

    def validate(self) -> None:
        """Raise ConfigError naming the first invalid setting (the model validates itself)."""

        def need(ok: bool, name: str, value: Any, why: str) -> None:
            if not ok:
                raise ConfigError(f"{name} = {value!r}: {why}")

        d, t, p = self.data, self.train, self.parallel
        need(d.seq_len >= 1, "data.seq_len", d.seq_len, "must be >= 1")
        need(d.seq_len <= self.model.max_seq_len, "data.seq_len", d.seq_len,
             f"exceeds model.max_seq_len = {self.model.max_seq_len}")
        need(not d.weights or len(d.weights) == len(d.path), "data.weights", d.weights,
             f"give one weight per data.path ({len(d.path)} paths)")
        need(0.0 <= d.val_fraction < 1.0, "data.val_fraction", d.val_fraction, "must be in [0, 1)")
        need(d.num_workers >= 0, "data.num_workers", d.num_workers, "must be >= 0")
        need(d.align in ("packed", "block", "document"), "data.align", d.align,
             "must be packed, block or document")
        if d.align == "block":
            self._validate_block_align()
        need(t.steps >= 1, "train.steps", t.steps, "must be >= 1")
        need(t.micro_batch >= 1, "train.micro_batch", t.micro_batch, "must be >= 1")
        need(t.global_batch >= 1, "train.global_batch", t.global_batch, "must be >= 1")
        need(t.precision in ("fp32", "bf16"), "train.precision", t.precision, "must be fp32 or bf16")
        need(t.max_nonfinite >= 1, "train.max_nonfinite", t.max_nonfinite, "must be >= 1")
        need(t.exit_after >= 0, "train.exit_after", t.exit_after, "must be >= 0 (0 = off)")
        problem = _schedule_problem(t.block_size_schedule, arch=self.model.arch,
                                    block_size=self.model.block_size, steps=t.steps)
        need(problem is None, "train.block_size_schedule", t.block_size_schedule, str(problem))
        need(self.optim.lr > 0, "optim.lr", self.optim.lr, "must be positive")
        need(self.optim.grad_clip >= 0, "optim.grad_clip", self.optim.grad_clip, "must be >= 0")
        need(self.schedule.kind in ("cosine", "linear", "wsd", "constant"), "schedule.kind",
             self.schedule.kind, "must be one of cosine, linear, wsd, constant")
        need(self.schedule.warmup_steps >= 0, "schedule.warmup_steps", self.schedule.warmup_steps,
             "must be >= 0")
        need(0.0 <= self.schedule.min_lr_ratio <= 1.0, "schedule.min_lr_ratio",
             self.schedule.min_lr_ratio, "must be in [0, 1]")
        need(0.0 < self.schedule.decay_fraction <= 1.0, "schedule.decay_fraction",
             self.schedule.decay_fraction, "must be in (0, 1]")
        need(self.schedule.total_steps >= 0, "schedule.total_steps", self.schedule.total_steps,
             "must be >= 0 (0 = train.steps)")
        need(p.backend in ("single", "ddp", "fsdp", "deepspeed"), "parallel.backend", p.backend,
             "must be one of single, ddp, fsdp, deepspeed")
        need(p.dist_backend in ("auto", "gloo", "nccl"), "parallel.dist_backend", p.dist_backend,
             "must be auto, gloo or nccl")
        for name in ("fsdp_param_dtype", "fsdp_reduce_dtype"):
            need(getattr(p, name) in ("fp32", "bf16"), f"parallel.{name}", getattr(p, name),
                 "must be fp32 or bf16")
        need(p.zero_stage in (1, 2, 3), "parallel.zero_stage", p.zero_stage, "must be 1, 2 or 3")
        need(p.deepspeed_optimizer in ("torch", "deepspeed"), "parallel.deepspeed_optimizer",
             p.deepspeed_optimizer, "must be torch or deepspeed")
        # The captured pass reads every layer's weights inside one autograd node; ZeRO-3 gathers
        # and frees a module's parameters around that module's own forward and backward calls,
        # which the pass never makes. ZeRO-1/2 keep whole parameters (their gradients reach
        # DeepSpeed through autograd as in eager), and FSDP2 gathers before the pass.
        need(not (self.execution.cuda_graphs and p.backend == "deepspeed" and p.zero_stage == 3),
             "execution.cuda_graphs", self.execution.cuda_graphs,
             "cannot run under DeepSpeed ZeRO-3 (parallel.zero_stage = 3), which gathers each "
             "module's parameters around that module's own calls; use parallel.zero_stage = 1 "
             "or 2, or parallel.backend = \"fsdp\", or execution.cuda_graphs = false")
        need(self.checkpoint.interval >= 0, "checkpoint.interval", self.checkpoint.interval,
             "must be >= 0")
        need(self.checkpoint.keep >= 1, "checkpoint.keep", self.checkpoint.keep, "must be >= 1")
        need(self.logging.interval >= 1, "logging.interval", self.logging.interval, "must be >= 1")
        need(self.eval.interval >= 0, "eval.interval", self.eval.interval, "must be >= 0")
        need(self.eval.batches >= 0, "eval.batches", self.eval.batches, "must be >= 0")
        e = self.eval
        need(e.downstream_interval >= 0, "eval.downstream_interval", e.downstream_interval,
             "must be >= 0 (0 = only at the end)")
        need(e.lm_eval_limit >= 0 and (e.lm_eval_limit < 1 or float(e.lm_eval_limit).is_integer()),
             "eval.lm_eval_limit", e.lm_eval_limit,
             "must be 0 (all), a whole number of documents, or a share in (0, 1)")
        need(e.lm_eval_num_fewshot >= -1, "eval.lm_eval_num_fewshot", e.lm_eval_num_fewshot,
             "must be >= 0, or -1 for each task's own")
        need(not e.lm_eval_include or e.lm_eval_tasks, "eval.lm_eval_include", e.lm_eval_include,
             "names task definitions for eval.lm_eval_tasks, which is empty; set both")
        parse_steps(self.profile.steps)
        need(self.profile.top_ops >= 0, "profile.top_ops", self.profile.top_ops, "must be >= 0")
        m = self.monitor
        need(m.spike_window >= 0, "monitor.spike_window", m.spike_window, "must be >= 0 (0 = off)")
        need(2 <= m.spike_min_steps, "monitor.spike_min_steps", m.spike_min_steps,
             "must be >= 2 (a standard deviation needs two values)")
        need(m.spike_window == 0 or m.spike_min_steps <= m.spike_window,
             "monitor.spike_min_steps", m.spike_min_steps,
             f"must be <= monitor.spike_window = {m.spike_window}")
        for name in ("loss_zscore", "grad_norm_zscore"):
            need(getattr(m, name) > 0, f"monitor.{name}", getattr(m, name), "must be positive")
        need(m.spike_action in ("log", "skip", "stop"), "monitor.spike_action", m.spike_action,
             "must be log, skip or stop")
        need(m.spike_action == "log" or p.backend != "deepspeed", "monitor.spike_action",
             m.spike_action, "DeepSpeed applies its update inside its own step, before the "
             "gradient norm is known here: use log with parallel.backend = deepspeed")
        need(m.straggler_ratio == 0 or m.straggler_ratio > 1, "monitor.straggler_ratio",
             m.straggler_ratio, "must be > 1 (0 = off)")
        need(m.hang_seconds >= 0, "monitor.hang_seconds", m.hang_seconds, "must be >= 0 (0 = off)")
        need(1 <= m.probe_batch <= t.micro_batch, "monitor.probe_batch", m.probe_batch,
             f"must be in [1, train.micro_batch = {t.micro_batch}] (the probe is taken from the "
             "first micro-batch)")
        need(m.collapse_cosine > 0, "monitor.collapse_cosine", m.collapse_cosine,
             "must be positive (a mean cosine; above 1 = never warn)")

    def grad_accumulation(self, world_size: int) -> int:
        """Micro-batches per rank per optimizer step; the global batch must split evenly."""
        per_step = self.train.micro_batch * world_size
        if self.train.global_batch % per_step:
            raise ConfigError(f"train.global_batch = {self.train.global_batch} is not a multiple of "
                              f"train.micro_batch ({self.train.micro_batch}) x world size "
                              f"({world_size}); change one of them")
        return self.train.global_batch // per_step


SECTIONS: dict[str, type] = {
    "model": ModelConfig, "execution": ExecutionConfig, "data": DataConfig, "train": TrainLoopConfig, "optim": OptimConfig,
    "schedule": ScheduleConfig, "parallel": ParallelConfig, "checkpoint": CheckpointConfig,
    "logging": LoggingConfig, "eval": EvalConfig, "profile": ProfileConfig,
    "monitor": MonitorConfig,
}
"""TOML section name -> its dataclass (the fields of TrainConfig with the same names)."""

MOVED_KEYS = {**{f"model.{k}": v for k, v in MOVED_FIELDS.items()},
              "parallel.compile": "execution.compile"}
"""Keys of older configs -> where the setting lives now."""

RENAMED_KEYS = {"execution.cell_kernels": "execution.elementwise_kernels"}
"""Keys of older configs that still work under their new name: a run's recorded config and the
configs written for it keep loading ("cell" now means one (block, layer) unit only)."""


def _refuse_moved(flat: dict[str, Any], known: dict[str, Any]) -> None:
    """A key of an older config is an error that says where the setting lives now (not a bare
    'unknown key')."""
    for key in flat:
        if key not in known and key in MOVED_KEYS:
            raise ConfigError(f"config key {key!r} has moved: set {MOVED_KEYS[key]} instead "
                              "(how a model runs is apart from what it is)")


def _key_types() -> dict[str, Any]:
    """Every config key ("section.key" or a top-level "key") -> its type, in TrainConfig's order."""
    kinds = {k: v for k, v in field_types(TrainConfig).items() if k not in SECTIONS}
    for section, cls in SECTIONS.items():
        kinds.update({f"{section}.{k}": v for k, v in field_types(cls).items()})
    kinds["model.preset"] = str
    return kinds


def _initial_model(model_table: dict[str, Any], read_model: ModelReader) -> ModelConfig:
    """`model.init_from`'s model with the [model] section's changes: only fields a run may
    change on top of loaded weights (RESUMABLE_FIELDS); another value of a field that shapes the
    parameters or the function is an error."""
    source = model_table["init_from"]
    base = read_model(source)
    conflicts = [f"model.{key} = {value!r}, but the model in model.init_from = {source!r} has "
                 f"{getattr(base, key)!r}" for key, value in model_table.items()
                 if key not in RESUMABLE_FIELDS and value != getattr(base, key)
                 and not (key == "vocab_size" and value == -1)]
    if conflicts:
        raise ConfigError(f"{'; '.join(conflicts)}: leave {'them' if len(conflicts) > 1 else 'it'}"
                          " out, the model's shape comes from model.init_from")
    return base.replace(**{k: v for k, v in model_table.items() if k in RESUMABLE_FIELDS})


def _apply(table: dict[str, dict[str, Any]], top: dict[str, Any],
           read_model: ModelReader | None = None) -> TrainConfig:
    """Build a TrainConfig from section tables and top-level keys (all already coerced)."""
    model_table = dict(table.get("model", {}))
    preset = model_table.pop("preset", None)
    if model_table.get("init_from") and read_model is not None:
        if preset:
            raise ConfigError(f"model.preset = {preset!r} and model.init_from = "
                              f"{model_table['init_from']!r} both give the model's shape; keep "
                              "one")
        model = _initial_model(model_table, read_model)
    else:
        model = get_preset(preset, **model_table) if preset else ModelConfig(**model_table)
    sections = {name: SECTIONS[name](**table.get(name, {}))
                for name in SECTIONS if name != "model"}
    config = TrainConfig(model=model, **sections, **top)
    config.validate()
    return config


def shipped_configs_dir() -> Path:
    """The configs shipped with megabeta: the package's `configs/` in an installed wheel (the
    repository's top-level `configs/`, packaged as `megabeta.configs`), or that top-level folder
    itself in a source checkout or an editable install."""
    package = Path(__file__).resolve().parent
    installed = package / "configs"
    return installed if installed.is_dir() else package.parent / "configs"


def shipped_config(name: str) -> Path | None:
    """The shipped config `name` (`t19_flash` or `t19_flash.toml`); None when there is none."""
    if not name or os.sep in name or (os.altsep and os.altsep in name) or name.startswith("."):
        return None
    folder = shipped_configs_dir()
    for candidate in (folder / name, folder / f"{name}.toml"):
        if candidate.suffix == ".toml" and candidate.is_file():
            return candidate
    return None


def load_config(path: str | os.PathLike | None = None, overrides: list[str] = (),
                read_model: ModelReader | None = None) -> TrainConfig:
    """TOML file (optional) plus `--section.key=value` / `--key=value` overrides, validated.

    `path` is a file, or the bare name of a shipped config (`t19_flash`, `demo.toml`: see
    `shipped_configs_dir()`) when no file of that name is in the working directory.
    `read_model`: how to read the config of the model `model.init_from` names, whose fields
    are then the [model] section's defaults (a run starting from it); None: `model.init_from`
    is taken as it is (a run's saved config, which holds every field)."""
    flat: dict[str, Any] = {}
    if path is not None:
        if not os.path.exists(path):
            path = shipped_config(os.fspath(path)) or path
        try:
            flat = flatten(read_toml(path))
        except FileNotFoundError:
            names = sorted(p.stem for p in shipped_configs_dir().glob("*.toml"))
            raise ConfigError(f"config file {path} does not exist; pass --config PATH of a TOML "
                              "file or the name of a shipped config: "
                              f"{', '.join(names) or '(none found)'}") from None
    flat.update(parse_overrides(overrides))
    return config_from_flat(flat, source=str(path) if path else "defaults", read_model=read_model)


def config_from_flat(flat: dict[str, Any], source: str = "config",
                     read_model: ModelReader | None = None) -> TrainConfig:
    """TrainConfig from `{"section.key": value}` (values coerced to the declared types);
    `read_model` as in `load_config`."""
    flat = renamed(flat, RENAMED_KEYS)
    kinds = _key_types()
    _refuse_moved(flat, kinds)
    tables, top = typed_tables(flat, kinds)
    try:
        return _apply(tables, top, read_model)
    except TypeError as err:  # a dataclass refused an argument: report it as a config problem
        raise ConfigError(f"{source}: {err}") from None


def config_to_dict(config: TrainConfig) -> dict[str, Any]:
    """Plain nested dict (None values dropped: TOML has no null)."""
    def clean(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: clean(v) for k, v in obj.items() if v is not None}
        return obj

    return clean(dataclasses.asdict(config))


def save_config(config: TrainConfig, path: str | os.PathLike) -> None:
    """Write `config` as TOML, atomically and durably."""
    write_durably(path, tomli_w.dumps(config_to_dict(config)))


def describe_fields() -> str:
    """Every config key with its default and one-line doc (for --help-config)."""
    lines = []
    docs = field_docs([TrainConfig, *SECTIONS.values()])
    for key in _key_types():
        section, _, name = key.rpartition(".")
        if key == "model.preset":
            lines.append("model.preset = ''  # named model configuration to start from "
                         "(e.g. t19_flash, beta_1.2_test)")
            continue
        cls = SECTIONS[section] if section else TrainConfig
        default = {f.name: f for f in dataclasses.fields(cls)}[name]
        value = (default.default if default.default is not dataclasses.MISSING
                 else default.default_factory())
        lines.append(f"{key} = {value!r}  # {docs.get((cls.__name__, name), '')}")
    return "\n".join(lines)
