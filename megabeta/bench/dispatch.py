"""Kernel launches per (block, layer) cell of a beta_1.2 training step, per attention backend.

    python -m megabeta.bench dispatch            # or: megabeta bench dispatch
    python -m megabeta.bench dispatch --bf16     # the trainer's precision: bf16 autocast

A beta_1.2 step runs every layer once per block: at t19_flash's 16K tokens and c = 32 that is
512 x 4 cells per sequence, and on a GPU each kernel launch costs a few microseconds however
little it computes. So the figure that decides GPU speed at small c is the number of
kernel-launching operations per cell, which is deterministic and countable on a CPU:

- `DispatchCount` (megabeta/kernels/ops.py) is a `TorchDispatchMode` that counts every ATen operator except views and
  metadata (`NO_KERNEL`); a megabeta custom op is not counted as one call but run through its
  Python implementation under the same mode, so the ATen operators inside it count, and each
  Triton launch inside counts once (`megabeta.kernels.ops.launch`).
- Per cell: a training step (forward, backward and, with block checkpointing, the recompute) at
  two lengths, and the difference divided by the extra cells. `--bf16` counts it as the
  trainer runs it: bf16 autocast over float32 parameters, where every cast is a launch. What every step does once (the
  embedding, the fused weights, the head and loss) cancels out: the figure is what each further
  block of a long sequence costs.

The model is t19_flash's structure (4 layers, depth window 2, c = 32, depth bias, layer
encodings, self slot, tied embedding) at a small width: the count does not depend on the width.
The standard arm's launches per layer over the whole sequence are printed next to it.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from megabeta.kernels.ops import DispatchCount
from megabeta.model import ExecutionConfig, ModelConfig, build_model, get_preset

def count_step(model: torch.nn.Module, tokens: torch.Tensor, *, run_kernels: bool = True,
               documents: torch.Tensor | None = None, bf16: bool = False) -> DispatchCount:
    """The kernel launches of one training step (forward + backward) of `model` on `tokens`
    (with document ids `documents`, spec §7, when given), from no gradients (as after the
    optimizer's `zero_grad`; existing ones would add an accumulation per parameter).
    `run_kernels=False`: Triton launches counted, not run; `bf16`: under bf16 autocast (the
    trainer's precision with float32 parameters)."""
    model.zero_grad(set_to_none=True)
    kwargs = {} if documents is None else {"documents": documents}
    device = next(model.parameters()).device.type
    with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16), \
            DispatchCount(run_kernels=run_kernels) as count:
        model(tokens, tokens, **kwargs).backward()
    return count


DOCUMENT_LENGTH = 20
"""Tokens per document of the masked count (`per_cell(documents=True)`): boundaries inside
blocks and across them."""


def document_ids(length: int) -> torch.Tensor:
    """`[1, length]` ids of documents of DOCUMENT_LENGTH tokens."""
    return (torch.arange(length) // DOCUMENT_LENGTH)[None]


def counting_config(block_size: int = 32, **overrides: Any) -> ModelConfig:
    """t19_flash's structure at a width where counting is quick (see the module doc)."""
    small = dict(vocab_size=64, d_model=64, hidden_dim=96, num_heads=4, num_kv_heads=4,
                 max_seq_len=16 * block_size, block_size=block_size)
    return get_preset("t19_flash", **{**small, **overrides})


def per_cell(attention: str, *, elementwise_kernels: str = "torch",
             blocks: tuple[int, int] = (3, 5), activation_checkpoint: str = "block",
             documents: bool = False, bf16: bool = False,
             **overrides: Any) -> dict[str, Any]:
    """Launches per (block, layer) cell of a training step: the difference between steps of
    `blocks[1]` and `blocks[0]` blocks, per extra cell; plus the operators of the longer step.
    `documents`: with a document mask (`document_ids`); `bf16`: under bf16 autocast. Triton launches run only on a GPU;
    elsewhere they are counted, not run (under the interpreter they would take minutes, and
    the count does not depend on the numbers)."""
    config = counting_config(**overrides)
    execution = ExecutionConfig(attention=attention, elementwise_kernels=elementwise_kernels,
                                activation_checkpoint=activation_checkpoint)
    torch.manual_seed(0)
    model = build_model(config, execution)
    counts = []
    for n in blocks:
        tokens = torch.randint(0, config.vocab_size, (1, n * config.block_size))
        ids = document_ids(tokens.shape[1]) if documents else None
        counts.append(count_step(model, tokens, documents=ids, bf16=bf16,
                                 run_kernels=model.kernels_device.type == "cuda"))
    cells = (blocks[1] - blocks[0]) * config.num_layers
    return {"attention": attention, "elementwise_kernels": elementwise_kernels,
            "bf16": bf16, "per_cell": (counts[1].total - counts[0].total) / cells,
            "ops_per_cell": {op: (n - counts[0].by_op.get(op, 0)) / cells
                             for op, n in counts[1].by_op.items()},
            "step": counts[1].total, "ops": dict(counts[1].by_op.most_common()),
            "launches": counts[1].launches()}


def standard_per_layer(tokens: int = 160, *, bf16: bool = False) -> float:
    """The standard arm's launches per layer of a training step over `tokens` tokens."""
    config = counting_config(arch="standard", max_seq_len=tokens)
    model = build_model(config, ExecutionConfig(activation_checkpoint="block"))
    batch = torch.randint(0, config.vocab_size, (1, tokens))
    return count_step(model, batch, bf16=bf16).total / config.num_layers


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="megabeta bench dispatch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attention", nargs="+",
                        default=["reference", "cpu", "triton"],
                        help="backends to count (execution.attention names)")
    parser.add_argument("--bf16", action="store_true",
                        help="count under bf16 autocast with float32 parameters, as the "
                        "trainer runs (default: float32)")
    parser.add_argument("--top", type=int, default=8, help="operators listed per backend")
    parser.add_argument("--documents", action="store_true",
                        help=f"also count the step with a document mask (spec §7; documents "
                        f"of {DOCUMENT_LENGTH} tokens)")
    args = parser.parse_args(argv)
    print(f"standard arm: {standard_per_layer(bf16=args.bf16):.0f} launches per layer (whole sequence)")
    for attention in args.attention:
        kernels = "triton" if attention == "triton" else "torch"
        for documents in (False, True) if args.documents else (False,):
            result = per_cell(attention, elementwise_kernels=kernels, documents=documents,
                              bf16=args.bf16)
            marginal = sorted(result["ops_per_cell"].items(), key=lambda kv: -kv[1])
            top = ", ".join(f"{op} {n:g}" for op, n in marginal[:args.top] if n)
            masked = " masked" if documents else ""
            precision = "bf16 autocast" if args.bf16 else "float32"
            print(f"{attention:>10}{masked} ({precision}, elementwise kernels {kernels}): "
                  f"{result['per_cell']:.1f} per cell; step {result['step']}; "
                  f"Triton launches {result['launches'] or 0}; per cell: {top}")


if __name__ == "__main__":
    main()
