"""Helpers of the Hugging Face export tests: megabeta models as exports and folders, and the
transformers model of a megabeta model built in memory (no files) for the exactness tests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from megabeta.checkpoint.export import EXPORT_FORMAT, export_hf
from megabeta.data import file_sha256
from megabeta.hf import layout
from megabeta.model import DecoderLM

TRANSFORMERS5 = Path(__file__).resolve().parents[2] / ".venv" / "transformers-5"
"""The newest transformers 5.x, installed apart (make test: `pip install --target`)."""


def save_export(model: DecoderLM, path: Path, tokenizer: Path | None = None,
                data: dict | None = None) -> Path:
    """`model` as a megabeta export (what `megabeta export` writes), recording `tokenizer`."""
    meta = {"format": EXPORT_FORMAT, "model_config": json.dumps(model.config.__dict__)}
    if tokenizer is not None:
        meta["tokenizer"] = json.dumps({"path": str(tokenizer), "sha256": file_sha256(tokenizer)})
    if data is not None:
        meta["data"] = json.dumps(data)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(path),
              metadata=meta)
    return path


def export_folder(model: DecoderLM, tokenizer: Path, directory: Path, **kwargs) -> Path:
    """`model` exported as a Hugging Face folder `directory/hf` (through a megabeta export)."""
    directory.mkdir(parents=True, exist_ok=True)
    source = save_export(model, directory / "source.safetensors", tokenizer)
    return export_hf(source, directory / "hf", **kwargs)


def hf_model(model: DecoderLM):
    """The transformers model (megabeta/hf/modeling_beta12.py) with `model`'s weights, in its
    dtype, built in memory."""
    from megabeta.hf.configuration_beta12 import Beta12Config
    from megabeta.hf.modeling_beta12 import Beta12ForCausalLM

    dtype = next(model.parameters()).dtype
    hf = Beta12ForCausalLM(Beta12Config(**layout.config_fields(model.config))).to(dtype)
    hf.load_state_dict({layout.hf_name(k): v for k, v in model.state_dict().items()},
                       strict=True)
    return hf.eval()


def child_env(pythonpath: Path | None = None) -> dict[str, str]:
    """The environment of a child Python running tiny models (one intra-op thread) that imports
    from `pythonpath` first, when given."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")]
                                            ).rstrip(os.pathsep)
    return env


def greedy(model: DecoderLM, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    """megabeta's greedy continuation of `prompt [T]` (`megabeta.infer.generate`)."""
    from megabeta.infer.generate import generate

    return generate(model, prompt, new_tokens, temperature=0.0)[prompt.numel():].tolist()
