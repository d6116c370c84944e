"""Model benchmark: beta_1.2 against the standard arm on the same shape, in one run.

    python -m megabeta.bench model            # or: megabeta bench model

Measures forward+backward seconds per batch and analytic FLOP throughput for the standard arm and
beta_1.2 at c = 32, 256 and T; prefill ms/token at a long context and decode ms/token; peak
memory; and a t19_flash-shaped forward+backward at 16384 tokens with block checkpointing. Every
figure is also printed as a ratio to the standard arm measured in the same run.

Every measurement runs in a subprocess of its own (peak resident memory is per process, and
arms sharing a process disturb each other's allocator). The training arms run in turn, round
after round, and each reports its median over rounds: a shared machine drifts by tens of
percent over minutes, and interleaving puts the same drift into every arm.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import torch

from megabeta.model import ExecutionConfig, build_model, get_preset
from megabeta.model.flops import training_flops

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TRAIN_WARMUP = 3
"""Untimed training steps per process before the timed ones (`--warmup`): the first steps of a
fresh process are slower while the allocator settles (README, "Measured figures")."""


def timed(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int) -> float:
    """Median seconds of `repeats` calls, after `warmup` untimed calls when `repeats` > 1."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup if repeats > 1 else 0):
        fn()
        sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _setup(case: dict[str, Any]) -> tuple[Any, torch.nn.Module, torch.Tensor]:
    device = torch.device(case["device"])
    torch.manual_seed(0)
    config = get_preset(case["preset"], vocab_size=case["vocab"], **case.get("overrides", {}))
    execution = ExecutionConfig(**case.get("execution", {}))
    model = build_model(config, execution).to(device=device, dtype=DTYPES[case["dtype"]])
    tokens = torch.randint(0, config.vocab_size, (case["batch"], case["length"] + 1),
                           device=device)
    return config, model, tokens


def _train_step(model: torch.nn.Module, tokens: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    return step


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """Run one measurement in this process; returns the figures as a dict."""
    device = torch.device(case["device"])
    config, model, tokens = _setup(case)
    batch, length = case["batch"], case["length"]
    out: dict[str, Any] = {}
    if case["kind"] == "train":
        seconds = timed(_train_step(model, tokens), device, case["repeats"],
                         case.get("warmup", TRAIN_WARMUP))
        flops = batch * training_flops(config, length)
        out.update(seconds=seconds, flops=flops, flops_per_s=flops / seconds)
    else:
        model.eval()
        prompt = tokens[:, :length]
        capacity = length + case["decode_tokens"] + 1
        # One untimed prefill and decode step each: no optimizer state or gradients to settle.
        seconds = timed(lambda: model.prefill(prompt, capacity), device, case["repeats"], 1)
        _, cache = model.prefill(prompt, capacity)
        step_tokens = tokens[:, -1]
        decode = timed(lambda: model.step(step_tokens, cache), device, case["decode_tokens"], 1)
        out.update(prefill_ms_per_token=seconds * 1e3 / (batch * length),
                   decode_ms_per_token=decode * 1e3 / batch)
    out["peak_mib"] = peak_mib(device)
    return out


def _in_subprocess(case: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "megabeta.bench.model", "--case", json.dumps(case)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if done.returncode != 0:
        raise RuntimeError(f"benchmark case {case['name']} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x"


def _verdict(ok: bool) -> str:
    return "meets target" if ok else "MISSES target"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="megabeta bench model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="beta_1.2_test",
                        help="beta arm whose shape is measured (default: %(default)s)")
    parser.add_argument("--control", default="t16_std_tf_rope",
                        help="standard arm of the same shape (default: %(default)s)")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
    parser.add_argument("--batch", type=int, default=4, help="training batch (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=1024, help="training sequence length")
    parser.add_argument("--blocks", default="32,256", help="block sizes besides c = T")
    parser.add_argument("--prefill-len", type=int, default=8192, help="prefill context")
    parser.add_argument("--decode-tokens", type=int, default=32, help="decode steps timed")
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed steps per process (median, after the warm-up steps)")
    parser.add_argument("--warmup", type=int, default=TRAIN_WARMUP,
                        help="untimed training steps per process before the timed ones "
                             "(default: %(default)s; the first steps of a fresh process run "
                             "slower while the allocator and caches settle)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of the training arms, run in turn (median over rounds)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--checkpoint", choices=["none", "block"], default="none",
                        help="activation checkpointing of every arm in the training case (the "
                             "t19_flash memory case always uses block)")
    parser.add_argument("--attention", default="auto",
                        help="execution.attention of every arm (default: %(default)s)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--skip-t19", action="store_true",
                        help="skip the t19_flash 16K-token memory case (minutes on a CPU)")
    parser.add_argument("--t19-len", type=int, default=16384, help="t19_flash sequence length")
    parser.add_argument("--json", help="also write all figures to this JSON file")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))))
        return

    common = dict(device=args.device, dtype=args.dtype, vocab=args.vocab, repeats=args.repeats,
                  execution=dict(attention=args.attention))
    arms = [("standard", args.control, {})]
    arms += [(f"beta c={c}", args.preset, dict(block_size=int(c))) for c in args.blocks.split(",")]
    arms.append((f"beta c=T={args.seq_len}", args.preset, dict(block_size=args.seq_len)))
    print(f"# model benchmark: {args.preset} vs {args.control}, device {args.device}, "
          f"{args.dtype}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    results: dict[str, Any] = {}

    print(f"\n## forward+backward, batch {args.batch} x {args.seq_len} tokens, "
          f"activation_checkpoint={args.checkpoint}")
    print(f"(median of {args.rounds} rounds, each arm in turn in a fresh process timing the "
          f"median of {args.repeats} steps after {args.warmup} warm-up steps)")
    print("| arm | s/batch | vs standard | GFLOP/batch | GFLOP/s | FLOP/s vs standard | peak MiB |")
    print("|---|---|---|---|---|---|---|")
    cases = [dict(common, name=name, kind="train", preset=preset, batch=args.batch,
                  length=args.seq_len, warmup=args.warmup,
                  overrides=dict(over, max_seq_len=args.seq_len),
                  execution=dict(common["execution"], activation_checkpoint=args.checkpoint))
             for name, preset, over in arms]
    rounds = [[_in_subprocess(case) for case in cases] for _ in range(args.rounds)]
    for i, case in enumerate(cases):
        runs = [r[i] for r in rounds]
        seconds = statistics.median(r["seconds"] for r in runs)
        res = dict(runs[0], seconds=seconds, flops_per_s=runs[0]["flops"] / seconds,
                   peak_mib=max(r["peak_mib"] for r in runs),
                   all_seconds=[r["seconds"] for r in runs])
        results[f"train {case['name']}"] = res
        base = results["train standard"]
        print(f"| {case['name']} | {res['seconds']:.3f} | "
              f"{_ratio(res['seconds'], base['seconds'])} | {res['flops'] / 1e9:.1f} | "
              f"{res['flops_per_s'] / 1e9:.1f} | "
              f"{_ratio(res['flops_per_s'], base['flops_per_s'])} | {res['peak_mib']:.0f} |")

    print(f"\n## prefill at {args.prefill_len} tokens, then {args.decode_tokens} decode steps "
          "(batch 1)")
    print("| arm | prefill ms/token | vs standard | decode ms/token | vs standard | peak MiB |")
    print("|---|---|---|---|---|---|")
    for name, preset, over in arms[:-1]:
        over = dict(over, max_seq_len=args.prefill_len + args.decode_tokens + 2)
        res = _in_subprocess(dict(common, name=name, kind="prefill", preset=preset,
                                  overrides=over, batch=1, length=args.prefill_len,
                                  decode_tokens=args.decode_tokens))
        results[f"prefill {name}"] = res
        base = results["prefill standard"]
        print(f"| {name} | {res['prefill_ms_per_token']:.3f} | "
              f"{_ratio(res['prefill_ms_per_token'], base['prefill_ms_per_token'])} | "
              f"{res['decode_ms_per_token']:.2f} | "
              f"{_ratio(res['decode_ms_per_token'], base['decode_ms_per_token'])} | "
              f"{res['peak_mib']:.0f} |")

    train = {k.removeprefix("train "): v for k, v in results.items() if k.startswith("train")}
    base = train["standard"]
    print("\n## targets")
    full = train[f"beta c=T={args.seq_len}"]["seconds"] / base["seconds"]
    print(f"- c = T time within 1.05x of standard: {full:.3f}x, {_verdict(full <= 1.05)}")
    for c, floor in (("256", 0.9), ("32", 0.7)):
        if f"beta c={c}" in train:
            r = train[f"beta c={c}"]["flops_per_s"] / base["flops_per_s"]
            print(f"- FLOP/s at c = {c} >= {floor}x standard: {r:.2f}x, {_verdict(r >= floor)}")

    if not args.skip_t19:
        res = _in_subprocess(dict(common, name="t19_flash", kind="train", preset="t19_flash",
                                  vocab=55000, repeats=1, batch=1, length=args.t19_len,
                                  overrides=dict(max_seq_len=args.t19_len),
                                  execution=dict(common["execution"],
                                                 activation_checkpoint="block")))
        results["train t19_flash"] = res
        gib = res["peak_mib"] / 1024
        print(f"- t19_flash fwd+bwd at {args.t19_len} tokens (batch 1, {args.dtype}, block "
              f"checkpointing, vocab 55000): {res['seconds']:.1f} s, peak {gib:.2f} GiB, "
              f"{_verdict(gib < 8)} (< 8 GiB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
