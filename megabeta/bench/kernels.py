"""Every Triton kernel the project launches, compiled for NVIDIA GPUs on a machine without one.

    python -m megabeta.bench kernels                # or: megabeta bench kernels [--arch 90]

A kernel that runs under Triton's CPU interpreter may still not compile (the interpreter does
not type-check like the compiler), and only the compiler says how many registers a kernel
takes, whether it spills to local memory and how much shared memory it needs. So this runs a
training step (forward and backward) of the model itself, on CPU, in each variant the presets
and execution settings reach, with `execution.attention = triton` and
`execution.elementwise_kernels = triton`; each launch the model's own code makes is compiled for the
target instead of run (`megabeta.kernels.compile_target`), so the variants cannot drift from
what runs on a GPU.

Variants: every beta_1.2 preset's shapes (head widths 64 and 200) and the standard arm's; the
block and the wavefront schedule; float32, bfloat16 and float16 (autocast over float32
parameters, as the trainer runs them, and bfloat16 parameters, as FSDP's param_dtype runs them);
and, at bfloat16, without the self slot, with grouped-query attention and with a deep-token
window; and each of those again with a document mask (spec §7: the attention kernels' masked
variants, HAS_DOCS=True), all of them or, with `--masked subset`, a representative few (both
head widths, float32 and bfloat16, both schedules, the standard arm). One row per distinct
compiled kernel and target: registers, spill stores / loads (bytes
per thread), stack, shared memory, warps, stages, the MMA instructions in the PTX, and how many
variants reached it. The command exits with status 1 on a compile error or a resource beyond
the target's limits (`compile_target.LIMITS`).

Run it in a process without `TRITON_INTERPRET=1` (the interpreter's kernels do not compile).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megabeta.kernels.ops import RunImplementations
from megabeta.model import ExecutionConfig, build_model, get_preset
from megabeta.model.config import ModelConfig

DTYPES = {"float32": (torch.float32, None), "bfloat16": (torch.float32, torch.bfloat16),
          "float16": (torch.float32, torch.float16),
          "bfloat16-params": (torch.bfloat16, None)}
"""Mode: (parameter dtype, autocast dtype)."""


@dataclass(frozen=True)
class Variant:
    """One training step to compile: a preset, its overrides, a dtype mode and a schedule."""

    preset: str
    dtype: str
    schedule: str
    overrides: dict[str, Any] = field(default_factory=dict)
    batch: int = 1
    blocks: int = 2
    """Sequence length in blocks: the second reads history, and its waves have several cells
    (all the kernels' geometry is runtime arguments: longer sequences compile nothing new)."""
    documents: bool = False
    """A document mask (spec §7): the step runs with `documents=` ids."""

    @property
    def label(self) -> str:
        extra = " ".join(f"{key}={value}" for key, value in self.overrides.items())
        return " ".join(filter(None, [self.preset, self.dtype, self.schedule, f"B={self.batch}",
                                      extra, "documents" if self.documents else ""]))

    def config(self) -> ModelConfig:
        """The preset with the overrides; a small vocabulary (the LM head is no Triton kernel)
        and at most depth window + 2 layers: every layer count of source groups (1 to k + 1)
        still occurs, and the layer count only enters the kernels as runtime arguments and
        strides, so deeper stacks compile nothing new (they only take longer to trace)."""
        preset = get_preset(self.preset)
        layers = min(preset.num_layers, preset.depth_window + 2)
        return get_preset(self.preset, vocab_size=256, num_layers=layers, **self.overrides)


def variants(masked: str = "all") -> list[Variant]:
    """The variants the presets and execution settings reach (module doc), with the masked
    twins of `masked` ("all", "subset" or "none") of them."""
    shapes = [("t19_flash", 1), ("beta_1.2_test", 2), ("beta_1.2_c256", 2),
              ("beta_1.2_stride2", 2), ("t16_std_tf_rope", 2)]
    out = [Variant(preset, dtype, schedule, batch=batch)
           for preset, batch in shapes for dtype in DTYPES
           for schedule in (("block", "wavefront") if get_preset(preset).arch == "beta12"
                            else ("block",))]
    window = {"deep_token_window": 64}
    for overrides in ({"self_slot": False}, {"num_kv_heads": 2}, window):
        for schedule in ("block", "wavefront"):
            out.append(Variant("t19_flash", "bfloat16", schedule, overrides))
    out.append(Variant("beta_1.2_test", "bfloat16", "block", {"num_kv_heads": 1}, batch=2))
    out.append(Variant("t19_flash", "float32", "block", {"num_kv_heads": 2}))
    twins = [replace(v, documents=True) for v in out]
    if masked == "subset":
        twins = [v for v in twins if not v.overrides and v.dtype in ("float32", "bfloat16")
                 and v.preset in ("t19_flash", "beta_1.2_test", "t16_std_tf_rope")
                 and (v.schedule == "block" or v.dtype == "bfloat16")]
    return out + (twins if masked != "none" else [])


def run_step(variant: Variant) -> None:
    """One forward and backward of `variant`'s model, on fake CPU tensors (no arithmetic; CPU
    autocast as on a GPU), each megabeta custom op run as its implementation so that its
    Triton launches reach the active launch observer."""
    config = variant.config()
    wavefront = variant.schedule == "wavefront"
    execution = ExecutionConfig(attention="triton", elementwise_kernels="triton",
                                schedule=variant.schedule,
                                activation_checkpoint="wave" if wavefront else "block")
    params, autocast = DTYPES[variant.dtype]
    amp = (torch.autocast("cpu", dtype=autocast) if autocast is not None
           else contextlib.nullcontext())
    with FakeTensorMode(), RunImplementations(), _default_dtype(params):
        model = build_model(config, execution)
        tokens = torch.randint(0, config.vocab_size,
                               (variant.batch, variant.blocks * config.block_size))
        # Document ids: their values do not matter here (fake tensors), only that there are.
        documents = dict(documents=torch.zeros_like(tokens)) if variant.documents else {}
        with amp:
            loss = model(tokens, tokens, **documents)
        loss.backward()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters created in `dtype` (a fake model cannot be converted with `.to`)."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def compile_all(archs: list[int], labels: list[str]) -> list[Any]:
    """`KernelBuild`s of every kernel the variants `labels` launch, compiled for each of
    `archs`."""
    from megabeta.kernels.compile_target import CompileForTarget

    chosen = {v.label: v for v in variants("all")}
    builds = []
    for arch in archs:
        with CompileForTarget(arch) as target:
            for label in labels:
                target.variant = label
                run_step(chosen[label])
        builds += target.builds
    return builds


def compile_parallel(archs: list[int], chosen: list[Variant], jobs: int) -> list[Any]:
    """`compile_all` over `jobs` processes, each given whole dtype modes (the modes share few
    kernels), the modes dealt out to balance the variants; builds of one kernel from several
    processes merged into the first."""
    modes = sorted(DTYPES, key=lambda mode: -sum(v.dtype == mode for v in chosen))
    shares: list[list[str]] = [[] for _ in range(min(jobs, len(modes)))]
    for mode in modes:
        min(shares, key=len).extend(v.label for v in chosen if v.dtype == mode)
    shares = [share for share in shares if share]
    if len(shares) == 1:
        return compile_all(archs, shares[0])
    # Spawned workers: a fork would inherit this process's torch threads and Triton state.
    context = multiprocessing.get_context("spawn")
    seen: dict[tuple[int, str], Any] = {}
    with concurrent.futures.ProcessPoolExecutor(len(shares), mp_context=context) as pool:
        for builds in pool.map(compile_all, [archs] * len(shares), shares):
            for build in builds:
                first = seen.setdefault((build.arch, build.key), build)
                if first is not build:
                    first.variants += [v for v in build.variants if v not in first.variants]
    return sorted(seen.values(), key=lambda build: build.arch)


HEADER = (f"{'arch':<6} {'kernel':<28} {'params':<58} {'var':>3} {'regs':>4} {'spill st/ld':>11} "
          f"{'stack':>5} {'shared':>7} {'warps':>5} {'stages':>6} {'mma':<8} {'s':>5}")


def _row(build: Any) -> str:
    if build.error is not None:
        return f"sm_{build.arch:<3} {build.kernel:<28} {build.params:<58} ERROR {build.error}"
    limit = build.limit_error()
    line = (f"sm_{build.arch:<3} {build.kernel:<28} {build.params:<58} {len(build.variants):>3} "
            f"{build.registers:>4} {f'{build.spill_stores}/{build.spill_loads}':>11} "
            f"{build.stack:>5} {build.shared:>7} {build.num_warps:>5} {build.num_stages:>6} "
            f"{build.mma:<8} {build.seconds:>5.1f}")
    return line + (f"  OVER LIMIT: {limit}" if limit else "")


def summary(builds: list[Any], archs: list[int]) -> tuple[str, bool]:
    """The last line, and whether everything compiled within the limits."""
    errors = sum(1 for b in builds if b.error is not None or b.limit_error() is not None)
    spilling = [b for b in builds if b.error is None and b.spill]
    largest = max((max(b.spill_stores, b.spill_loads) for b in spilling), default=0)
    compiled = sum(1 for b in builds if b.error is None)
    targets = ", ".join(f"sm_{a}" for a in archs)
    return (f"kernels: {compiled} compiled for {targets}; {errors} errors; {len(spilling)} "
            f"spilling (largest spill {largest} bytes)", errors == 0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="megabeta bench kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="80,90",
                        help="comma-separated NVIDIA architectures to compile for (80: A100, "
                             "90: H100/H200); default 80,90")
    parser.add_argument("--only", default="",
                        help="compile only the variants whose label contains this text (e.g. "
                             "t19_flash, bfloat16, wavefront)")
    parser.add_argument("--json", default="", metavar="PATH",
                        help="also write every build (with the variants that reached it) as "
                             "JSON to PATH")
    parser.add_argument("--masked", choices=("all", "subset", "none"), default="all",
                        help="document-masked variants (spec §7) to compile: all, a "
                             "representative subset, or none (default all)")
    parser.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 4),
                        help="compiling processes (default: the cores, at most 4)")
    parser.add_argument("--variants", action="store_true",
                        help="list each row's variants under it")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("TRITON_INTERPRET=1 is set: the interpreter's kernels do not compile; run "
                     "without it")
    try:
        archs = [int(a.strip().removeprefix("sm_")) for a in args.arch.split(",") if a.strip()]
    except ValueError:
        parser.error(f"--arch {args.arch!r}: give architecture numbers such as 80,90")
    from megabeta.kernels.compile_target import LIMITS

    unknown = [a for a in archs if a not in LIMITS]
    if unknown or not archs:
        parser.error(f"--arch {args.arch!r}: choose from {', '.join(map(str, LIMITS))}")
    chosen = [v for v in variants(args.masked) if args.only in v.label]
    if not chosen:
        parser.error(f"--only {args.only!r} matches no variant")
    print(f"{len(chosen)} variants; triton {_triton_version()}, torch {torch.__version__}",
          flush=True)
    print(HEADER, flush=True)
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: give at least 1")
    builds = list(compile_parallel(archs, chosen, args.jobs))
    for build in builds:
        print(_row(build))
        if args.variants:
            for label in build.variants:
                print(f"{'':>8}{label}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(b) for b in builds], f, indent=1)
    line, ok = summary(builds, archs)
    print(line)
    if not ok:
        sys.exit(1)


def _triton_version() -> str:
    import triton

    return triton.__version__


if __name__ == "__main__":
    main()
