"""How a model runs, apart from what it is: `ExecutionConfig` (the `[execution]` section).

`ModelConfig` fixes the parameters and the function (spec §1-§4); everything here may change
between two launches of the same run, and resuming accepts any change of it. Each choice is made
once, when the model is built (or moved to another device), and held by the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from megabeta.model.config import ConfigError

CHECKPOINT_MODES = ("none", "block")
ATTENTION_BACKENDS = ("auto", "explicit", "sdpa", "cpu_flash", "cpu_fused")


@dataclass
class ExecutionConfig:
    """Execution settings of a model; validated at construction."""

    activation_checkpoint: str = "none"
    """`none` or `block`: recompute one block through all layers in backward (beta12; per layer for the other arms)."""
    attention: str = "auto"
    """Attention backend: `auto`, `explicit`, `sdpa`, `cpu_flash` or `cpu_fused` (docs/architecture.md)."""
    compile: bool = False
    """torch.compile each layer's residual branches (applied by the engine)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise `ConfigError` naming the first invalid field and its allowed values."""
        for name, allowed in (("activation_checkpoint", CHECKPOINT_MODES),
                              ("attention", ATTENTION_BACKENDS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"execution.{name} = {getattr(self, name)!r}: must be one of "
                                  f"{', '.join(allowed)}")
        if not isinstance(self.compile, bool):
            raise ConfigError(f"execution.compile = {self.compile!r}: must be true or false")


__all__ = ["ExecutionConfig", "CHECKPOINT_MODES", "ATTENTION_BACKENDS"]
