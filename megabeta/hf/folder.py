"""A Hugging Face model folder of a megabeta model: written by `megabeta export --format hf`,
read back by `megabeta.checkpoint.export` (`load_model(DIR)`, `eval`, `generate`,
`model.init_from`).

    DIR/config.json                  Beta12Config's fields (layout.CONFIG_KEYS), model_type,
                                     auto_map, and `megabeta`: what megabeta reads back (the
                                     run's data settings, the tokenizer file and its sha256)
    DIR/model.safetensors            the weights under Hugging Face names (layout); above
                                     --max-shard-size: model-0000i-of-0000n.safetensors and
                                     model.safetensors.index.json, as transformers writes them
    DIR/generation_config.json       BOS/EOS/pad ids for `generate()`
    DIR/configuration_beta12.py      the code transformers runs (trust_remote_code=True)
    DIR/modeling_beta12.py
    DIR/tokenizer.json, tokenizer_config.json, special_tokens_map.json (+ tokenizer.model for a
                                     sentencepiece model): see tokenizer.py

The folder is written in a temporary folder beside DIR, every file synced, and renamed to DIR at
the end: an export that fails leaves nothing behind. The weights are written one shard at a time
from the model's own tensors (safetensors serialises the shard), so the export holds at most one
shard's copy of the weights besides the model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from data_tools.tokenizer import Tokenizer
from megabeta.checkpoint.manager import CheckpointError
from megabeta.hf import layout
from megabeta.hf.tokenizer import SENTENCEPIECE_FILE, TOKENIZER_JSON, tokenizer_files
from megabeta.model import ModelConfig
from megabeta.storage.durable import (fsync_directories, fsync_path, replace_durably,
                                      temporary_sibling, write_synced)

FORMAT = "megabeta-hf/1"
"""`config.json`'s `megabeta.format`."""
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CODE_FILES = ("configuration_beta12.py", "modeling_beta12.py")
"""The files transformers runs, copied from this package."""
AUTO_MAP = {"AutoConfig": "configuration_beta12.Beta12Config",
            "AutoModel": "modeling_beta12.Beta12Model",
            "AutoModelForCausalLM": "modeling_beta12.Beta12ForCausalLM"}
DEFAULT_MAX_SHARD_SIZE = "5GB"
"""Largest weights file before the weights are sharded (transformers' `save_pretrained`'s)."""

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """Bytes of a size such as `5GB`, `500MB`, `2GiB` or `1000000`; ValueError otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
    if not match or match.group(2) not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a size (e.g. 5GB, 500MB, 2GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def is_folder(path: Path) -> bool:
    """Whether `path` is a model folder (a directory with a config.json)."""
    return path.is_dir() and (path / CONFIG_FILE).is_file()


@dataclass
class FolderSource:
    """What a folder's config.json says of its model, read without the weights."""

    model_config: ModelConfig
    data: dict = field(default_factory=dict)
    """The run's data settings recorded at export; empty when unknown."""
    tokenizer: dict = field(default_factory=dict)
    """`path` of the folder's tokenizer file megabeta reads and, when known, its `sha256`."""


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: not readable JSON ({err})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return value


def read_folder(path: str | os.PathLike) -> FolderSource:
    """The FolderSource of model folder `path`; CheckpointError naming the file when it is not
    one megabeta can load."""
    path = Path(path)
    config_file = path / CONFIG_FILE
    config = _read_json(config_file)
    if config.get("model_type") != layout.MODEL_TYPE:
        raise CheckpointError(f"{config_file}: model_type {config.get('model_type')!r}, not "
                              f"{layout.MODEL_TYPE!r}: megabeta loads the folders `megabeta "
                              "export --format hf` writes (and their fine-tuned copies)")
    try:
        model_config = layout.model_config(config)
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{config_file}: {err}; it does not describe a beta12 "
                              "model") from None
    recorded = config.get("megabeta") if isinstance(config.get("megabeta"), dict) else {}
    return FolderSource(model_config, data=dict(recorded.get("data") or {}),
                        tokenizer=_folder_tokenizer(path, recorded.get("tokenizer") or {}))


def _folder_tokenizer(path: Path, recorded: dict) -> dict:
    """The tokenizer file megabeta reads in the folder: the one the export recorded (with its
    sha256), else a tokenizer.model, else a tokenizer.json (sha256 unknown: a copy saved by
    another tool)."""
    name = recorded.get("file")
    if isinstance(name, str) and (path / name).is_file():
        return {"path": str(path / name), "sha256": recorded.get("sha256")}
    for name in (SENTENCEPIECE_FILE, TOKENIZER_JSON):
        if (path / name).is_file():
            return {"path": str(path / name)}
    return {}


def _weight_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: has no weight_map")
        files = [path / name for name in dict.fromkeys(weight_map.values())]
    else:
        files = [path / WEIGHTS_FILE]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{path}: weights file(s) {', '.join(missing)} missing; the folder "
                              "is incomplete, export it again")
    return files


def read_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The folder's weights under megabeta's parameter names (on the CPU, as stored);
    CheckpointError naming a tensor that is no beta12 parameter."""
    path = Path(path)
    state: dict[str, torch.Tensor] = {}
    for file in _weight_files(path):
        try:
            tensors = load_file(str(file))
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
            raise CheckpointError(f"{file}: not a readable safetensors file ({err})") from None
        for name, tensor in tensors.items():
            own = layout.megabeta_name(name)
            if own is None:
                raise CheckpointError(f"{file}: tensor {name!r} is not a parameter of a beta12 "
                                      "model; the folder holds another architecture")
            state[own] = tensor
    return state


def _shards(state: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """`state` in order, cut into groups of at most `limit` bytes (a larger tensor alone)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def _write_weights(folder: Path, state: dict[str, torch.Tensor], limit: int) -> None:
    shards = _shards(state, limit)
    names = ([WEIGHTS_FILE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for name, shard in zip(names, shards):
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        fsync_path(folder / name)
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {tensor: name for name, shard in zip(names, shards)
                                for tensor in shard}}
        write_synced(folder / INDEX_FILE, _json(index))


def _json(value: dict) -> bytes:
    return (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _config(config: ModelConfig, tokenizer: Tokenizer, dtype: torch.dtype, data: dict,
            source: str) -> dict:
    info = tokenizer.info
    tokenizer_file = SENTENCEPIECE_FILE if info.kind == "sentencepiece" else TOKENIZER_JSON
    return {"architectures": ["Beta12ForCausalLM"], "auto_map": AUTO_MAP,
            "model_type": layout.MODEL_TYPE, **layout.config_fields(config),
            "bos_token_id": info.eos_id, "eos_token_id": info.eos_id,
            "pad_token_id": info.pad_id if info.pad_id >= 0 else None,
            "torch_dtype": str(dtype).removeprefix("torch."), "use_cache": True,
            "megabeta": {"format": FORMAT, "source": source, "data": data,
                         "tokenizer": {"file": tokenizer_file, "sha256": info.sha256}}}


def _generation_config(tokenizer: Tokenizer) -> dict:
    info = tokenizer.info
    return {"bos_token_id": info.eos_id, "eos_token_id": info.eos_id,
            "pad_token_id": info.pad_id if info.pad_id >= 0 else info.eos_id}


def check_output(output: Path) -> None:
    """CheckpointError when `output` exists and is not an empty folder (an export never
    replaces one)."""
    if output.exists() and not (output.is_dir() and not any(output.iterdir())):
        raise CheckpointError(f"--output {output} already exists; pass a new folder (or remove "
                              "it first)")


def write_folder(output: str | os.PathLike, state: dict[str, torch.Tensor],
                 config: ModelConfig, tokenizer: Tokenizer, *, data: dict | None = None,
                 source: str = "", max_shard_bytes: int = parse_size(DEFAULT_MAX_SHARD_SIZE)
                 ) -> Path:
    """Write the model folder `output` of the model `config` with the weights `state`
    (megabeta's parameter names) and `tokenizer`, atomically; returns `output`."""
    output = Path(output)
    check_output(output)
    files = tokenizer_files(tokenizer, config.max_seq_len)  # before anything is written
    hf_state = {layout.hf_name(name): tensor.contiguous() for name, tensor in state.items()}
    dtype = next(iter(hf_state.values())).dtype
    output.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_sibling(output)
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    try:
        _write_weights(temporary, hf_state, max_shard_bytes)
        files[CONFIG_FILE] = _json(_config(config, tokenizer, dtype, data or {}, source))
        files["generation_config.json"] = _json(_generation_config(tokenizer))
        here = Path(__file__).parent
        for name in CODE_FILES:
            files[name] = (here / name).read_bytes()
        for name, contents in files.items():
            write_synced(temporary / name, contents)
        fsync_directories(temporary)
        if output.is_dir():
            output.rmdir()  # empty (check_output)
        replace_durably(temporary, output)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return output


__all__ = ["FolderSource", "read_folder", "read_weights", "write_folder", "is_folder",
           "check_output", "parse_size", "FORMAT", "DEFAULT_MAX_SHARD_SIZE"]
