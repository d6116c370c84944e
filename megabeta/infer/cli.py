"""`megabeta eval` (validation loss and perplexity) and `megabeta generate` (continue a prompt),
from an exported .safetensors file or a checkpoint directory, on one process."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from megabeta.checkpoint import CheckpointError
from megabeta.checkpoint.export import load_model
from megabeta.config import load_config
from megabeta.data import DataError, GlobalSampler, build_train_val
from megabeta.infer.evaluate import evaluate
from megabeta.infer.generate import generate


def _run_config_value(checkpoint: Path, key: str) -> str:
    """A value from the run's saved config.toml (RUN/config.toml next to RUN/checkpoints)."""
    for parent in checkpoint.resolve().parents:
        if (parent / "config.toml").is_file():
            section, name = key.split(".")
            return getattr(getattr(load_config(parent / "config.toml"), section), name)
    return ""


def evaluate_checkpoint(checkpoint: str, data_paths: list[str], *, seq_len: int,
                        batch_size: int, val_fraction: float,
                        max_batches: int) -> dict[str, float]:
    """`evaluate` of a checkpoint's model on the held-out split of `data_paths` (the whole
    data when `val_fraction` is 0)."""
    model = load_model(checkpoint)
    data = build_train_val(data_paths, None, seq_len=seq_len, val_fraction=val_fraction)
    dataset = data.val if data.val is not None else data.train
    sampler = GlobalSampler(len(dataset), shuffle=False, num_epochs=1)
    return evaluate(model, dataset, sampler, batch_size=batch_size, max_batches=max_batches)


def eval_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megabeta eval", description=__doc__)
    parser.add_argument("--checkpoint", required=True, help="checkpoint dir or .safetensors")
    parser.add_argument("--data.path", dest="data", required=True,
                        help="dataset prefix(es), comma-separated")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sample")
    parser.add_argument("--val-fraction", type=float, default=0.01,
                        help="evaluate the last documents of this share (0: the whole dataset)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--batches", type=int, default=0, help="at most this many (0 = all)")
    args = parser.parse_args(argv)
    try:
        result = evaluate_checkpoint(args.checkpoint, args.data.split(","), seq_len=args.seq_len,
                                     batch_size=args.batch_size, val_fraction=args.val_fraction,
                                     max_batches=args.batches)
    except (CheckpointError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"loss {result['loss']:.4f} | ppl {result['ppl']:.2f} | {result['samples']} samples")
    return 0


def generate_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megabeta generate", description=__doc__)
    parser.add_argument("--checkpoint", required=True, help="checkpoint dir or .safetensors")
    parser.add_argument("--tokenizer", default="",
                        help="sentencepiece .model (default: the run's data.tokenizer)")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import sentencepiece as spm

    tokenizer_path = args.tokenizer or _run_config_value(Path(args.checkpoint), "data.tokenizer")
    if not tokenizer_path or not Path(tokenizer_path).is_file():
        print(f"error: tokenizer {tokenizer_path or '(none)'} not found; pass --tokenizer "
              "PATH.model", file=sys.stderr)
        return 2
    try:
        model = load_model(args.checkpoint)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    sp = spm.SentencePieceProcessor(model_file=tokenizer_path)
    prompt = torch.tensor(sp.encode(args.prompt), dtype=torch.long)
    if prompt.numel() == 0:
        print("error: --prompt encodes to no tokens", file=sys.stderr)
        return 2
    out = generate(model, prompt, args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    print(args.prompt + sp.decode(out[prompt.numel():].tolist()))
    return 0
