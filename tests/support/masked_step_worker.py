"""One rank of the masked-loss world-size test: `python masked_step_worker.py RESULTS_DIR`, with
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set. On gloo, for DDP and then FSDP2, runs one
training step's micro-batches of the fixed global batch (this rank's share, as the sampler deals
it: global positions rank, rank + W, ...) through the trainer's `accumulate_step`, and reports the
step loss and the reduced gradients (RESULTS_DIR/rankR.json)."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from support.masked_batches import (
    ATTENTION,
    flat_gradients,
    global_samples,
    micro_batches,
    model_config,
)
from megabeta.config import config_from_flat
from megabeta.engine.torch_engine import TorchEngine
from megabeta.train.loop import accumulate_step
from support.model_helpers import tiny_model


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = list(range(rank, len(global_samples()), world))
    record = {"rank": rank}
    for backend in ("ddp", "fsdp"):
        config = config_from_flat({**model_config(), "parallel.backend": backend})
        engine = TorchEngine(tiny_model(attention=ATTENTION), config, torch.device("cpu"))
        # One sample per micro-batch: accumulation and world size at once.
        loss = accumulate_step(engine, micro_batches([[i] for i in mine]), torch.device("cpu"),
                               world)
        record[backend] = {"loss": loss, "grads": flat_gradients(engine.model).tolist()}
    path = os.path.join(sys.argv[1], f"rank{rank}.json")
    with open(path + ".tmp", "w") as stream:
        json.dump(record, stream)
    os.replace(path + ".tmp", path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
