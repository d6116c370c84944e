"""What an ablation trains: the scale table, the arms (scaled, equal-parameter where claimed) and
the built-in suites.

An arm is a preset name (`megabeta.model.config.preset_names`) or a config file (its [model]
section; the rest of a file is not used: every arm of an ablation trains with the same data,
schedule and optimizer). Presets describe the article's size; `--scale` shrinks an arm's model
by the factors of its `Scale` row, the same factors for every arm:

    d_model, hidden_dim      x width   (heads kept, head width even)
    num_layers, depth_window x layers  (rounded, at least 1; a window of 0 stays 0)
    block_size c             x blocks  (at most the sequence length)
    data.seq_len             the row's length (max_seq_len follows it)

so that ratios the article compares survive: at `tiny`, c = 32 and c = 256 become c = 8 and
c = 64 = T (still x 8 apart), L = 20 against L = 10 becomes 8 against 4, and a window of 6 of 10
layers becomes 2 of 4. `article` leaves the presets as they are.

Equal parameters: an arm whose preset is the fair resolution of its shape against FAIR_CONTROL
(the depth presets), and every arm of a suite that compares at equal parameters, has its SwiGLU
width recomputed at the chosen scale by `resolve_fair_config` against the (scaled) reference arm,
so the counts stay within FAIR_TOLERANCE at every scale (`check_equal_parameters`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megabeta.config import load_config, shipped_config
from megabeta.model.config import (
    FAIR_CONTROL,
    FAIR_TOLERANCE,
    ConfigError,
    ModelConfig,
    count_parameters,
    get_preset,
    preset_names,
    resolve_fair_config,
)


class AblationError(ValueError):
    """Bad input to `megabeta ablate`; the message names the flag or file and what to do."""


@dataclass(frozen=True)
class TaskSpec:
    """One state-tracking task of the `state` suite: `megabeta tasks make` options and counts."""

    task: str
    """`chains`, `permutations` or `parity` (megabeta.tasks.make.TASKS)."""
    options: dict[str, Any]
    """Keyword arguments of the task's options dataclass (hops, chains, length, group, ...)."""
    train: int
    """Training documents."""
    test: int
    """Held-out documents (generated with another seed)."""


@dataclass(frozen=True)
class Scale:
    """One row of the scale table: model factors, sequence length and trainer defaults."""

    name: str
    width: float
    """Factor on d_model and hidden_dim."""
    layers: float
    """Factor on num_layers and depth_window."""
    blocks: float
    """Factor on block_size."""
    seq_len: int
    """data.seq_len (and the models' max_seq_len) of the text suites."""
    state_seq_len: int
    """data.seq_len of the `state` suite: its longest task document fits."""
    batches: int
    """Default optimizer steps per arm (--batches)."""
    global_batch: int
    micro_batch: int
    lr: float
    warmup_fraction: float
    """schedule.warmup_steps = this share of the batches (at least 1)."""
    logging_interval: int
    checkpoint_every: int
    """Checkpoint interval at the row's own `batches`, scaled with --batches
    (`checkpoint_interval`; 0: a quarter of the batches)."""
    tasks: tuple[TaskSpec, ...] = field(default=())
    """The `state` suite's tasks at this scale."""
    trainer_defaults: tuple[str, ...] = ()
    """Trainer overrides applied unless --base-config gives a config file instead."""

    def checkpoint_interval(self, batches: int) -> int:
        """The checkpoint interval of a run of `batches` steps: the row's, in proportion."""
        if not self.checkpoint_every:
            return max(1, batches // 4)
        return max(1, round(self.checkpoint_every * batches / self.batches))

    def describe(self) -> str:
        if self.name == "article":
            return "article: the presets as they are"
        return (f"{self.name}: width x {self.width:g}, layers x {self.layers:g}, blocks x "
                f"{self.blocks:g}, seq_len {self.seq_len} (state suite {self.state_seq_len})")


_CPU_TRAINER = ("--data.num_workers=0", "--execution.activation_checkpoint=none",
                "--parallel.backend=single", "--train.precision=fp32")

SCALES: dict[str, Scale] = {
    # A suite in well under 15 minutes on a 2-core CPU (see `megabeta ablate --help`).
    "tiny": Scale("tiny", width=0.25, layers=0.4, blocks=0.25, seq_len=64, state_seq_len=64,
                  batches=300, global_batch=16, micro_batch=16, lr=3e-3, warmup_fraction=0.1,
                  logging_interval=1, checkpoint_every=0,
                  tasks=(TaskSpec("chains", {"hops": 3, "chains": 2}, 4000, 200),
                         TaskSpec("parity", {"length": 8}, 2000, 200)),
                  trainer_defaults=_CPU_TRAINER),
    # A workstation or one GPU: an hour or so.
    "small": Scale("small", width=0.5, layers=0.6, blocks=0.5, seq_len=256, state_seq_len=128,
                   batches=1000, global_batch=16, micro_batch=16, lr=2e-3, warmup_fraction=0.05,
                   logging_interval=1, checkpoint_every=0,
                   tasks=(TaskSpec("chains", {"hops": 8, "chains": 2}, 40000, 1000),
                          TaskSpec("permutations", {"group": "A5", "length": 8}, 20000, 1000),
                          TaskSpec("parity", {"length": 16}, 20000, 1000)),
                   trainer_defaults=("--data.num_workers=1",)),
    # The article's ~10 M-parameter arms, T = 2048 (GPUs; pass --base-config for FSDP/bf16).
    "article": Scale("article", width=1.0, layers=1.0, blocks=1.0, seq_len=2048,
                     state_seq_len=512, batches=20000, global_batch=16, micro_batch=16, lr=1e-3,
                     warmup_fraction=0.025, logging_interval=10, checkpoint_every=1000,
                     tasks=(TaskSpec("chains", {"hops": 8, "chains": 2}, 200000, 2000),
                            TaskSpec("chains", {"hops": 32, "chains": 2}, 200000, 2000),
                            TaskSpec("permutations", {"group": "S5", "length": 10}, 100000, 2000),
                            TaskSpec("parity", {"length": 16}, 50000, 2000)),
                     trainer_defaults=("--data.num_workers=2",)),
}


@dataclass(frozen=True)
class Arm:
    """One model arm of an ablation, at its scale."""

    name: str
    """Label in the summary and the run directories (OUT/runs/NAME-seedS)."""
    model: ModelConfig
    source: str
    """Where it comes from: `preset X`, `config FILE`, or the suite's description."""
    fair: bool = False
    """Resolved to the reference arm's parameter count."""
    block_size_schedule: tuple[tuple[int, int], ...] = ()
    """The arm's block-size curriculum (its config file's train.block_size_schedule, the block
    sizes scaled like the model's); empty: none."""

    def parameters(self, vocab_size: int | None = None) -> int:
        """count_parameters at `vocab_size` (None: without the embedding)."""
        return count_parameters(self.model.replace(vocab_size=vocab_size or -1))


@dataclass(frozen=True)
class Suite:
    """A built-in ablation: arms, the reference, whether they compare at equal parameters."""

    name: str
    description: str
    reference: str
    equal_parameters: bool
    task_data: bool
    """Trains on state-tracking tasks (generated when no --data is given)."""


SUITES: dict[str, Suite] = {
    "c-sweep": Suite("c-sweep", "article §7.1: block size c (beta_1.2 c = 32, c = 256) against "
                     "the standard Transformer, all L = 20", FAIR_CONTROL, False, False),
    "depth": Suite("depth", "article §7.2: standard L = 20 against beta_1.2 at L = 10 (windows "
                   "k = 6, k = 2, stride 2) at equal parameters", FAIR_CONTROL, True, False),
    "state": Suite("state", "state-tracking tasks: standard, looped and beta_1.2 at the small c, "
                   "at equal parameters", "standard", True, True),
}
SUITE_ARMS: dict[str, tuple[str, ...]] = {
    "c-sweep": (FAIR_CONTROL, "beta_1.2_test", "beta_1.2_c256"),
    "depth": (FAIR_CONTROL, "beta_1.2_de10k6", "beta_1.2_de10k2", "beta_1.2_stride2"),
}


# ---- scaling --------------------------------------------------------------------------------------
EVAL_POINTS = 10
"""Validation evaluations per run by default (the held-out curve of summary.png)."""


def eval_interval(batches: int) -> int:
    """The default validation interval of a run of `batches` steps: EVAL_POINTS of them."""
    return max(1, batches // EVAL_POINTS)


def _scaled_width(d_model: int, heads: int, factor: float) -> int:
    """d_model x factor, rounded to a multiple of 2·heads (an even head width, heads kept)."""
    unit = 2 * heads
    return max(unit, int(round(d_model * factor / unit)) * unit)


def scaled_block_size(block_size: int, scale: Scale, seq_len: int) -> int:
    """An article-size block size at `scale` (at most the sequence; `article`: as it is)."""
    if scale.name == "article":
        return block_size
    return min(seq_len, max(1, round(block_size * scale.blocks)))


def scale_model(config: ModelConfig, scale: Scale, seq_len: int) -> ModelConfig:
    """`config` (article size) shrunk by `scale`'s factors, with max_seq_len = `seq_len`."""
    if scale.name == "article":
        return config.replace(max_seq_len=max(config.max_seq_len, seq_len))
    layers = max(1, round(config.num_layers * scale.layers))
    window = 0 if config.depth_window == 0 else max(1, round(config.depth_window * scale.layers))
    deep = config.deep_token_window
    deep = 0 if deep == 0 else max(1, round(deep * seq_len / config.max_seq_len))
    return config.replace(
        d_model=_scaled_width(config.d_model, config.num_heads, scale.width),
        hidden_dim=max(1, round(config.hidden_dim * scale.width)),
        num_layers=layers, depth_window=window, deep_token_window=deep,
        block_size=scaled_block_size(config.block_size, scale, seq_len),
        max_seq_len=seq_len)


def is_fair_preset(name: str) -> bool:
    """Whether preset `name` is the equal-parameter resolution of its shape against FAIR_CONTROL
    (so its scaled version must be resolved again at the scale)."""
    if name == FAIR_CONTROL or name not in preset_names():
        return False
    arm = get_preset(name)
    try:
        again = resolve_fair_config(get_preset(FAIR_CONTROL), **_shape(arm))
    except ConfigError:
        return False
    return again == arm


def _shape(config: ModelConfig) -> dict[str, Any]:
    """The fields an equal-parameter arm sets itself (resolve_fair_config derives hidden_dim)."""
    fields = ("arch", "num_layers", "depth_window", "depth_stride", "block_size", "loops",
              "deep_token_window", "max_seq_len")
    return {name: getattr(config, name) for name in fields}


def make_fair(arm: ModelConfig, reference: ModelConfig) -> ModelConfig:
    """`arm`'s shape at `reference`'s parameter count (the SwiGLU width resolved)."""
    if arm.d_model != reference.d_model or arm.num_heads != reference.num_heads:
        raise AblationError(f"an equal-parameter arm must have the reference's width (d_model "
                            f"{arm.d_model} vs {reference.d_model}, heads {arm.num_heads} vs "
                            f"{reference.num_heads}); only its depth, window, blocks and SwiGLU "
                            "width may differ")
    try:
        return resolve_fair_config(reference.replace(vocab_size=-1), **_shape(arm)).replace(
            vocab_size=arm.vocab_size)
    except ConfigError as err:
        raise AblationError(str(err)) from None


# ---- arms -----------------------------------------------------------------------------------------
def _arm_model(spec: str) -> tuple[str, ModelConfig, str, list[list[int]]]:
    """(label, article-size model, source, block-size curriculum) of one --arms entry."""
    if spec in preset_names():
        return spec, get_preset(spec), f"preset {spec}", []
    path = Path(spec)
    looks_like_file = spec.endswith(".toml") or os.sep in spec
    if path.is_file() or shipped_config(spec):
        file = path if path.is_file() else shipped_config(spec)
        try:
            config = load_config(file)
        except ConfigError as err:
            raise AblationError(f"--arms {spec}: {err}") from None
        return (Path(file).stem, config.model, f"config {file}",
                config.train.block_size_schedule)
    if looks_like_file:
        raise AblationError(f"--arms {spec}: no such config file; pass a preset name "
                            f"({', '.join(preset_names())}) or an existing .toml file")
    raise AblationError(f"--arms {spec}: unknown arm; pass a preset name "
                        f"({', '.join(preset_names())}), a config file (.toml) or the name of "
                        "a shipped config")


def build_arms(specs: list[str], scale: Scale, seq_len: int, *, reference: str | None = None,
               equal_parameters: bool = False) -> tuple[list[Arm], str]:
    """Arms of --arms `specs` at `scale`, and the reference arm's name (the `reference` given,
    else the first standard arm, else the first arm). With `equal_parameters` every other arm
    is resolved to the reference's count; presets that are equal-parameter by definition are
    resolved against the scaled FAIR_CONTROL either way."""
    if not specs:
        raise AblationError("--arms: give at least one arm (preset names or config files)")
    arms: list[Arm] = []
    for spec in specs:
        name, model, source, schedule = _arm_model(spec)
        if any(a.name == name for a in arms):
            raise AblationError(f"--arms: {name} is given twice; each arm once")
        scaled = scale_model(model, scale, seq_len)
        fair = is_fair_preset(spec) if spec in preset_names() else False
        if fair:
            control = scale_model(get_preset(FAIR_CONTROL), scale, seq_len)
            scaled = make_fair(scaled, control)
        stages = tuple((step, scaled_block_size(c, scale, seq_len)) for step, c in schedule)
        if stages:
            source += ", curriculum " + ", ".join(f"c = {c} from step {s}" for s, c in stages)
        arms.append(Arm(name, scaled, source, fair, stages))
    names = [a.name for a in arms]
    if reference is None:
        standard = [a.name for a in arms if a.model.arch == "standard"]
        reference = (standard or names)[0]
    elif reference not in names:
        raise AblationError(f"--reference {reference}: not one of the arms ({', '.join(names)})")
    if equal_parameters:
        ref_model = next(a.model for a in arms if a.name == reference)
        arms = [a if a.name == reference else
                dataclasses.replace(a, model=make_fair(a.model, ref_model), fair=True)
                for a in arms]
    return arms, reference


def suite_arms(suite: str, scale: Scale, seq_len: int) -> tuple[list[Arm], str]:
    """The arms and reference of a built-in suite at `scale`."""
    definition = SUITES[suite]
    if suite in SUITE_ARMS:
        return build_arms(list(SUITE_ARMS[suite]), scale, seq_len,
                          reference=definition.reference,
                          equal_parameters=definition.equal_parameters)
    # state: the 10 M shape's standard arm; looped and beta_1.2 at half the layers (the depth
    # arms' shape: looped applies its stack twice, beta_1.2 reads a window of 6 of 10 deeper
    # layers at the preset's small c), both widened to the standard arm's parameter count.
    standard = scale_model(get_preset(FAIR_CONTROL), scale, seq_len)
    half = max(1, standard.num_layers // 2)
    looped = standard.replace(arch="looped", loops=2, num_layers=half)
    beta = scale_model(get_preset("beta_1.2_de10k6"), scale, seq_len)
    arms = [Arm("standard", standard, f"{FAIR_CONTROL} (scaled)"),
            Arm("looped", make_fair(looped, standard), f"{FAIR_CONTROL} at L/2, 2 loops", True),
            Arm(f"beta_1.2_c{beta.block_size}", make_fair(beta, standard),
                "beta_1.2_de10k6 (scaled)", True)]
    return arms, "standard"


def check_equal_parameters(arms: list[Arm], reference: str,
                           vocab_size: int | None = None) -> list[str]:
    """Problems (empty when none): a fair arm whose count (at `vocab_size`) is more than
    FAIR_TOLERANCE off the reference's."""
    ref = next(a for a in arms if a.name == reference).parameters(vocab_size)
    problems = []
    for arm in arms:
        if arm.fair:
            error = abs(arm.parameters(vocab_size) - ref) / ref
            if error > FAIR_TOLERANCE:
                problems.append(f"{arm.name}: {arm.parameters(vocab_size)} parameters, "
                                f"{error:.2%} off the reference {reference}'s {ref} "
                                f"(tolerance {FAIR_TOLERANCE:.1%})")
    return problems


def model_overrides(model: ModelConfig) -> list[str]:
    """`--model.KEY=VALUE` for every field of `model` (the trainer builds exactly this model)."""
    out = []
    for key, value in dataclasses.asdict(model).items():
        if value is None:
            continue
        out.append(f"--model.{key}={str(value).lower() if isinstance(value, bool) else value}")
    return out


__all__ = ["AblationError", "Arm", "Scale", "Suite", "TaskSpec", "SCALES", "SUITES",
           "SUITE_ARMS", "build_arms", "suite_arms", "scale_model", "make_fair",
           "is_fair_preset", "check_equal_parameters", "model_overrides"]
