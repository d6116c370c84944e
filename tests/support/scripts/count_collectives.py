"""Under torchrun: count parameter all-gathers and gradient reduce-scatters per training step
of the real backends (FSDP2, DeepSpeed ZeRO-3) on a beta_1.2 whose layers run T/c times a step.
Arguments: backend (fsdp, zero3), execution.activation_checkpoint, execution.schedule.
Prints one JSON line (rank 0) with the counts of steps 2 and 3 (step 1 may warm up)."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from megabeta.config import config_from_flat
from megabeta.model import build_model
from megabeta.engine.deepspeed_engine import DeepSpeedEngine
from megabeta.engine.torch_engine import TorchEngine
from megabeta.parallel.env import init_distributed
from zero3_exit import leave


def main() -> None:
    backend = sys.argv[1]
    env = init_distributed("gloo")
    config = config_from_flat({
        "model.vocab_size": 64, "model.d_model": 32, "model.hidden_dim": 64,
        "model.num_heads": 2, "model.num_layers": 3, "model.block_size": 4,
        "model.max_seq_len": 32, "execution.activation_checkpoint": sys.argv[2],
        "execution.schedule": sys.argv[3],
        "data.seq_len": 32, "train.global_batch": 4, "train.micro_batch": 2,
        "parallel.backend": "deepspeed" if backend == "zero3" else "fsdp",
        "parallel.zero_stage": 3})
    torch.manual_seed(0)
    model = build_model(config.model, config.execution)
    if backend == "zero3":
        runner = DeepSpeedEngine(model, config, torch.device("cpu"), grad_accumulation=1)
        import deepspeed.comm as comm
        names = {"allgather_fn": "gather", "all_gather_into_tensor": "gather",
                 "reduce_scatter_fn": "scatter", "reduce_scatter_tensor": "scatter"}
        module = comm
    else:
        runner = TorchEngine(model, config, torch.device("cpu"))
        names = {"all_gather_single": "gather", "reduce_scatter_single": "scatter"}
        module = dist
    counts = {"gather": 0, "scatter": 0}
    for name, kind in names.items():
        original = getattr(module, name)

        def counted(*args, _original=original, _kind=kind, **kwargs):
            counts[_kind] += 1
            return _original(*args, **kwargs)

        setattr(module, name, counted)
    tokens = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(env.rank))
    per_step = []
    for _ in range(3):
        counts.update(gather=0, scatter=0)
        runner.forward_backward(tokens[:, :-1], tokens[:, 1:], last=True, scale=1.0)
        after_forward_backward = dict(counts)
        runner.step(True)
        per_step.append({"total": dict(counts), "fwd_bwd": after_forward_backward})
    if env.is_rank0:
        print(json.dumps({"steps": per_step, "layers": config.model.num_layers,
                          "blocks": 32 // config.model.block_size}), flush=True)
    leave()


if __name__ == "__main__":
    main()
