"""Export and reload of a model as a Hugging Face folder: time and memory.

    python -m megabeta.bench hf [--config t19_flash] [--vocab 32000] [--seq-len 256]

Builds the model of `--config` (random weights, `--vocab` tokens, max_seq_len `--seq-len`) and
saves it as a megabeta export with a small sentencepiece tokenizer, the source; then, each in a
process of its own (so that its peak memory is its own): loading the source alone (what any
export holds before it writes), `megabeta export --format hf` of the source, `load_model` of the
folder (megabeta), and, where transformers is installed,
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` and one forward compared
with megabeta's. Prints seconds and peak resident memory, the latter as the process's baseline
(after its imports) plus a multiple of the weights' size.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = ("source", "export", "load", "transformers")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _phase(name: str, work: Path) -> dict:
    """One phase, in this (child) process: seconds, baseline and peak resident bytes."""
    import torch

    from megabeta.checkpoint.export import export_hf, load_model

    baseline = _rss_bytes()
    start = time.perf_counter()
    result: dict = {}
    if name == "source":  # what the export needs before it writes anything
        load_model(work / "source.safetensors")
    elif name == "export":
        export_hf(work / "source.safetensors", work / "hf")
    elif name == "load":
        load_model(work / "hf")
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(work / "hf", trust_remote_code=True)
        result["seconds_load"] = time.perf_counter() - start
        tokens = torch.randint(0, model.config.vocab_size, (1, 96),
                               generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            got = model(tokens).logits
        del model
        with torch.no_grad():
            want = load_model(work / "hf")(tokens)
        result["max_difference"] = float((got - want).abs().max())
    result.update(seconds=time.perf_counter() - start, baseline=baseline, peak=_peak_bytes())
    return result


def _source(config_name: str, vocab: int, seq_len: int, work: Path) -> int:
    """Write the source export and its tokenizer under `work`; returns the weights' bytes."""
    import torch
    from safetensors.torch import save_file

    from data_tools.cli import main as data_main
    from megabeta.checkpoint.export import EXPORT_FORMAT
    from megabeta.config import load_config
    from megabeta.data import file_sha256
    from megabeta.model import build_model

    words = "alpha beta gamma delta model token layer block depth train value".split()
    corpus = work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(words[(i * 7 + k) % len(words)]
                                                            for k in range(40))}) + "\n"
                              for i in range(400)))
    assert data_main(["train-tokenizer", "--inputs", str(corpus), "--vocab-size", "300",
                      "--output", str(work / "tok"), "--quiet"]) == 0
    tokenizer = work / "tok.model"
    config = load_config(config_name, [f"--model.vocab_size={vocab}",
                                       f"--model.max_seq_len={seq_len}",
                                       f"--data.seq_len={seq_len}"])
    model = build_model(config.model)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(work / "source.safetensors"), metadata={
        "format": EXPORT_FORMAT, "model_config": json.dumps(model.config.__dict__),
        "tokenizer": json.dumps({"path": str(tokenizer), "sha256": file_sha256(tokenizer)})})
    return sum(t.numel() * t.element_size() for t in state.values())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="megabeta bench hf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="t19_flash",
                        help="model: a shipped config name or a TOML file (default t19_flash)")
    parser.add_argument("--vocab", type=int, default=32000,
                        help="vocabulary size (default 32000)")
    parser.add_argument("--seq-len", type=int, default=256,
                        help="the model's max_seq_len (default 256: a short context)")
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phase:  # a child: one phase, its result as JSON
        print(json.dumps(_phase(args.phase, Path(args.work))))
        return
    with tempfile.TemporaryDirectory(prefix="megabeta-bench-hf-") as scratch:
        work = Path(scratch)
        weights = _source(args.config, args.vocab, args.seq_len, work)
        print(f"# {args.config} (vocab {args.vocab}, max_seq_len {args.seq_len}), random "
              f"weights: {weights / 4 / 1e6:.1f} M parameters, {weights / 2**20:.0f} MiB "
              "float32")
        print("| phase | s | peak RSS | = baseline + x weights |\n|---|---|---|---|")
        for phase in PHASES:
            done = subprocess.run([sys.executable, "-m", "megabeta.bench", "hf", "--phase",
                                   phase, "--work", str(work)], capture_output=True, text=True)
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["?"])[-1]
                print(f"| {phase} | failed: {last} | | |")
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            extra = (r["peak"] - r["baseline"]) / weights
            label = {"source": "load the source (megabeta load_model)",
                     "export": "megabeta export --format hf",
                     "load": "megabeta load_model(DIR)",
                     "transformers": "transformers from_pretrained + forward"}[phase]
            print(f"| {label} | {r['seconds']:.2f} | {r['peak'] / 2**20:.0f} MiB | "
                  f"{r['baseline'] / 2**20:.0f} MiB + {extra:.2f} x |")
            if phase == "transformers":
                print(f"\nfrom_pretrained alone: {r['seconds_load']:.2f} s; logits of 96 "
                      f"tokens, max |transformers - megabeta| = {r['max_difference']:.2e}")
        folder = sum(f.stat().st_size for f in (work / "hf").iterdir())
        print(f"folder: {folder / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
