"""Export of a trained model, and loading a model from any checkpoint kind.

`megabeta export --checkpoint RUN/checkpoints/step_N --output model.safetensors` consolidates
the sharded weights (DCP or DeepSpeed ZeRO) into one safetensors file whose metadata holds the
model config, so it loads on a single process without the training code's parallel setup. The
metadata also carries what `megabeta eval` and `megabeta generate` take their defaults from: the
run's data settings (`data`: path, seq_len, val_fraction) and the tokenizer the model was trained
with (`tokenizer`: path, sha256), each a JSON object; exports of older versions lack them.

`megabeta export --format hf --checkpoint CKPT --output DIR` writes a Hugging Face model folder
instead (megabeta/hf/folder.py): config.json, the weights (sharded above --max-shard-size), the
modeling code transformers runs with `trust_remote_code=True`, and the tokenizer. Every command
that takes a checkpoint also takes such a folder (a model fetched from the Hub included).
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

from data_tools.tokenizer import load_tokenizer
from megabeta.checkpoint.manager import STATE_FILE, CheckpointError, read_train_state
from megabeta.config import load_config
from megabeta.data import DataError, file_sha256
from megabeta.extras import require
from megabeta.hf import folder as hf_folder
from megabeta.model import ConfigError, DecoderLM, ExecutionConfig, ModelConfig, build_model
from megabeta.storage.durable import AtomicFiles
from megabeta.storage.safe_load import dcp_reader

EXPORT_FORMAT = "megabeta-export/1"
FORMATS = ("safetensors", "hf")
"""`megabeta export --format`: one safetensors file (megabeta's), or a Hugging Face folder."""
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


_KINDS = ("a checkpoint directory (RUN/checkpoints/step_N), a .safetensors file written by "
          "`megabeta export` or a folder written by `megabeta export --format hf`")


def _check_exists(path: Path) -> None:
    """CheckpointError unless `path` exists and looks like a model of one of the kinds."""
    if not path.exists():
        raise CheckpointError(f"--checkpoint {path}: no such file or directory; pass {_KINDS}")
    if path.is_file() and path.suffix != ".safetensors" or path.is_dir() and not (
            hf_folder.is_folder(path) or (path / STATE_FILE).exists()
            or (path / "model").is_dir()):
        raise CheckpointError(f"--checkpoint {path} is not a model; pass {_KINDS}")


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
    """The ModelSource of a checkpoint directory, an export or a Hugging Face folder;
    CheckpointError when it is none."""
    path = Path(path)
    _check_exists(path)
    if hf_folder.is_folder(path):
        folder = hf_folder.read_folder(path)
        return ModelSource(path, folder.model_config, data=folder.data,
                           tokenizer=folder.tokenizer,
                           settings_from=f"{path / hf_folder.CONFIG_FILE}" if folder.data else "")
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


def initial_model_config(path: str) -> ModelConfig:
    """The config of the model `model.init_from` names, read without its weights (the
    `read_model` of `megabeta.config.load_config`); ConfigError naming the key."""
    if not Path(path).exists():
        raise ConfigError(f"model.init_from = {path!r}: no such file or directory; pass {_KINDS}")
    try:
        return read_source(path).model_config
    except CheckpointError as err:
        raise ConfigError(f"model.init_from = {path!r}: {err}") from None


def _model_state_from_checkpoint(path: Path, model: DecoderLM, backend: str) -> dict:
    if backend == "deepspeed":
        zero_to_fp32 = require("deepspeed.utils.zero_to_fp32", extra="deepspeed",
                               feature=f"reading the DeepSpeed checkpoint {path}")
        return zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(path / "model"),
                                                                     tag="engine")
    state = {"model": model.state_dict()}
    dcp.load(state, no_dist=True, **dcp_reader(path / "model"))
    return state["model"]


def _mismatch(model: DecoderLM, state: dict[str, torch.Tensor]) -> str:
    """What keeps `state` from loading into `model`, in one line ("" when nothing)."""
    own = model.state_dict()
    problems = [f"{name} is {list(state[name].shape)} in the weights, {list(t.shape)} for "
                "the config" for name, t in own.items()
                if name in state and state[name].shape != t.shape]
    missing = [name for name in own if name not in state]
    unexpected = [name for name in state if name not in own]
    if missing:
        problems.append(f"missing {', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else ""))
    if unexpected:
        problems.append(f"not in the config's model {', '.join(unexpected[:3])}"
                        + (" ..." if len(unexpected) > 3 else ""))
    return "; ".join(problems[:4])


def _saved_state(path: Path, execution: ExecutionConfig | None
                 ) -> tuple[DecoderLM, dict[str, torch.Tensor], str]:
    """The model `path`'s config describes, its weights and what describes the config."""
    if hf_folder.is_folder(path):
        model = build_model(hf_folder.read_folder(path).model_config, execution)
        return model, hf_folder.read_weights(path), f"{path / hf_folder.CONFIG_FILE}"
    if path.suffix == ".safetensors":
        meta = _export_metadata(path)
        model = build_model(ModelConfig.from_saved(json.loads(meta["model_config"])), execution)
        return model, load_file(str(path)), "its model_config"
    saved = read_train_state(path)
    model = build_model(ModelConfig.from_saved(saved.model_config), execution)
    return model, _model_state_from_checkpoint(path, model, saved.backend), "its train state"


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu",
               execution: ExecutionConfig | None = None) -> DecoderLM:
    """The model in a checkpoint directory (any backend), an exported .safetensors file or a
    Hugging Face folder of `megabeta export --format hf`, running as `execution` says
    (default: `ExecutionConfig()`)."""
    path = Path(path)
    _check_exists(path)
    try:
        model, state, described = _saved_state(path, execution)
        mismatch = _mismatch(model, state)
        if mismatch:
            raise CheckpointError(f"{path}: {described} does not match its weights ({mismatch}); "
                                  "the files were not written together, export the model again")
        model.load_state_dict(state, strict=True)
    except (OSError, RuntimeError, KeyError, ValueError) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(f"cannot load a model from {path}: {err}") from err
    return model.to(device).eval()


def export(checkpoint: str | os.PathLike, output: str | os.PathLike) -> Path:
    """Write the checkpoint's model as one safetensors file (atomically and durably), with the run's data
    settings and the model's tokenizer in its metadata when the checkpoint knows them."""
    source = read_source(checkpoint)
    model = load_model(checkpoint)
    output = Path(output)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    meta = {"format": EXPORT_FORMAT, "model_config": json.dumps(model.config.__dict__),
            "source": str(checkpoint)}
    if source.data:
        meta["data"] = json.dumps(_run_data(source))
    if source.tokenizer:
        meta["tokenizer"] = json.dumps(source.tokenizer)
    with AtomicFiles([output]) as files:
        save_file(state, str(files.temp(output)), metadata=meta)
        files.commit()
    return output


def _run_data(source: ModelSource) -> dict:
    return {k: source.data[k] for k in RUN_DATA_KEYS if k in source.data}


def _export_tokenizer(source: ModelSource, given: str):
    """The tokenizer a folder export carries: `given` (--tokenizer) or the one recorded with
    the model, which must be the file it was trained with (its sha256)."""
    path = given or source.tokenizer.get("path", "")
    if not path:
        raise CheckpointError(f"{source.path} records no tokenizer (its run named no "
                              "data.tokenizer); pass --tokenizer PATH, the .model or "
                              "tokenizer.json its training data was tokenized with")
    if not Path(path).is_file():
        raise CheckpointError(f"{'--tokenizer ' if given else 'the recorded tokenizer '}{path}: "
                              "no such file; pass --tokenizer PATH, a copy of the model's "
                              "tokenizer")
    recorded = source.tokenizer.get("sha256")
    if recorded and file_sha256(path) != recorded:
        raise CheckpointError(f"{path} is not the tokenizer the model was trained with (sha256 "
                              f"{recorded[:16]}… recorded with {source.path}); pass --tokenizer "
                              "with that file")
    try:
        return load_tokenizer(path)
    except DataError as err:
        raise CheckpointError(f"--tokenizer: {err}") from None


def export_hf(checkpoint: str | os.PathLike, output: str | os.PathLike, *, tokenizer: str = "",
              max_shard_size: str = hf_folder.DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Write the checkpoint's model as a Hugging Face folder (megabeta/hf/folder.py) with its
    tokenizer (`tokenizer`, default: the recorded one), atomically."""
    output = Path(output)
    try:
        shard_bytes = hf_folder.parse_size(max_shard_size)
    except ValueError as err:
        raise CheckpointError(f"--max-shard-size: {err}") from None
    hf_folder.check_output(output)
    source = read_source(checkpoint)
    processor = _export_tokenizer(source, tokenizer)
    if processor.vocab_size > source.model_config.vocab_size:
        raise CheckpointError(f"tokenizer {processor.info.path} has {processor.vocab_size} "
                              f"pieces, more than the model's vocabulary "
                              f"({source.model_config.vocab_size}); pass the tokenizer the model "
                              "was trained with")
    model = load_model(checkpoint)
    try:
        return hf_folder.write_folder(output, model.state_dict(), model.config, processor,
                                      data=_run_data(source), source=str(checkpoint),
                                      max_shard_bytes=shard_bytes)
    except OSError as err:
        raise CheckpointError(f"--output {output}: cannot write the folder ({err}); nothing "
                              "was left behind") from None


EPILOG = """examples:
  megabeta export --checkpoint runs/t1/checkpoints/step_1000 --output t1.safetensors
  megabeta export --format hf --checkpoint runs/t1/checkpoints/step_1000 --output t1-hf
then, with transformers:
  AutoModelForCausalLM.from_pretrained("t1-hf", trust_remote_code=True)
  AutoTokenizer.from_pretrained("t1-hf")
and back in megabeta: megabeta eval/generate --checkpoint t1-hf, --model.init_from=t1-hf
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megabeta export", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="a checkpoint directory (RUN/checkpoints/step_N), an export "
                        ".safetensors or a Hugging Face folder of this command")
    parser.add_argument("--output", required=True,
                        help="the .safetensors file to write (--format hf: the folder, which "
                        "must not exist or be empty)")
    parser.add_argument("--format", choices=FORMATS, default="safetensors",
                        help="safetensors: one file megabeta reads; hf: a Hugging Face folder "
                        "that transformers loads, tokenizer included (default: safetensors)")
    hf = parser.add_argument_group("--format hf")
    hf.add_argument("--tokenizer", default="",
                    help="the tokenizer (.model or tokenizer.json) the model was trained with "
                    "(default: the one recorded with the checkpoint)")
    hf.add_argument("--max-shard-size", default=hf_folder.DEFAULT_MAX_SHARD_SIZE,
                    help="largest weights file; larger weights are sharded with an index, as "
                    f"transformers does (default: {hf_folder.DEFAULT_MAX_SHARD_SIZE})")
    args = parser.parse_args(argv)
    if args.format != "hf":
        for flag, value, default in (("--tokenizer", args.tokenizer, ""),
                                     ("--max-shard-size", args.max_shard_size,
                                      hf_folder.DEFAULT_MAX_SHARD_SIZE)):
            if value != default:
                parser.error(f"argument {flag}: only with --format hf")
    try:
        if args.format == "hf":
            out = export_hf(args.checkpoint, args.output, tokenizer=args.tokenizer,
                            max_shard_size=args.max_shard_size)
        else:
            out = export(args.checkpoint, args.output)
    except (CheckpointError, ConfigError) as err:  # MissingExtra, a tokenizer that won't convert
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
