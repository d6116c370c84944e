"""Under torchrun: a DeepSpeed ZeRO step whose loss and gradients are NaN must leave every
parameter unchanged and be reported as not applied, and the next clean step must update again.
Prints one JSON line (rank 0): per step, whether it was reported applied and whether the
parameters changed."""

from __future__ import annotations

import json
import math
import sys

import torch

from megabeta.config import config_from_flat
from megabeta.model import build_model
from megabeta.engine.deepspeed_engine import DeepSpeedEngine
from megabeta.parallel.env import init_distributed
from zero3_exit import leave


def main() -> None:
    stage = int(sys.argv[1])
    env = init_distributed("gloo")
    config = config_from_flat({
        "model.vocab_size": 64, "model.d_model": 32, "model.hidden_dim": 64,
        "model.num_heads": 2, "model.num_layers": 2, "model.block_size": 4,
        "model.max_seq_len": 16, "data.seq_len": 16, "train.global_batch": 4,
        "train.micro_batch": 2, "parallel.backend": "deepspeed", "parallel.zero_stage": stage})
    torch.manual_seed(0)
    model = build_model(config.model)
    clean_forward = model.forward
    poisoned = {"on": False}

    def forward(*args, **kwargs):
        loss = clean_forward(*args, **kwargs)
        return loss * math.nan if poisoned["on"] else loss

    model.forward = forward
    runner = DeepSpeedEngine(model, config, torch.device("cpu"), grad_accumulation=1)
    import deepspeed

    def params() -> list[torch.Tensor]:
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            return [p.detach().clone() for p in model.parameters()]

    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(env.rank))
    report = []
    for poison in (False, True, False):
        poisoned["on"] = poison
        before = params()
        loss = runner.forward_backward(tokens[:, :-1], tokens[:, 1:], last=True, scale=1.0)
        applied = runner.step(math.isfinite(float(loss))).applied
        after = params()
        changed = any(not torch.equal(a, b) for a, b in zip(before, after))
        finite = all(bool(torch.isfinite(p).all()) for p in after)
        report.append({"poisoned": poison, "applied": applied, "changed": changed,
                       "finite": finite})
    if env.rank == 0:
        print(json.dumps(report))
    leave()


if __name__ == "__main__":
    main()
