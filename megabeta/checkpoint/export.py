"""Single-file export of a trained model, and loading a model from any checkpoint kind.

`megabeta export --checkpoint RUN/checkpoints/step_N --output model.safetensors` consolidates
the sharded weights (DCP or DeepSpeed ZeRO) into one safetensors file whose metadata holds the
model config, so it loads on a single process without the training code's parallel setup. The
metadata also carries what `megabeta eval` and `megabeta generate` take their defaults from: the
run's data settings (`data`: path, seq_len, val_fraction) and the tokenizer the model was trained
with (`tokenizer`: path, sha256), each a JSON object; exports of older versions lack them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megabeta.checkpoint.manager import CheckpointError, read_train_state
from megabeta.config import load_config
from megabeta.extras import require
from megabeta.model import ConfigError, DecoderLM, ExecutionConfig, ModelConfig, build_model
from megabeta.storage.safe_load import dcp_reader

EXPORT_FORMAT = "megabeta-export/1"
RUN_DATA_KEYS = ("path", "seq_len", "val_fraction", "align", "document_mask")
"""The run's data settings that an export records (its metadata key `data`)."""


@dataclass
class ModelSource:
    """What a checkpoint directory or an export says about its model and the run that made it,
    read without loading weights: where `megabeta eval` and `megabeta generate` take defaults."""

    path: Path
    model_config: ModelConfig
    data: dict = field(default_factory=dict)
    """The run's data settings (keys of RUN_DATA_KEYS); empty when unknown."""
    tokenizer: dict = field(default_factory=dict)
    """The tokenizer the model was trained with: `path` and (unless an old checkpoint) `sha256`."""
    settings_from: str = ""
    """Where `data` came from (the run's config.toml, or the export's metadata); "" if nowhere."""
    notes: list[str] = field(default_factory=list)
    """What could not be read (an unreadable run config), for a warning."""


def run_config_path(checkpoint: Path) -> Path | None:
    """RUN/config.toml of a checkpoint at RUN/checkpoints/step_N (None when it is not there)."""
    checkpoint = checkpoint.resolve()
    for parent in (checkpoint.parent.parent, checkpoint.parent):
        if (parent / "config.toml").is_file():
            return parent / "config.toml"
    return None


def _check_exists(path: Path) -> None:
    if not path.exists():
        raise CheckpointError(f"--checkpoint {path}: no such file or directory; pass a checkpoint "
                              "directory (RUN/checkpoints/step_N) or a .safetensors file written "
                              "by `megabeta export`")


def _export_metadata(path: Path) -> dict[str, str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointError(f"{path}: not a readable safetensors file ({err}); pass a file "
                              "written by `megabeta export`") from None
    if meta.get("format") != EXPORT_FORMAT:
        raise CheckpointError(f"{path} was not written by `megabeta export` (no "
                              f"{EXPORT_FORMAT} metadata)")
    return meta


def _json_field(meta: dict[str, str], key: str, path: Path) -> dict:
    try:
        value = json.loads(meta[key]) if key in meta else {}
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: metadata {key!r} is not valid JSON ({err}); export the "
                              "checkpoint again") from None
    return value if isinstance(value, dict) else {}


def _model_config(fields: dict, path: Path) -> ModelConfig:
    try:
        return ModelConfig.from_saved(fields)
    except (TypeError, ValueError) as err:  # ConfigError is a ValueError
        raise CheckpointError(f"{path}: its model config cannot be read ({err}); it was written "
                              "by another version of megabeta") from None


def read_source(path: str | os.PathLike) -> ModelSource:
    """The ModelSource of a checkpoint directory or an export; CheckpointError when it is none."""
    path = Path(path)
    _check_exists(path)
    if path.suffix == ".safetensors":
        meta = _export_metadata(path)
        model_config = _json_field(meta, "model_config", path)
        data = _json_field(meta, "data", path)
        if not model_config:
            raise CheckpointError(f"{path}: its metadata holds no model_config; export the "
                                  "checkpoint again with `megabeta export`")
        return ModelSource(path, _model_config(model_config, path),
                           data=data, tokenizer=_json_field(meta, "tokenizer", path),
                           settings_from=f"the metadata of {path}" if data else "")
    saved = read_train_state(path)
    source = ModelSource(path, _model_config(saved.model_config, path),
                         tokenizer=dict(saved.tokenizer or {}))
    config_file = run_config_path(path)
    if config_file is not None:
        try:
            run = load_config(config_file)
        except ConfigError as err:
            source.notes.append(f"the run config {config_file} is unreadable ({err}); its "
                                "settings are not used")
            return source
        source.data = {"path": list(run.data.path), "seq_len": run.data.seq_len,
                       "val_fraction": run.data.val_fraction, "align": run.data.align,
                       "document_mask": run.data.document_mask}
        source.settings_from = str(config_file)
        if not source.tokenizer and run.data.tokenizer:
            # a checkpoint of an older version: only the run config names the tokenizer
            source.tokenizer = {"path": run.data.tokenizer}
    return source


def _model_state_from_checkpoint(path: Path, model: DecoderLM, backend: str) -> dict:
    if backend == "deepspeed":
        zero_to_fp32 = require("deepspeed.utils.zero_to_fp32", extra="deepspeed",
                               feature=f"reading the DeepSpeed checkpoint {path}")
        return zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(path / "model"),
                                                                     tag="engine")
    state = {"model": model.state_dict()}
    dcp.load(state, no_dist=True, **dcp_reader(path / "model"))
    return state["model"]


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu",
               execution: ExecutionConfig | None = None) -> DecoderLM:
    """The model in a checkpoint directory (any backend) or an exported .safetensors file,
    running as `execution` says (default: `ExecutionConfig()`)."""
    path = Path(path)
    _check_exists(path)
    try:
        if path.suffix == ".safetensors":
            meta = _export_metadata(path)
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
    """Write the checkpoint's model as one safetensors file (atomically), with the run's data
    settings and the model's tokenizer in its metadata when the checkpoint knows them."""
    source = read_source(checkpoint)
    model = load_model(checkpoint)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    meta = {"format": EXPORT_FORMAT, "model_config": json.dumps(model.config.__dict__),
            "source": str(checkpoint)}
    if source.data:
        meta["data"] = json.dumps({k: source.data[k] for k in RUN_DATA_KEYS if k in source.data})
    if source.tokenizer:
        meta["tokenizer"] = json.dumps(source.tokenizer)
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
