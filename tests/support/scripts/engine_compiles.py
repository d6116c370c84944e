"""Under torchrun: `execution.compile = true` under one engine (argv[1]: ddp, fsdp or
deepspeed): the model's recompute unit is compiled whatever wraps the model, and a step's loss
equals the eager model's. Prints one JSON line (rank 0): graphs compiled, both losses."""

from __future__ import annotations

import json
import sys

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from megabeta.config import config_from_flat
from megabeta.model import build_model
from megabeta.parallel.env import init_distributed
from zero3_exit import leave

SHAPE = {"model.vocab_size": 64, "model.d_model": 32, "model.hidden_dim": 64,
         "model.num_heads": 2, "model.num_layers": 2, "model.block_size": 4,
         "model.max_seq_len": 16, "data.seq_len": 16, "train.global_batch": 4,
         "train.micro_batch": 2, "execution.attention": "cpu",
         "execution.activation_checkpoint": "block"}


def loss_of(backend: str, compile: bool, tokens: torch.Tensor) -> float:
    config = config_from_flat({**SHAPE, "parallel.backend": backend,
                               "execution.compile": compile,
                               **({"parallel.zero_stage": 1} if backend == "deepspeed" else {})})
    torch.manual_seed(0)
    model = build_model(config.model, config.execution)
    if backend == "deepspeed":
        from megabeta.engine.deepspeed_engine import DeepSpeedEngine
        engine = DeepSpeedEngine(model, config, torch.device("cpu"), grad_accumulation=1)
    else:
        from megabeta.engine.torch_engine import TorchEngine
        engine = TorchEngine(model, config, torch.device("cpu"))
    loss = engine.forward_backward(tokens[:, :-1], tokens[:, 1:], last=True, scale=1.0)
    return float(loss)


def main() -> None:
    backend = sys.argv[1]
    env = init_distributed("gloo")
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(env.rank))
    eager = loss_of(backend, False, tokens)
    torch._dynamo.reset()
    counters.clear()
    compiled = loss_of(backend, True, tokens)
    if env.rank == 0:
        print(json.dumps({"graphs": counters["stats"]["unique_graphs"], "eager": eager,
                          "compiled": compiled}))
    leave()


if __name__ == "__main__":
    main()
