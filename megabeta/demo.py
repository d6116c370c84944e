"""`make demo`: every stage of megabeta on this machine, from raw text to generated text.

1. corpus    Python's standard-library sources (present on every machine), one document per file
2. tokenizer a sentencepiece BPE model trained by `megabeta-data train-tokenizer`
3. dataset   `megabeta-data tokenize` with 2 workers into an indexed .bin/.idx dataset
4. train     `torchrun --nproc_per_node=2 -m megabeta.train` with FSDP2 (the shipped demo.toml)
5. evaluate  `megabeta eval` on the held-out documents
6. generate  `megabeta generate` continues a prompt with the KV cache

Every stage is the real command a user would run; this script only chains them and reports. It
needs only an installed megabeta (editable or not): everything is written under --workdir, relative
to the working directory, and the config is the shipped configs/demo.toml.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from megabeta.config import shipped_config


def build_corpus(out: Path, max_files: int) -> tuple[int, int]:
    """The standard library's .py files as a JSONL corpus. Returns (documents, bytes)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)[:max_files]
    size = 0
    with open(out, "w", encoding="utf-8") as f:
        for path in files:
            text = path.read_text(encoding="utf-8", errors="replace")
            size += len(text.encode())
            f.write(json.dumps({"text": text, "path": str(path.relative_to(stdlib))}) + "\n")
    return len(files), size


def run(cmd: list[str], title: str, env: dict | None = None) -> str:
    print(f"\n== {title}\n$ {shlex.join(cmd)}", flush=True)
    start = time.time()
    lines = []
    with subprocess.Popen(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          env=env) as proc:
        for line in proc.stdout:  # streamed: training takes minutes
            print(line, end="", flush=True)
            lines.append(line)
    if proc.returncode != 0:
        sys.exit(f"demo: `{title}` failed with exit code {proc.returncode}")
    print(f"   ({time.time() - start:.0f} s)")
    return "".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megabeta.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="runs/demo",
                        help="where everything goes (relative to the working directory)")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps (default: the shipped demo.toml's)")
    parser.add_argument("--max-files", type=int, default=600, help="stdlib files in the corpus")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model and a few steps: every stage in about a minute (CI)")
    args = parser.parse_args(argv)

    config = shipped_config("demo.toml")
    if config is None:
        sys.exit("demo: the shipped config demo.toml is missing from this installation of megabeta")
    work = Path(args.workdir).resolve()
    data_dir, run_dir = work / "data", work / "run"
    data_dir.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    overrides = []
    if args.quick:
        args.max_files, args.vocab_size = min(args.max_files, 60), min(args.vocab_size, 1024)
        overrides = ["--model.d_model=64", "--model.hidden_dim=128", "--model.num_layers=2",
                     "--data.seq_len=128", "--model.max_seq_len=128", "--checkpoint.interval=10",
                     "--eval.interval=10", "--eval.batches=2", "--logging.interval=5"]
        args.steps = args.steps or 20
    if args.steps:
        overrides.append(f"--train.steps={args.steps}")

    documents, size = build_corpus(data_dir / "stdlib.jsonl", args.max_files)
    print(f"== corpus: {documents} standard-library files, {size / 1e6:.1f} MB "
          f"-> {data_dir / 'stdlib.jsonl'}")
    run([py, "-m", "data_tools", "train-tokenizer", "--inputs", str(data_dir / "stdlib.jsonl"),
         "--vocab-size", str(args.vocab_size), "--output", str(data_dir / "tok"),
         "--max-sentences", "200000", "--overwrite", "--quiet"], "train the tokenizer")
    run([py, "-m", "data_tools", "tokenize", "--tokenizer", str(data_dir / "tok.model"),
         "--inputs", str(data_dir / "stdlib.jsonl"), "--output-prefix", str(data_dir / "stdlib"),
         "--workers", "2", "--overwrite"], "tokenize with 2 workers")

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    train = [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
             "-m", "megabeta.train", "--config", str(config),
             f"--data.path={data_dir / 'stdlib'}", f"--data.tokenizer={data_dir / 'tok.model'}",
             f"--run_dir={run_dir}", "--resume=", *overrides]
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run(train, "train beta_1.2 on 2 CPU ranks with FSDP2", env=env)

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "split" not in r]
    checkpoint = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text()
    run([py, "-m", "megabeta.cli", "eval", f"--checkpoint={checkpoint}",
         f"--data.path={data_dir / 'stdlib'}", f"--seq-len={256 if not args.quick else 128}",
         "--val-fraction=0.02", "--batches=8"], "evaluate the checkpoint on held-out files")
    generated = run([py, "-m", "megabeta.cli", "generate", f"--checkpoint={checkpoint}",
                     "--prompt=import os\n\n\ndef ", "--max-new-tokens=80", "--temperature=0.7",
                     "--top-k=40", "--seed=0"], "generate a continuation with the KV cache")

    first, last = steps[0]["loss"], steps[-1]["loss"]
    print("\n== summary")
    print(f"loss: step {steps[0]['step']} {first:.3f} -> step {steps[-1]['step']} {last:.3f} "
          f"({'falls' if last < first else 'DID NOT FALL'})")
    print(f"dataset:     {data_dir / 'stdlib'}.bin/.idx/.json (tokenizer {data_dir / 'tok.model'})")
    print(f"run:         {run_dir} (config.toml, metrics.jsonl)")
    print(f"checkpoint:  {checkpoint}")
    print(f"tensorboard: tensorboard --logdir {run_dir / 'tb'}")
    if last >= first:
        sys.exit("demo: the loss did not fall")
    return 0 if generated else 1


if __name__ == "__main__":
    sys.exit(main())
