"""The contract between the trainer and an engine: what the training loop may ask of it.

The trainer owns the schedule, the data, metrics, evaluation and when to save; an engine owns
how one rank's model is wrapped for parallelism, how a micro-batch's gradients are made and
reduced, the optimizer update, and the format of the model/optimizer shards in a checkpoint.
Per optimizer step the loop calls, in this order:

    set_lr(lr)
    forward_backward(inputs, targets, last=False, scale=s_m)   # micro-batches 1 … A-1
    forward_backward(inputs, targets, last=True,  scale=s_A)   # micro-batch A: reduce here
    step(loss_finite) -> StepResult                            # the update (or its skip)

and between steps `eval_loss`, `save` and `load`. Two implementations: `TorchEngine` (single,
DDP, FSDP2; torch_engine.py) and `DeepSpeedEngine` (ZeRO 1/2/3; deepspeed_engine.py).

The reduction across ranks AVERAGES the ranks' accumulated gradients (DDP, FSDP2 and DeepSpeed all
do). The trainer wants the gradient of the step's global mean over scored targets, so it passes
`s_m = n_m · W / N` (n_m scored targets in micro-batch m, N in the whole step on all W ranks): the
average over ranks of Σ_m s_m ∇mean_m is Σ (over every micro-batch of every rank) ∇sum_m / N.
With every micro-batch equally full, s_m is exactly 1/A.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from torch import Tensor, nn


@dataclass(frozen=True)
class StepResult:
    """What an optimizer step did."""

    grad_norm: float
    """Global gradient norm before clipping (nan or inf when non-finite)."""
    applied: bool
    """Whether the update was applied (False: skipped, the gradients were not finite)."""


class Engine(Protocol):
    name: str
    """`parallel.backend` of this engine; recorded in checkpoints, which only it can read."""
    model: nn.Module
    """The model as built (unwrapped): train/eval mode, parameters, the config."""

    def forward_backward(self, inputs: Tensor, targets: Tensor, *, last: bool,
                         scale: float, documents: Tensor | None = None) -> Tensor:
        """Mean loss of one micro-batch over its scored targets (detached); its gradients,
        times `scale`, accumulated. `last`: the step's final micro-batch, whose backward
        reduces (averages) gradients across ranks. `documents`: the inputs' document ids
        (data.document_mask), handed to the model as `documents=`; None: not passed at all."""

    def step(self, loss_finite: bool,
             accept: Callable[[float], bool] | None = None) -> StepResult:
        """Clip and apply the accumulated gradients, or skip the update when the loss or the
        gradients are not finite, or when `accept(global grad norm)`, asked while the gradients
        still exist (the stability monitor's gate), says no; gradients are cleared either way.
        DeepSpeed updates inside its own step and asks `accept` only afterwards (no veto)."""

    def set_lr(self, lr: float) -> None:
        """Learning rate of the next update."""

    def eval_loss(self, inputs: Tensor, targets: Tensor,
                  documents: Tensor | None = None) -> Tensor:
        """Loss of a batch without gradients (the caller sets eval mode); `documents` as in
        `forward_backward`."""

    def save(self, path: Path, *, async_save: bool = False) -> Future | None:
        """Write model and optimizer shards into directory `path` (collective); a future when
        the write continues in the background."""

    def load(self, path: Path) -> None:
        """Read what `save` wrote (collective), resharding where the format allows."""


def document_kwargs(documents: Tensor | None) -> dict[str, Tensor]:
    """The model call's `documents=` argument, or nothing: a model without document masking
    (see megabeta.model.documents) is called exactly as before."""
    return {} if documents is None else {"documents": documents}
