"""`DeepSpeedEngine`: DeepSpeed ZeRO 1/2/3 behind engine/base.py's contract.

DeepSpeed owns accumulation, clipping, bf16 and the optimizer here. Its engine wants `step()`
after every micro-batch's backward and applies the update at the accumulation boundary only;
`forward_backward` makes those calls for the first A-1 micro-batches and `step` the last, so
the update happens in `step`, as with the torch engine. DeepSpeed skips an update whose
gradient norm is not finite by itself (its overflow check); `step` reports that as not applied.

On CPU, DeepSpeed's communication set-up (inside `deepspeed.initialize`) JIT-compiles its C++
shared-memory op `deepspeed_shm_comm` the first time, which takes about half a minute to a minute
and a half and prints nothing meanwhile; rank 0 says so beforehand unless the build is cached.
The engine loads it first, under `kernels.jit_build.build_lock`.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

from megabeta.config import TrainConfig
from megabeta.engine.base import StepResult, document_kwargs
from megabeta.engine.optim import build_optimizer, param_groups, set_lr
from megabeta.extras import require
from megabeta.kernels.jit_build import build_lock, extensions_root
from megabeta.storage.durable import fsync_path, fsync_tree, replace_durably

log = logging.getLogger("megabeta")

SHM_OP = "deepspeed_shm_comm"
"""DeepSpeed's CPU shared-memory collective op, JIT-built by its torch backend on first use."""


def shm_build_notice(root: Path | None = None) -> str | None:
    """What to say before DeepSpeed JIT-compiles `deepspeed_shm_comm`, or None when a build of
    it is already cached under `root` (default: `extensions_root()`)."""
    root = extensions_root() if root is None else root
    build = root / SHM_OP
    if (build / f"{SHM_OP}.so").is_file():
        return None
    return (f"DeepSpeed on CPU: building its C++ communication op {SHM_OP} (a one-time JIT "
            f"compile into {build}; it may take a minute or two and prints nothing until done, "
            "later runs reuse it; set TORCH_EXTENSIONS_DIR to keep the build elsewhere)")


def _shm_build_pending() -> bool:
    """Whether `deepspeed.initialize` in this process is about to build the op: CPU accelerator,
    the op compatible but not installed prebuilt, DeepSpeed's communication backend not set up
    yet. True when DeepSpeed's internals cannot be read (then the notice may be superfluous)."""
    try:
        import deepspeed
        import deepspeed.comm.comm as ds_comm
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import installed_ops

        if get_accelerator().device_name() != "cpu" or installed_ops.get(SHM_OP, False):
            return False
        if getattr(ds_comm, "cdb", None) is not None:
            return False  # set up already: the op was built (or skipped) then
        # False: DeepSpeed falls back to plain torch.distributed and builds nothing
        return bool(deepspeed.ops.__compatible_ops__.get(SHM_OP, False))
    except Exception:  # noqa: BLE001 - DeepSpeed's internals moved
        return True


_announced = False


def announce_shm_build() -> None:
    """Log `shm_build_notice` once per process, on rank 0, when the build is pending."""
    global _announced
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if _announced or rank != 0 or not _shm_build_pending():
        return
    _announced = True
    notice = shm_build_notice()
    if notice:
        log.info("%s", notice)


def load_shm_op() -> None:
    """Load DeepSpeed's `deepspeed_shm_comm` under `build_lock` (a lock left in its build
    folder by a rank killed while loading it would stall every later run) when
    `deepspeed.initialize` would build it: DeepSpeed then finds it loaded."""
    if not _shm_build_pending():
        return
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        with build_lock(SHM_OP):
            builder.load(verbose=False)


class DeepSpeedEngine:
    """`parallel.backend = "deepspeed"`; `load_universal`: resuming at another world size."""

    name = "deepspeed"

    def __init__(self, model: nn.Module, config: TrainConfig, device: torch.device, *,
                 grad_accumulation: int, load_universal: bool = False) -> None:
        if device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # skips DeepSpeed's probing warning
        deepspeed = require("deepspeed", extra="deepspeed", feature="parallel.backend = 'deepspeed'")

        self.device = device
        self.model = model.to(device)
        p = config.parallel
        zero: dict = {"stage": p.zero_stage}
        if p.zero_stage == 3:
            # The pass reads every layer's weights, stacked, once per pass (forward, and backward
            # with the recomputation): keep gathered parameters alive for the whole step so each
            # is fetched once (the first step records the trace).
            zero.update(stage3_max_reuse_distance=1e12, stage3_prefetch_bucket_size=1e9,
                        stage3_max_live_parameters=1e12, stage3_param_persistence_threshold=0)
        ds_config = {
            "train_micro_batch_size_per_gpu": config.train.micro_batch,
            "gradient_accumulation_steps": grad_accumulation,
            "gradient_clipping": config.optim.grad_clip,
            "bf16": {"enabled": config.train.precision == "bf16"},
            "zero_optimization": zero,
            "steps_per_print": 2**62,
            "wall_clock_breakdown": False,
            # Resuming at another world size goes through DeepSpeed's universal checkpoint.
            "checkpoint": {"load_universal": load_universal},
        }
        self.load_universal = load_universal
        groups = param_groups(self.model, config.optim.weight_decay)
        optimizer = None
        if p.deepspeed_optimizer == "deepspeed":
            ds_config["optimizer"] = {"type": "AdamW", "params": {
                "lr": config.optim.lr, "betas": [config.optim.beta1, config.optim.beta2],
                "eps": config.optim.eps, "weight_decay": config.optim.weight_decay}}
        else:
            optimizer = build_optimizer(self.model, config.optim)
            groups = None
        if device.type == "cpu":
            announce_shm_build()  # deepspeed.initialize may JIT-compile for a minute, silently
            load_shm_op()
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=self.model, optimizer=optimizer, model_parameters=groups, config=ds_config)

    def forward_backward(self, inputs: Tensor, targets: Tensor, *, last: bool,
                         scale: float, documents: Tensor | None = None) -> Tensor:
        loss = self.engine(inputs, targets, **document_kwargs(documents))
        # `scale` replaces DeepSpeed's own 1/accumulation (it is 1/A when the micro-batches are
        # equally full, scored-target weighted otherwise: engine/base.py).
        self.engine.backward(loss * scale, scale_wrt_gas=False)
        if not last:
            self.engine.step()      # off the boundary: DeepSpeed's micro-step bookkeeping only
        return loss.detach().float()

    @torch.no_grad()
    def eval_loss(self, inputs: Tensor, targets: Tensor,
                  documents: Tensor | None = None) -> Tensor:
        return self.engine(inputs, targets, **document_kwargs(documents)).detach().float()

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def step(self, loss_finite: bool,
             accept: Callable[[float], bool] | None = None) -> StepResult:
        self.engine.step()          # the accumulation boundary: clip, update (or skip), zero
        norm = self.engine.get_global_grad_norm()
        norm = float("nan") if norm is None else float(norm)
        if accept is not None:
            # Asked after the update, which DeepSpeed made inside its step: the monitor still
            # sees the norm, but its answer cannot undo the update (config validation allows
            # only monitor.spike_action = log with DeepSpeed).
            accept(norm)
        return StepResult(norm, math.isfinite(norm))

    def save(self, path: Path, *, async_save: bool = False) -> Future | None:
        self.engine.save_checkpoint(str(path), tag="engine")
        # DeepSpeed writes without fsync: each rank syncs what it wrote (checkpoint/manager.py's
        # commit order), before the manager's barrier and rename.
        for file in own_files(path, self.engine.global_rank):
            fsync_path(file)
        return None

    def load(self, path: Path) -> None:
        tag = "engine"
        if self.load_universal:
            tag = "universal"
            if self.engine.global_rank == 0 and not (path / tag).is_dir():
                _to_universal(path / "engine", path / tag)
            torch.distributed.barrier()
        load_path, _ = self.engine.load_checkpoint(str(path), tag=tag)
        if load_path is None:
            raise FileNotFoundError(f"{path}: no DeepSpeed engine checkpoint (tag {tag!r}) inside")


def own_files(path: Path, rank: int) -> list[Path]:
    """The files of a DeepSpeed checkpoint in `path` that `rank` wrote: its own
    `zero_pp_rank_<rank>_*` shards, and for rank 0 the rest (model states below ZeRO-3, the
    `latest` tag file)."""
    mine = f"zero_pp_rank_{rank}_"
    return sorted(f for f in path.rglob("*") if f.is_file()
                  and (mine in f.name or (rank == 0 and "zero_pp_rank_" not in f.name)))


def _to_universal(engine_dir: Path, out: Path) -> None:
    """DeepSpeed's own conversion (ds_to_universal), written under a temporary name, synced
    (the converter does not) and renamed: a crash never leaves a partial `out` to load."""
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
           str(engine_dir), "--output_folder", str(tmp), "--num_extract_workers", "1",
           "--num_merge_workers", "1", "--inject_missing_state"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ds_to_universal failed on {engine_dir}: {done.stderr[-2000:]}")
    fsync_tree(tmp)
    replace_durably(tmp, out)
