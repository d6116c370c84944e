"""Single-file export of a trained model, and loading a model from any checkpoint kind.

`megabeta export --checkpoint RUN/checkpoints/step_N --output model.safetensors` consolidates
the sharded weights (DCP or DeepSpeed ZeRO) into one safetensors file whose metadata holds the
model config, so it loads on a single process without the training code's parallel setup.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megabeta.checkpoint.manager import CheckpointError, read_train_state
from megabeta.extras import require
from megabeta.model import DecoderLM, ExecutionConfig, ModelConfig, build_model

EXPORT_FORMAT = "megabeta-export/1"


def _model_state_from_checkpoint(path: Path, model: DecoderLM, backend: str) -> dict:
    if backend == "deepspeed":
        zero_to_fp32 = require("deepspeed.utils.zero_to_fp32", extra="deepspeed",
                               feature=f"reading the DeepSpeed checkpoint {path}")
        return zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(path / "model"),
                                                                     tag="engine")
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(path / "model"), no_dist=True)
    return state["model"]


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu",
               execution: ExecutionConfig | None = None) -> DecoderLM:
    """The model in a checkpoint directory (any backend) or an exported .safetensors file,
    running as `execution` says (default: `ExecutionConfig()`)."""
    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
            if meta.get("format") != EXPORT_FORMAT:
                raise CheckpointError(f"{path} was not written by `megabeta export` (no "
                                      f"{EXPORT_FORMAT} metadata)")
            model = build_model(ModelConfig.from_saved(json.loads(meta["model_config"])),
                                execution)
            state = load_file(str(path))
        else:
            saved = read_train_state(path)
            model = build_model(ModelConfig.from_saved(saved.model_config), execution)
            state = _model_state_from_checkpoint(path, model, saved.backend)
        model.load_state_dict(state, strict=True)
    except (OSError, RuntimeError, KeyError, ValueError) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(f"cannot load a model from {path}: {err}") from err
    return model.to(device).eval()


def export(checkpoint: str | os.PathLike, output: str | os.PathLike) -> Path:
    """Write the checkpoint's model as one safetensors file (atomically)."""
    model = load_model(checkpoint)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    meta = {"format": EXPORT_FORMAT, "model_config": json.dumps(model.config.__dict__),
            "source": str(checkpoint)}
    save_file(state, str(tmp), metadata=meta)
    os.replace(tmp, output)
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megabeta export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="a checkpoint directory (RUN/checkpoints/step_N)")
    parser.add_argument("--output", required=True, help="the .safetensors file to write")
    args = parser.parse_args(argv)
    try:
        out = export(args.checkpoint, args.output)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
