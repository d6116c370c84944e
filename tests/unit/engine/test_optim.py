"""The optimizer's parameter groups: only matrices decay."""

from __future__ import annotations

from megabeta.config import OptimConfig
from megabeta.engine.optim import build_optimizer
from support.model_helpers import tiny_model


def test_only_matrices_decay() -> None:
    model = tiny_model()
    decay, no_decay = build_optimizer(model, OptimConfig(weight_decay=0.1)).param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"])
    names = {id(p): n for n, p in model.named_parameters()}
    undecayed = {names[id(p)].rsplit(".", 1)[-1] for p in no_decay["params"]}
    assert {"e_k", "e_v", "f_q", "depth_bias", "self_bias", "weight"} == undecayed
