"""The `megabeta` command: one entry point, a subcommand per job."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module with `main(argv)`, one-line help)
COMMANDS = {
    "train": ("megabeta.train.cli", "pretrain a model arm (torchrun/srun/mpirun aware)"),
    "export": ("megabeta.checkpoint.export", "a checkpoint as one safetensors file, or as a "
               "Hugging Face folder (--format hf)"),
    "eval": ("megabeta.infer.cli:eval_main", "validation loss and perplexity of a checkpoint"),
    "generate": ("megabeta.infer.cli:generate_main", "continue a prompt with the KV cache"),
    "lm-eval": ("megabeta.infer.cli:lm_eval_main",
                "the lm-evaluation-harness's command line with the megabeta model registered"),
    "bench": ("megabeta.bench.__main__", "benchmarks that print figures: bench {model,data,train}"),
    "tasks": ("megabeta.tasks.cli", "synthetic tasks with scored answers: tasks {make,eval}"),
    "ablate": ("megabeta.ablate.cli", "train arms on the same data, summarise mean ± spread"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="megabeta", description="megabeta: pretraining for beta_1.2 (Beta12Transformer).",
        epilog="Run `megabeta COMMAND --help` for a command's options.")
    parser.add_argument("command", choices=sorted(COMMANDS),
                        help="; ".join(f"{k}: {v[1]}" for k, v in sorted(COMMANDS.items())))
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv[:1] or ["--help"])
    module_name, _, function = COMMANDS[argv[0]][0].partition(":")
    entry = getattr(importlib.import_module(module_name), function or "main")
    return entry(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
