"""`megabeta tasks make` (write a task file) and `megabeta tasks eval` (a model's exact-match
accuracy on one)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from megabeta.checkpoint import CheckpointError
from megabeta.checkpoint.export import load_model, read_source
from megabeta.data import DataError
from megabeta.infer.loading import (UsageError, check_vocabulary, load_model_tokenizer,
                                    resolve_tokenizer, warn_notes)
from megabeta.storage.durable import write_durably
from megabeta.tasks.document import TaskFileError
from megabeta.tasks.evaluate import read_encoded, score_encoded
from megabeta.tasks.make import TASKS, generate_documents, write_task_file
from megabeta.tasks.scoring import TaskScore

DESCRIPTION = """Synthetic tasks with scored answers: generate them, train on them with the normal
pipeline, measure a model's exact-match accuracy on them."""
EPILOG = """workflow:
  megabeta tasks make --task chains --hops 8 --count 20000 --seed 1 --output t/chains8.train.jsonl
  megabeta tasks make --task chains --hops 8 --count 1000 --seed 2 --output t/chains8.test.jsonl
  megabeta-data train-tokenizer --inputs t/chains8.train.jsonl --vocab-size 320 --output t/tok
  megabeta-data tokenize --tokenizer t/tok.model --inputs t/chains8.train.jsonl \\
      --segments-key segments --output-prefix t/chains8
  megabeta train --config configs/tiny_cpu.toml --data.path=t/chains8 --run_dir=runs/chains8
  megabeta tasks eval --checkpoint runs/chains8/checkpoints/step_N --tasks t/chains8.test.jsonl

Run `megabeta tasks make --help` and `megabeta tasks eval --help` for the options.
"""

MAKE_DESCRIPTION = """Write COUNT documents of a task as JSONL, one per line:
{"task", "chance", "segments": [{"text", "loss"}, ...], "answers", "text"}. The scored segments
(loss: true) are the answers, short digit strings; `text` is the whole document, for
train-tokenizer. The same task, options and --seed give a byte-identical file; use another seed
for a test file."""
MAKE_EPILOG = """tasks:
  chains        variables assigned digits, copied along in-order chains of --hops copies,
                --chains chains interleaved (each the others' distractors); every chain's end
                is queried: "ab=7 / qd=ab / ... / ?xe=" -> "7". Chance 1/--values. The
                article's serial testbed reports --hops 8 and --hops 32.
  permutations  --length elements of --group (S5 or A5, five-digit one-line notation); after
                each, its prefix product g_i o ... o g_1 is scored: "21345>" -> "21345".
                Chance 1/120 (S5), 1/60 (A5); an answer counts only if all five digits are right.
  parity        --length random bits, then their parity: "0110100=" -> "1". Chance 1/2.
  retrieval     --pairs variables assigned digits, then --queries of them asked for:
                "ab=3 / qd=7 / ... / ?ab=" -> "3". Chance 1/--values. With a small
                vocabulary the assignments span many of beta_1.2's blocks.

The variant's options are in its task name (e.g. chains-n8-k2-v10), under which
`megabeta tasks eval` reports it. Each task's module (megabeta/tasks/) documents its format.

examples:
  megabeta tasks make --task chains --hops 32 --count 1000 --seed 2 --output chains32.jsonl
  megabeta tasks make --task permutations --group A5 --length 24 --count 5000 --seed 1 \\
      --output a5.jsonl
  megabeta tasks make --task parity --length 12 --count 2000 --seed 1 --output parity.jsonl
"""

OPTION_HELP = {
    "hops": "chains: copies per chain, the serial depth asked for (default: 8)",
    "chains": "chains: chains per document, all interleaved and all queried; more lower the "
              "shortcut of guessing among the document's constants (default: 2)",
    "values": "chains, retrieval: the constants are the digits 0 … VALUES-1, 2 to 10 "
              "(default: 10)",
    "pairs": "retrieval: variables assigned per document (default: 16)",
    "queries": "retrieval: variables asked for per document, at most --pairs (default: 4)",
    "group": "permutations: S5 or A5 (default: S5)",
    "length": "permutations: elements per document (default: 10); parity: bits per document "
              "(default: 16)",
}
"""The task options, one flag per field of the tasks' option dataclasses."""

EVAL_DESCRIPTION = """Exact-match accuracy of a checkpoint directory or an exported .safetensors
file on task files: each document is tokenized with the model's tokenizer exactly as
`megabeta-data tokenize --segments-key segments` does (segments encoded separately), read by the
model at once (teacher forcing), and an answer (a scored segment) is correct when the greedy
prediction is right at every one of its tokens. Prints, per task: documents, answers, correct,
accuracy and the chance level (an input-blind predictor's accuracy, from the file)."""
EVAL_EPILOG = """Documents of the same task name are pooled across --tasks files. The tokenizer is the one
recorded with the checkpoint unless --tokenizer; another one than the model was trained with is
refused unless --force-tokenizer. A document longer than the model's max_seq_len is an error.

example:
  megabeta tasks eval --checkpoint runs/chains/checkpoints/step_00001000 \\
      --tasks chains8.test.jsonl chains32.test.jsonl --json runs/chains/tasks.json
"""


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _make_parser(subparsers) -> None:
    parser = subparsers.add_parser("make", help="write a task file (JSONL, answers marked)",
                                   description=MAKE_DESCRIPTION, epilog=MAKE_EPILOG,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", required=True, choices=sorted(TASKS),
                        help="which task (required; see below)")
    parser.add_argument("--count", type=int, required=True,
                        help="documents to write (required)")
    parser.add_argument("--seed", type=int, required=True,
                        help="seed of the generator, >= 0; the same seed gives the same file "
                        "(required: train and test files need different ones)")
    parser.add_argument("--output", required=True, help="the .jsonl file to write (required)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --output if it exists (default: refuse)")
    options = parser.add_argument_group("task options (each applies to the tasks it names)")
    options.add_argument("--hops", type=int, help=OPTION_HELP["hops"])
    options.add_argument("--chains", type=int, help=OPTION_HELP["chains"])
    options.add_argument("--values", type=int, help=OPTION_HELP["values"])
    options.add_argument("--pairs", type=int, help=OPTION_HELP["pairs"])
    options.add_argument("--queries", type=int, help=OPTION_HELP["queries"])
    options.add_argument("--group", choices=("S5", "A5"), help=OPTION_HELP["group"])
    options.add_argument("--length", type=int, help=OPTION_HELP["length"])
    parser.set_defaults(run=_make, parser=parser)


def _make(args: argparse.Namespace) -> int:
    parser = args.parser
    if args.count < 1:
        parser.error(f"argument --count: {args.count}, must be >= 1")
    if args.seed < 0:
        parser.error(f"argument --seed: {args.seed}, must be >= 0")
    kind = TASKS[args.task]
    fields = {f.name for f in dataclasses.fields(kind)}
    given = {name: getattr(args, name) for name in OPTION_HELP if getattr(args, name) is not None}
    for name in sorted(given.keys() - fields):
        users = [task for task, k in sorted(TASKS.items())
                 if name in {f.name for f in dataclasses.fields(k)}]
        parser.error(f"argument --{name}: applies to --task {' or '.join(users)}, not "
                     f"--task {args.task}")
    try:
        task = kind(**given)
    except ValueError as err:
        parser.error(str(err))
    try:
        count = write_task_file(args.output, generate_documents(task, args.count, args.seed),
                                overwrite=args.overwrite)
    except (DataError, OSError) as err:
        return _fail(str(err))
    print(f"wrote {count} documents of {task.name} (chance {task.chance:.4g}) to {args.output}")
    return 0


def _eval_parser(subparsers) -> None:
    parser = subparsers.add_parser("eval", help="exact-match accuracy of a model on task files",
                                   description=EVAL_DESCRIPTION, epilog=EVAL_EPILOG,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="checkpoint dir (RUN/checkpoints/step_N), .safetensors or a folder of "
                        "`megabeta export --format hf` (required)")
    parser.add_argument("--tasks", required=True, nargs="+", metavar="FILE",
                        help="task files written by `megabeta tasks make` (required)")
    parser.add_argument("--tokenizer", default="",
                        help="sentencepiece .model or tokenizer.json to tokenize the tasks with "
                        "(default: the one recorded with the checkpoint; another one needs "
                        "--force-tokenizer)")
    parser.add_argument("--force-tokenizer", action="store_true",
                        help="use --tokenizer even though the model was trained with another "
                        "(default: off)")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="documents per forward pass; more is faster and takes more memory, "
                        "the result is the same (default: 8)")
    parser.add_argument("--max-documents", type=int, default=0,
                        help="score at most the first N documents of each file; 0 = all "
                        "(default: 0)")
    parser.add_argument("--device", default="cpu",
                        help="where the model runs: cpu, cuda, cuda:1, ... (default: cpu)")
    parser.add_argument("--json", default="", metavar="OUT",
                        help="also write the results to this JSON file (default: none)")
    parser.set_defaults(run=_eval, parser=parser)


def _eval(args: argparse.Namespace) -> int:
    parser = args.parser
    if args.batch_size < 1:
        parser.error(f"argument --batch-size: {args.batch_size}, must be >= 1")
    if args.max_documents < 0:
        parser.error(f"argument --max-documents: {args.max_documents}, must be >= 0 (0 = all)")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"argument --device: {args.device!r} is not a device (cpu, cuda, cuda:1, …)")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"argument --device: {args.device}, but no CUDA device is available; "
                     "leave it out to run on the CPU")
    try:
        source = read_source(args.checkpoint)
        warn_notes(source)
        tokenizer_path, tokenizer_sha = resolve_tokenizer(source, args.tokenizer,
                                                          args.force_tokenizer, need_file=True)
        processor = load_model_tokenizer(tokenizer_path)
        # The files are read and checked against the context before the model loads.
        documents = read_encoded(args.tasks, processor, source.model_config.max_seq_len,
                                 args.max_documents)
        model = load_model(args.checkpoint, device=device)
        check_vocabulary(processor, tokenizer_path, model)
        scores = list(score_encoded(model, documents, pad_id=max(processor.pad_id, 0),
                                    batch_size=args.batch_size, device=device).values())
    except (CheckpointError, DataError, UsageError, TaskFileError) as err:
        return _fail(str(err))
    print(format_table(scores))
    if args.json:
        report = {"checkpoint": str(args.checkpoint), "tasks_files": list(args.tasks),
                  "tokenizer": {"path": tokenizer_path, "sha256": tokenizer_sha},
                  "max_documents": args.max_documents,
                  "results": [score.as_dict() for score in scores]}
        try:
            # Overwritten on purpose (a rerun replaces its results), never left half-written.
            write_durably(Path(args.json), json.dumps(report, indent=2) + "\n")
        except OSError as err:
            return _fail(f"--json {args.json}: cannot write it ({err})")
    return 0


def format_table(scores: list[TaskScore]) -> str:
    """One row per task: documents, answers, correct, accuracy and chance."""
    width = max([len("task"), *(len(s.task) for s in scores)])
    lines = [f"{'task':<{width}}  {'documents':>9}  {'answers':>8}  {'correct':>8}  "
             f"{'accuracy':>8}  {'chance':>7}"]
    for s in scores:
        chance = "?" if s.chance is None else f"{s.chance:.4f}"
        lines.append(f"{s.task:<{width}}  {s.documents:>9}  {s.answers:>8}  {s.correct:>8}  "
                     f"{s.accuracy:>8.4f}  {chance:>7}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megabeta tasks", description=DESCRIPTION,
                                     epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    subparsers = parser.add_subparsers(dest="action", required=True, metavar="{make,eval}")
    _make_parser(subparsers)
    _eval_parser(subparsers)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
