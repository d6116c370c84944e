"""How a model runs, apart from what it is: `ExecutionConfig` (the `[execution]` section).

`ModelConfig` fixes the parameters and the function (spec §1-§4); everything here may change
between two launches of the same run, and resuming accepts any change of it. Each choice is made
once, when the model is built (or moved to another device), and held by the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from megabeta.model.attention.select import BACKENDS
from megabeta.model.config import ConfigError
from megabeta.model.schedule import SCHEDULES as REGISTERED

CHECKPOINT_MODES = ("none", "block", "wave")
SCHEDULES = tuple(REGISTERED)
ATTENTION_BACKENDS = ("auto", *BACKENDS)
REMOVED_ATTENTION = {
    "sdpa": "explicit (attention dropout) or auto",
    "cuda_flash": "triton (what auto selects on CUDA)",
}
"""Backends that were dropped, and what to use instead (docs/benchmarks/2026-12-04-gpu.md:
`cuda_flash` gave wrong bf16 gradients and a memory fault on an H200, `sdpa` ran 1.75x
slower than `triton` there)."""
ELEMENTWISE_KERNELS = ("auto", "torch", "triton")


@dataclass
class ExecutionConfig:
    """Execution settings of a model; validated at construction."""

    activation_checkpoint: str = "none"
    """`none`, `block` (recompute one block through all layers in backward; per layer for the other arms) or `wave` (one wave of the wavefront schedule)."""
    schedule: str = "block"
    """beta12's order of (block, layer) cells: `block` (block by block) or `wavefront` (the cells of a wave b·(k+1) + l together, batched; docs/architecture.md)."""
    attention: str = "auto"
    """Attention backend: `auto`, `explicit` (the spec's softmax written out; attention dropout), `cpu_flash`, `cpu_fused` or `triton` (docs/architecture.md)."""
    elementwise_kernels: str = "auto"
    """RMSNorm, RoPE and SwiGLU: `torch`, `triton` (fused kernels, megabeta[gpu]) or `auto` (triton on CUDA where installed)."""
    compile: bool = False
    """torch.compile: beta12's block step, one graph for every block (`cpu_fused` or `triton` attention), or its wave step on the wavefront, one graph per kind of wave (`triton`); the other arms' residual branches (applied by the engine)."""
    cuda_graphs: bool = False
    """Capture beta12's step in CUDA graphs, replayed per block (activation_checkpoint = block; triton or cpu_fused attention) or per wave (wavefront, activation_checkpoint = wave; triton); CUDA only."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise `ConfigError` naming the first invalid field and its allowed values."""
        if self.attention in REMOVED_ATTENTION:
            raise ConfigError(f"execution.attention = {self.attention!r} was removed: use "
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
        unit = REGISTERED[self.schedule].unit
        if self.activation_checkpoint not in ("none", unit):
            others = [s.name for s in REGISTERED.values()
                      if s.unit == self.activation_checkpoint]
            raise ConfigError(
                f"execution.activation_checkpoint = {self.activation_checkpoint} recomputes a "
                f"{self.activation_checkpoint}, but execution.schedule = {self.schedule} "
                f"recomputes per {unit}: set execution.activation_checkpoint = {unit} (or "
                f"none)" + "".join(f", or execution.schedule = {o}" for o in others))
        if self.cuda_graphs and self.activation_checkpoint != unit:
            raise ConfigError(f"execution.cuda_graphs = true replays the forward, and the "
                              f"recompute and backward, of a checkpointed {unit} (the "
                              f"{self.schedule} schedule's recompute unit): set "
                              f"execution.activation_checkpoint = {unit}")


__all__ = ["ExecutionConfig", "CHECKPOINT_MODES", "SCHEDULES", "ATTENTION_BACKENDS",
           "REMOVED_ATTENTION", "ELEMENTWISE_KERNELS"]
