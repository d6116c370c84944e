"""Data benchmark: tokenization throughput and memory, and loader throughput, in one run.

    python -m megabeta.bench data          # or: python -m megabeta.bench.data

1. Tokenization throughput: ``megabeta-data tokenize`` (a subprocess, timed wall clock including
   its start-up) with 1 and 2 workers, against a plain single-process ``sentencepiece`` encode
   loop over the same document texts already in memory (so the baseline pays no start-up,
   reading, JSON parsing or writing: the strictest reading of the target), and, for a
   like-for-like view, against the same loop as a script that starts Python and reads the JSONL.
   MB/s counts the UTF-8 bytes of the document texts for all. Target: 2 workers >= 1.7x the
   plain loop.
   The same for a Hugging Face ``tokenizer.json`` (a byte-level BPE of the same vocabulary size
   trained by ``train-tokenizer --kind bpe``): ``megabeta-data tokenize`` (threads of
   ``tokenizers``, no processes) against ``tokenizers``' own ``encode_batch`` over the texts in
   memory, on the same cores, and, with ``--megatron CHECKOUT``, against Megatron-LM's
   ``tools/preprocess_data.py`` with the same file (``HuggingFaceTokenizer``, ``--workers`` = the
   CPUs). Rounds alternate the runs, so each round's ratios are paired. Targets: >= 0.9x
   ``encode_batch``, >= 1.2x Megatron.
2. Peak resident memory of tokenize (the whole process tree) for a corpus and for one ``--scale``
   times larger. Target: the larger raises peak memory by less than 10 %.
3. Loader throughput: tokens/s of ``StatefulLoader`` batches (``[B, seq_len + 1]`` int64) over the
   tokenized corpus, against an upper bound of what a t19_flash training step consumes per second
   on this CPU: measured fp32 matmul peak FLOP/s / (6 * 0.19e9 FLOP per token). A real step runs
   below peak and also spends FLOPs on attention, so it consumes fewer tokens/s than this bound;
   clearing 100x the bound clears 100x the real consumption. Target: >= 100x.

The corpus is synthetic (seeded): prose-like lines from a Zipf-distributed vocabulary and
code-like indented lines, written as JSONL.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import sentencepiece as spm
import torch

from megabeta.data import StatefulLoader, build_train_val

T19_FLASH_PARAMETERS = 0.19e9
FLOPS_PER_PARAMETER_TOKEN = 6  # forward 2 + backward 4, per parameter per token
_CODE_WORDS = ("def", "return", "self", "import", "class", "for", "in", "if", "else", "while",
               "=", "==", "+", "(", ")", ":", "[", "]", "None", "True", "x", "y", "i", "value")


def write_corpus(path: Path, target_bytes: int, seed: int) -> int:
    """Write synthetic JSONL documents totalling about ``target_bytes``; returns the text bytes."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    vocabulary = ["".join(rng.choice(letters, size=rng.integers(2, 10))) for _ in range(20000)]
    zipf = 1.0 / np.arange(1, len(vocabulary) + 1)
    zipf /= zipf.sum()
    written = text_bytes = 0
    with open(path, "w", encoding="utf-8") as stream:
        while written < target_bytes:
            lines = []
            for _ in range(int(rng.integers(3, 40))):
                if rng.random() < 0.3:
                    words = rng.choice(_CODE_WORDS, size=int(rng.integers(2, 12)))
                    lines.append("    " * int(rng.integers(0, 4)) + " ".join(words))
                else:
                    picks = rng.choice(len(vocabulary), size=int(rng.integers(4, 30)), p=zipf)
                    lines.append(" ".join(vocabulary[i] for i in picks) + ".")
            text = "\n".join(lines)
            line = json.dumps({"text": text}) + "\n"
            stream.write(line)
            written += len(line)
            text_bytes += len(text.encode("utf-8"))
    return text_bytes


def peak_tree_rss(command: list[str]) -> float:
    """Run ``command``; returns the peak summed RSS in MiB of it and its children."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    watched = psutil.Process(process.pid)
    peak = 0
    done = threading.Event()

    def poll() -> None:
        nonlocal peak
        while not done.is_set():
            try:
                tree = [watched, *watched.children(recursive=True)]
                peak = max(peak, sum(p.memory_info().rss for p in tree))
            except psutil.Error:
                pass
            time.sleep(0.01)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    _, errors = process.communicate()
    done.set()
    poller.join()
    _check_exit(command, process.returncode, errors)
    return peak / 2**20


def wall_seconds(command: list[str], env: dict[str, str] | None = None) -> float:
    """Run ``command``; returns its wall seconds from start to exit, with nothing else running in
    this process meanwhile (polling RSS every 10 ms costs ~6 % of a core, which a run that keeps
    both cores busy would pay and the in-memory baseline would not)."""
    started = time.perf_counter()
    finished = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    seconds = time.perf_counter() - started
    _check_exit(command, finished.returncode, finished.stderr)
    return seconds


def _check_exit(command: list[str], returncode: int, errors: bytes) -> None:
    if returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{errors.decode()}")


def data_tools(*arguments: str) -> list[str]:
    return [sys.executable, "-m", "data_tools", *arguments]


def plain_loop_seconds(model: Path, corpus: Path) -> float:
    """Seconds of a plain single-process encode loop over the corpus's document texts."""
    processor = spm.SentencePieceProcessor(model_file=str(model))
    with open(corpus, encoding="utf-8") as stream:
        texts = [json.loads(line)["text"] for line in stream]
    started = time.perf_counter()
    for text in texts:
        processor.encode(text)
    return time.perf_counter() - started


def matmul_peak(dtype: torch.dtype) -> float:
    """FLOP/s of a 2048³ matmul in ``dtype`` on this CPU (best of several)."""
    size = 2048
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    times = []
    for _ in range(5):
        started = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - started)
    return 2 * size**3 / min(times)


def loader_tokens_per_second(prefix: Path, seq_len: int, batch_size: int, workers: int,
                             seconds: float) -> float:
    data = build_train_val([prefix], seq_len=seq_len)
    sampler = data.train_sampler(world_size=1, rank=0, seed=0)
    loader = StatefulLoader(data.train, sampler, batch_size, num_workers=workers)
    batches = iter(loader)
    next(batches)  # start-up (workers, first page faults) is not throughput
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        next(batches)
        count += 1
    elapsed = time.perf_counter() - started
    return count * batch_size * seq_len / elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="megabeta bench data",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--mb", type=float, default=48.0,
                        help="corpus size for the throughput runs (MB of JSONL)")
    parser.add_argument("--memory-mb", type=float, default=16.0,
                        help="base corpus size for the memory runs (MB of JSONL)")
    parser.add_argument("--scale", type=int, default=10,
                        help="the larger memory corpus, in base corpora")
    parser.add_argument("--vocab-size", type=int, default=8000, help="tokenizer vocabulary")
    parser.add_argument("--seq-len", type=int, default=2048, help="loader sample length")
    parser.add_argument("--batch-size", type=int, default=8, help="loader batch size")
    parser.add_argument("--repeats", type=int, default=5,
                        help="rounds of throughput runs (the best of each is shown)")
    parser.add_argument("--loader-seconds", type=float, default=3.0,
                        help="seconds per loader measurement")
    parser.add_argument("--megatron", type=Path, default=None, metavar="CHECKOUT",
                        help="a Megatron-LM checkout: also time its tools/preprocess_data.py "
                             "with the tokenizer.json (needs transformers importable)")
    parser.add_argument("--only", choices=("all", "sentencepiece", "huggingface"), default="all",
                        help="which tokenizer's throughput to measure (memory and loader: all)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep corpora and datasets here instead of a temporary directory")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="megabeta-bench-data-") as scratch:
        work = args.workdir or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        load = os.getloadavg()[0]
        print(f"machine: {psutil.cpu_count()} CPUs, load average {load:.2f} at start"
              + (" -- other processes are busy, figures will be low" if load > 0.5 else ""))
        corpus = work / "throughput.jsonl"
        text_bytes = write_corpus(corpus, int(args.mb * 1e6), seed=0)
        model_prefix = work / "tok"
        subprocess.run(data_tools("train-tokenizer", "--inputs", str(corpus), "--vocab-size",
                                  str(args.vocab_size), "--output", str(model_prefix),
                                  "--max-sentences", "200000", "--overwrite", "--quiet"),
                       check=True)
        model = Path(f"{model_prefix}.model")
        print(f"corpus: {corpus.stat().st_size / 1e6:.1f} MB of JSONL, {text_bytes / 1e6:.1f} MB "
              f"of document text; vocabulary {args.vocab_size}")
        if args.only in ("all", "sentencepiece"):
            bench_tokenize_throughput(args, work, model, corpus, text_bytes)
        if args.only in ("all", "huggingface"):
            if importlib.util.find_spec("tokenizers") is None:
                print("\ntokenizer.json throughput: skipped, tokenizers is not installed: "
                      "pip install 'megabeta[hf]'")
            else:
                bench_huggingface_throughput(args, work, corpus, text_bytes)
        if args.only == "all":
            bench_tokenize_memory(args, work, model)
            bench_loader(args, work / "throughput-w1")


def tokenize_command(model: Path, inputs: list[Path], prefix: Path, workers: int) -> list[str]:
    """One ``megabeta-data tokenize`` run as a subprocess command."""
    return data_tools("tokenize", "--tokenizer", str(model), "--inputs", *map(str, inputs),
                      "--output-prefix", str(prefix), "--workers", str(workers), "--overwrite",
                      "--quiet")


# The same loop as a script a user would run: start Python, read the JSONL, encode every text.
_PLAIN_SCRIPT = """
import json, sys
import sentencepiece
processor = sentencepiece.SentencePieceProcessor(model_file=sys.argv[1])
with open(sys.argv[2], encoding="utf-8") as stream:
    for line in stream:
        processor.encode(json.loads(line)["text"])
"""


def bench_tokenize_throughput(args: argparse.Namespace, work: Path, model: Path, corpus: Path,
                              text_bytes: int) -> None:
    # Rounds of all runs, best of each: a busy moment (other processes on a shared machine)
    # slows whichever run it hits, and the minimum is the least disturbed one.
    times: dict[str, list[float]] = {"loop": [], "script": [], "w1": [], "w2": []}
    for _ in range(args.repeats):
        times["loop"].append(plain_loop_seconds(model, corpus))
        times["script"].append(wall_seconds([sys.executable, "-c", _PLAIN_SCRIPT, str(model),
                                             str(corpus)]))
        for workers in (1, 2):
            prefix = work / f"throughput-w{workers}"
            times[f"w{workers}"].append(wall_seconds(tokenize_command(model, [corpus], prefix,
                                                                      workers)))
    best = {name: min(values) for name, values in times.items()}
    mb = text_bytes / 1e6
    rows = [("plain sentencepiece encode loop, texts already in memory (the baseline)", "loop"),
            ("plain loop script: start Python, read and parse the JSONL, encode (wall clock)",
             "script"),
            ("megabeta-data tokenize --workers 1: file to dataset (wall clock)", "w1"),
            ("megabeta-data tokenize --workers 2: file to dataset (wall clock)", "w2")]
    print(f"\n## Tokenization throughput (MB/s of document text, best of {args.repeats})\n")
    print("| run | seconds | MB/s | vs baseline |\n|---|---:|---:|---:|")
    for label, name in rows:
        print(f"| {label} | {best[name]:.2f} | {mb / best[name]:.2f} | "
              f"{best['loop'] / best[name]:.2f}x |")
    ratio = best["loop"] / best["w2"]
    print(f"\ntarget: 2 workers >= 1.7x the plain loop: {'met' if ratio >= 1.7 else 'NOT met'} "
          f"({ratio:.2f}x the in-memory loop, {best['script'] / best['w2']:.2f}x the plain loop "
          "script)")


def encode_batch_seconds(tokenizer_json: Path, corpus: Path) -> float:
    """Seconds of ``tokenizers``' own ``encode_batch`` over the corpus's texts, in memory."""
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    with open(corpus, encoding="utf-8") as stream:
        texts = [json.loads(line)["text"] for line in stream]
    started = time.perf_counter()
    tokenizer.encode_batch(texts, add_special_tokens=False)
    return time.perf_counter() - started


def megatron_command(checkout: Path, tokenizer_dir: Path, corpus: Path, prefix: Path) -> list[str]:
    """Megatron-LM's preprocess_data.py on ``corpus`` with the tokenizer.json in
    ``tokenizer_dir`` (its HuggingFaceTokenizer loads it with transformers' AutoTokenizer)."""
    return [sys.executable, str(checkout / "tools" / "preprocess_data.py"), "--input", str(corpus),
            "--output-prefix", str(prefix), "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", str(tokenizer_dir), "--workers", str(psutil.cpu_count()),
            "--append-eod", "--log-interval", "1000000"]


def bench_huggingface_throughput(args: argparse.Namespace, work: Path, corpus: Path,
                                 text_bytes: int) -> None:
    prefix = work / "bpe"
    subprocess.run(data_tools("train-tokenizer", "--kind", "bpe", "--inputs", str(corpus),
                              "--vocab-size", str(args.vocab_size), "--output", str(prefix),
                              "--max-sentences", "200000", "--overwrite", "--quiet"), check=True)
    # transformers' AutoTokenizer (Megatron's loader) wants a directory naming the EOS.
    tokenizer_dir = work / "bpe-hf"
    tokenizer_dir.mkdir(exist_ok=True)
    tokenizer_json = tokenizer_dir / "tokenizer.json"
    tokenizer_json.write_bytes(Path(f"{prefix}.tokenizer.json").read_bytes())
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "pad_token": "<pad>"}))
    ours = data_tools("tokenize", "--tokenizer", str(tokenizer_json), "--inputs", str(corpus),
                      "--output-prefix", str(work / "hf-ours"), "--overwrite", "--quiet")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(args.megatron), os.environ.get("PYTHONPATH")])))
    times: dict[str, list[float]] = {"batch": [], "ours": [], "megatron": []}
    for _ in range(args.repeats):
        times["batch"].append(encode_batch_seconds(tokenizer_json, corpus))
        times["ours"].append(wall_seconds(ours))
        if args.megatron is not None:
            times["megatron"].append(wall_seconds(
                megatron_command(args.megatron, tokenizer_dir, corpus, work / "hf-megatron"),
                env))
    mb = text_bytes / 1e6
    print(f"\n## tokenizer.json throughput (MB/s of document text; {args.repeats} paired rounds, "
          f"load average {os.getloadavg()[0]:.2f} at the end)\n")
    print("| run | best seconds | best MB/s | megabeta vs it, per round (median) |\n"
          "|---|---:|---:|---:|")
    rows = [("tokenizers encode_batch, texts already in memory", "batch"),
            ("megabeta-data tokenize tokenizer.json: file to dataset (wall clock)", "ours"),
            (f"Megatron-LM preprocess_data.py, HuggingFaceTokenizer, --workers "
             f"{psutil.cpu_count()} (wall clock)", "megatron")]
    ratios = {}
    for label, name in rows:
        if not times[name]:
            continue
        paired = sorted(theirs / ours for theirs, ours in zip(times[name], times["ours"]))
        ratios[name] = paired[len(paired) // 2]
        shown = "(this run)" if name == "ours" else f"{ratios[name]:.2f}x"
        print(f"| {label} | {min(times[name]):.2f} | {mb / min(times[name]):.2f} | {shown} |")
    print(f"\ntarget: >= 0.9x encode_batch: {'met' if ratios['batch'] >= 0.9 else 'NOT met'} "
          f"({ratios['batch']:.2f}x)" + (
              f"; >= 1.2x Megatron: {'met' if ratios['megatron'] >= 1.2 else 'NOT met'} "
              f"({ratios['megatron']:.2f}x)" if "megatron" in ratios else ""))
    if "megatron" in ratios:
        same = all((work / f"hf-ours{suffix}").read_bytes()
                   == (work / f"hf-megatron_text_document{suffix}").read_bytes()
                   for suffix in (".bin", ".idx"))
        print(f"output .bin/.idx byte-identical to Megatron's: {same}")


def bench_tokenize_memory(args: argparse.Namespace, work: Path, model: Path) -> None:
    base = work / "memory-base.jsonl"
    write_corpus(base, int(args.memory_mb * 1e6), seed=1)
    larger = [work / f"memory-larger-{i}.jsonl" for i in range(args.scale)]
    for i, part in enumerate(larger):
        write_corpus(part, int(args.memory_mb * 1e6), seed=2 + i)
    print(f"\n## Peak resident memory of tokenize (whole process tree; {args.memory_mb:g} MB "
          f"vs {args.scale} x {args.memory_mb:g} MB of JSONL)\n")
    print("| workers | base corpus MiB | larger corpus MiB | increase |\n|---:|---:|---:|---:|")
    worst = 0.0
    for workers in (1, 2):
        small = peak_tree_rss(tokenize_command(model, [base], work / "memory-base", workers))
        big = peak_tree_rss(tokenize_command(model, larger, work / "memory-larger", workers))
        worst = max(worst, big / small - 1)
        print(f"| {workers} | {small:.1f} | {big:.1f} | {100 * (big / small - 1):+.1f} % |")
    print(f"\ntarget: {args.scale}x the corpus raises peak memory by < 10 %: "
          f"{'met' if worst < 0.10 else 'NOT met'} (worst {100 * worst:+.1f} %)")


def bench_loader(args: argparse.Namespace, prefix: Path) -> None:
    per_token = FLOPS_PER_PARAMETER_TOKEN * T19_FLASH_PARAMETERS
    peak = matmul_peak(torch.float32)
    bound = peak / per_token
    bf16_bound = matmul_peak(torch.bfloat16) / per_token
    print("\n## Loader throughput\n")
    print(f"fp32 matmul peak (2048^3, measured now): {peak / 1e9:.0f} GFLOP/s -> upper bound of "
          f"t19_flash consumption: {peak / 1e9:.0f}e9 / (6 * 0.19e9) = {bound:,.0f} tokens/s")
    print("(a real step runs below the matmul peak and spends extra FLOPs on attention, so it "
          "consumes fewer tokens/s than this bound; with bf16 autocast the same bound from the "
          f"bf16 matmul peak is {bf16_bound:,.0f} tokens/s)\n")
    print("| loader workers | tokens/s | vs fp32 bound | vs bf16 bound |\n|---:|---:|---:|---:|")
    ratios = []
    for workers in (0, 2):
        rate = loader_tokens_per_second(prefix, args.seq_len, args.batch_size, workers,
                                        args.loader_seconds)
        ratios.append(rate / bound)
        print(f"| {workers} | {rate:,.0f} | {rate / bound:,.0f}x | {rate / bf16_bound:,.0f}x |")
    print(f"\ntarget: loader >= 100x the fp32 consumption bound: "
          f"{'met' if min(ratios) >= 100 else 'NOT met'} (lowest {min(ratios):,.0f}x; batches "
          f"of {args.batch_size} x {args.seq_len + 1} tokens)")


if __name__ == "__main__":
    main()
