"""How a model runs, apart from what it is: `ExecutionConfig` (the `[execution]` section).

`ModelConfig` fixes the parameters and the function (spec §1-§4); everything here may change
between two launches of the same run, and resuming accepts any change of it. Each choice is made
once, when the model is built (or moved to another device), and held by the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from megabeta.model.config import ConfigError

CHECKPOINT_MODES = ("none", "block", "wave")
SCHEDULES = ("block", "wavefront")
UNITS = {"block": "block", "wavefront": "wave"}
"""Each schedule's recompute unit (model/plan.py): the `activation_checkpoint` value that
recomputes it."""
ATTENTION_BACKENDS = ("auto", "reference", "cpu", "triton")
REMOVED_ATTENTION = {
    "explicit": "reference (the same spec §3 softmax written out)",
    "cpu_flash": "cpu (one implementation: the fused C++ kernels)",
    "cpu_fused": "cpu (the same fused C++ kernels, now for the whole key set)",
    "sdpa": "reference (attention dropout) or auto",
    "cuda_flash": "triton (what auto selects on CUDA)",
}
"""Backends that were renamed or dropped, and what to use instead (`sdpa` and `cuda_flash`:
docs/benchmarks/2026-12-04-gpu.md)."""
ELEMENTWISE_KERNELS = ("auto", "torch", "triton")


@dataclass
class ExecutionConfig:
    """Execution settings of a model; validated at construction."""

    activation_checkpoint: str = "none"
    """`none`, `block` (recompute one block through all layers in backward; per layer for the other arms) or `wave` (one wave of the wavefront schedule)."""
    schedule: str = "block"
    """beta12's order of (block, layer) cells: `block` (block by block) or `wavefront` (the cells of a wave b·(k+1) + l together, batched; docs/architecture.md)."""
    attention: str = "auto"
    """Attention backend: `auto`, `reference` (the spec's softmax written out; attention dropout), `cpu` (fused C++ kernels) or `triton` (docs/architecture.md)."""
    elementwise_kernels: str = "auto"
    """RMSNorm, RoPE and SwiGLU: `torch`, `triton` (fused kernels, megabeta[gpu]) or `auto` (triton on CUDA where installed)."""
    compile: bool = False
    """torch.compile beta12's recompute unit (one graph per kind of unit: every full block through one; `cpu` or `triton` attention), the other arms' residual branches; the same under every engine."""
    cuda_graphs: bool = False
    """Capture a whole beta12 pass in two CUDA graphs, forward and backward with the recomputation (needs the schedule's activation_checkpoint and triton attention); CUDA only."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise `ConfigError` naming the first invalid field and its allowed values."""
        if self.attention in REMOVED_ATTENTION:
            raise ConfigError(f"execution.attention = {self.attention!r} is gone: use "
                              f"{REMOVED_ATTENTION[self.attention]}")
        for name, allowed in (("activation_checkpoint", CHECKPOINT_MODES),
                              ("attention", ATTENTION_BACKENDS),
                              ("schedule", SCHEDULES),
                              ("elementwise_kernels", ELEMENTWISE_KERNELS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"execution.{name} = {getattr(self, name)!r}: must be one of "
                                  f"{', '.join(allowed)}")
        for name in ("compile", "cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"execution.{name} = {getattr(self, name)!r}: must be true or "
                                  "false")
        unit = UNITS[self.schedule]
        if self.activation_checkpoint not in ("none", unit):
            others = [s for s, u in UNITS.items() if u == self.activation_checkpoint]
            raise ConfigError(
                f"execution.activation_checkpoint = {self.activation_checkpoint} recomputes a "
                f"{self.activation_checkpoint}, but execution.schedule = {self.schedule} "
                f"recomputes per {unit}: set execution.activation_checkpoint = {unit} (or "
                f"none)" + "".join(f", or execution.schedule = {o}" for o in others))
        if self.cuda_graphs and self.activation_checkpoint != unit:
            raise ConfigError(f"execution.cuda_graphs = true replays a pass's forward, and its "
                              f"backward with each {unit} (the {self.schedule} schedule's "
                              f"recompute unit) recomputed: set "
                              f"execution.activation_checkpoint = {unit}")


__all__ = ["ExecutionConfig", "CHECKPOINT_MODES", "SCHEDULES", "UNITS", "ATTENTION_BACKENDS",
           "REMOVED_ATTENTION", "ELEMENTWISE_KERNELS"]
