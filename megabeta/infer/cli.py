"""`megabeta eval` (validation loss and perplexity) and `megabeta generate` (continue a prompt),
from an exported .safetensors file, a checkpoint directory or a Hugging Face folder of `megabeta
export --format hf`, on one process.

Both take their defaults from what the checkpoint records: the run's saved config
(RUN/config.toml next to RUN/checkpoints) or, for an export, its metadata; and the tokenizer the
model was trained with (path and sha256, in the checkpoint's train state or the export's
metadata), which they use unless told otherwise and refuse to swap for another one unless
`--force-tokenizer` is given.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from megabeta.checkpoint import CheckpointError
from megabeta.checkpoint.export import ModelSource, load_model, read_source
from megabeta.data import DataError, GlobalSampler, build_train_val
from megabeta.infer.evaluate import evaluate
from megabeta.infer.generate import cut_at_token, generate, stop_at_token
from megabeta.infer.loading import (UsageError, check_vocabulary, load_checkpoint,
                                    load_model_tokenizer, resolve_tokenizer, short_hash,
                                    warn_notes)
from megabeta.model import ConfigError
from megabeta.model.documents import require_document_mask_support

FALLBACK_VAL_FRACTION = 0.01
"""`eval --val-fraction` when the checkpoint records no run config."""


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


# ---- eval ----------------------------------------------------------------------------------------
EVAL_DESCRIPTION = ("Validation loss and perplexity of a checkpoint directory, an exported "
                    ".safetensors file or a Hugging Face folder of `megabeta export --format "
                    "hf`, on one process; with --lm-eval, tasks of EleutherAI's "
                    "lm-evaluation-harness instead.")
EVAL_EPILOG = """defaults:
  The run's data settings (data.path, data.seq_len, data.val_fraction) come from RUN/config.toml
  for a checkpoint directory RUN/checkpoints/step_N, and from the metadata of an export; so
  `megabeta eval --checkpoint RUN/checkpoints/step_N` evaluates the run's own validation split.
  The dataset must have been tokenized with the model's tokenizer (sha256 in its .json sidecar);
  another one is refused unless --force-tokenizer.
lm-evaluation-harness (pip install 'megabeta[eval]'):
  megabeta eval --checkpoint m.safetensors --lm-eval hellaswag,arc_easy,piqa --batch-size 32
  megabeta eval --checkpoint m.safetensors --lm-eval my_task --lm-eval-include tasks/ --limit 100
  prints the harness's table and writes its results as JSON next to the checkpoint
  (CHECKPOINT.lm_eval.json; --lm-eval-output to choose). The harness downloads its tasks' data
  from the Hugging Face Hub unless they are local (dataset_path: json with data_files).
"""


def _evaluate_data(model, data, batch_size: int, max_batches: int,
                   device: torch.device) -> dict[str, float]:
    vocab = model.config.vocab_size
    if data.vocab_size is not None and data.vocab_size > vocab:
        raise UsageError(f"{data.sources[0].paths.prefix}: its tokenizer has {data.vocab_size} "
                         f"pieces, more than the model's vocabulary ({vocab}); evaluate on data "
                         "tokenized with the model's tokenizer")
    dataset = data.val if data.val is not None else data.train
    sampler = GlobalSampler(len(dataset), shuffle=False, num_epochs=1)
    try:
        return evaluate(model, dataset, sampler, batch_size=batch_size, max_batches=max_batches,
                        device=device)
    except IndexError:
        raise UsageError(f"{data.sources[0].paths.prefix}: holds token ids outside the model's "
                         f"vocabulary ({vocab}); it was tokenized with another tokenizer, "
                         "evaluate on data made with the model's") from None


def eval_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megabeta eval", description=EVAL_DESCRIPTION,
                                     epilog=EVAL_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="checkpoint dir (RUN/checkpoints/step_N), .safetensors or a folder of "
                        "`megabeta export --format hf` (required)")
    parser.add_argument("--data.path", dest="data", default=None,
                        help="dataset prefix(es), comma-separated (default: the run's data.path)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per sample, at most the model's max_seq_len (default: the "
                        "run's data.seq_len, else the model's max_seq_len)")
    parser.add_argument("--val-fraction", type=float, default=None,
                        help="evaluate the last documents of this share of each dataset, its "
                        "validation split; 0: the whole dataset (default: the run's "
                        f"data.val_fraction, else {FALLBACK_VAL_FRACTION})")
    parser.add_argument("--batch-size", type=int, default=4,
                        help="samples (with --lm-eval: requests) per forward pass; more is "
                        "faster and takes more memory, the result is the same (default: 4)")
    parser.add_argument("--batches", type=int, default=0,
                        help="evaluate at most this many batches; 0 = all (default: 0)")
    parser.add_argument("--tokenizer", default="",
                        help="tokenizer (.model or tokenizer.json) the data must have been "
                        "tokenized with (default: the one recorded with the checkpoint)")
    parser.add_argument("--force-tokenizer", action="store_true",
                        help="skip the tokenizer checks: use --tokenizer though the model was "
                        "trained with another, and data of any tokenizer (default: off)")
    parser.add_argument("--device", default=None,
                        help="where the model runs: cpu, cuda, cuda:1, ... (default: cuda when "
                        "available, else cpu)")
    harness = parser.add_argument_group("lm-evaluation-harness (megabeta[eval])")
    harness.add_argument("--lm-eval", default="", metavar="TASKS",
                         help="comma-separated lm-eval task, group or tag names to run instead "
                         "of the loss (default: none)")
    harness.add_argument("--lm-eval-include", default="", metavar="PATH",
                         help="folder of task definitions in YAML, for tasks of your own "
                         "(default: the harness's tasks only)")
    harness.add_argument("--limit", type=float, default=None,
                         help="documents per task: a count, or a share when < 1 (default: all)")
    harness.add_argument("--num-fewshot", type=int, default=None,
                         help="few-shot examples per prompt (default: each task's own, else 0)")
    harness.add_argument("--seed", type=int, default=1234,
                         help="seed of sampled generation (default: 1234)")
    harness.add_argument("--bootstrap-iters", type=int, default=100000,
                         help="bootstrap resamples for the standard errors of metrics that need "
                         "them; 0 = none (default: 100000, the harness's)")
    harness.add_argument("--lm-eval-output", default="", metavar="FILE",
                         help="where the results JSON goes (default: next to the checkpoint, "
                         "CHECKPOINT.lm_eval.json)")
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error(f"argument --batch-size: {args.batch_size}, must be >= 1")
    device = _device(parser, args.device)
    if args.lm_eval:
        for flag, value in (("--data.path", args.data), ("--seq-len", args.seq_len),
                            ("--val-fraction", args.val_fraction), ("--batches", args.batches)):
            if value:
                parser.error(f"argument {flag}: not used with --lm-eval (the harness's tasks "
                             "bring their data); leave it out, or evaluate the loss without "
                             "--lm-eval")
        if args.num_fewshot is not None and args.num_fewshot < 0:
            parser.error(f"argument --num-fewshot: {args.num_fewshot}, must be >= 0")
        if args.bootstrap_iters < 0:
            parser.error(f"argument --bootstrap-iters: {args.bootstrap_iters}, must be >= 0")
        return _lm_eval(args, device)
    for flag, value in (("--lm-eval-include", args.lm_eval_include), ("--limit", args.limit),
                        ("--num-fewshot", args.num_fewshot),
                        ("--lm-eval-output", args.lm_eval_output)):
        if value is not None and value != "":
            parser.error(f"argument {flag}: only with --lm-eval TASKS")
    if args.batches < 0:
        parser.error(f"argument --batches: {args.batches}, must be >= 0 (0 = all)")
    if args.val_fraction is not None and not 0.0 <= args.val_fraction < 1.0:
        parser.error(f"argument --val-fraction: {args.val_fraction}, must be in [0, 1)")
    try:
        source = read_source(args.checkpoint)
        warn_notes(source)
        _, tokenizer_sha = resolve_tokenizer(source, args.tokenizer, args.force_tokenizer,
                                             need_file=False)
        paths, seq_len, val_fraction = _eval_settings(args, source)
        # Samples as the run cut them (packed, block-aligned, or document-aligned and masked past
        # the end), with the document ids its model was trained to mask by.
        document_mask = bool(source.data.get("document_mask", False))
        data = build_train_val(paths, None, seq_len=seq_len, val_fraction=val_fraction,
                               align=source.data.get("align", "packed"),
                               document_mask=document_mask,
                               block_size=source.model_config.block_size)
        _check_data_tokenizer(data, tokenizer_sha, source, args.force_tokenizer)
        model = load_model(args.checkpoint, device=device)
        if document_mask:
            require_document_mask_support(model)
        result = _evaluate_data(model, data, args.batch_size, args.batches, device)
    except (CheckpointError, ConfigError, DataError, UsageError) as err:
        return _fail(str(err))
    print(f"loss {result['loss']:.4f} | ppl {result['ppl']:.2f} | {result['samples']} samples")
    return 0


def _device(parser: argparse.ArgumentParser, given: str | None) -> torch.device:
    if given is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(given)
    except RuntimeError:
        parser.error(f"argument --device: {given!r} is not a device (cpu, cuda, cuda:1, ...)")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"argument --device: {given}, but no CUDA device is available; leave it "
                     "out to run on the CPU")
    return device


def lm_eval_output(checkpoint: str) -> Path:
    """Where `eval --lm-eval` writes its results by default: beside the export or checkpoint
    directory, named after it (RUN/checkpoints/step_N.lm_eval.json, m.lm_eval.json)."""
    path = Path(checkpoint.rstrip("/\\"))
    stem = path.stem if path.suffix == ".safetensors" else path.name
    return path.with_name(f"{stem}.lm_eval.json")


def _lm_eval(args: argparse.Namespace, device: torch.device) -> int:
    """`eval --lm-eval TASKS`: every input checked (tasks, limit, tokenizer, checkpoint) before
    the model loads, then the harness; its table printed, its results written as JSON."""
    from megabeta.extras import require

    try:
        require("lm_eval", "eval", "--lm-eval")
        from megabeta.infer import lm_eval as harness

        limit = harness.check_limit(args.limit, "--limit")
        tasks = harness.find_tasks(args.lm_eval.split(","), args.lm_eval_include)
        output = Path(args.lm_eval_output) if args.lm_eval_output else lm_eval_output(
            args.checkpoint)
        model, tokenizer = load_checkpoint(args.checkpoint, tokenizer=args.tokenizer,
                                           force_tokenizer=args.force_tokenizer, device=device)
        lm = harness.MegabetaLM(model, tokenizer, batch_size=args.batch_size, seed=args.seed)
        results = harness.run_tasks(lm, tasks, limit=limit, num_fewshot=args.num_fewshot,
                                    bootstrap_iters=args.bootstrap_iters)
    except (CheckpointError, DataError, UsageError, ConfigError) as err:
        return _fail(str(err))
    results["megabeta"] = {"checkpoint": str(args.checkpoint), "tokenizer": tokenizer.info.path,
                           "batch_size": args.batch_size, "device": str(device)}
    print(harness.table(results))
    try:
        harness.write_results(results, output)
    except OSError as err:
        return _fail(f"--lm-eval-output {output}: cannot write it ({err})")
    print(f"wrote {output}")
    return 0


LM_EVAL_DESCRIPTION = """usage: megabeta lm-eval [lm-eval's flags]

The lm-evaluation-harness's own command line (`lm_eval`/`lm-eval`, every flag as it documents
them) with the megabeta model registered as `megabeta`:

  megabeta lm-eval --model megabeta --model_args pretrained=m.safetensors \\
      --tasks hellaswag,arc_easy --batch_size 16 --device cuda:0 --output_path results/

model_args: pretrained=PATH or checkpoint=PATH (an export or a checkpoint directory; required;
the harness names the --output_path folder after pretrained=), tokenizer=PATH and
force_tokenizer=True (another copy of the model's tokenizer), seed=N (sampled generation),
max_gen_toks=N. The harness's --device defaults to cuda:0; without CUDA the model runs on the
CPU (with a warning). A harness with plugin discovery also finds the model from its own
command, `lm_eval --model megabeta ...` (the package's `lm_eval.models` entry point); lm-eval
0.4.13 has none. Needs pip install 'megabeta[eval]'. The harness's help follows
(`megabeta lm-eval run --help`: every flag of a run).
"""


def lm_eval_main(argv: list[str] | None = None) -> int:
    """`megabeta lm-eval`: the harness's command line, run in this process with `MegabetaLM`
    registered, without the harness's noise (`quiet_harness`)."""
    from megabeta.extras import require

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]) or not argv:
        print(LM_EVAL_DESCRIPTION, file=sys.stderr)
    try:
        require("lm_eval", "eval", "megabeta lm-eval")
    except ConfigError as err:
        return _fail(str(err))
    from lm_eval.__main__ import cli_evaluate

    from megabeta.infer.lm_eval import quiet_harness  # registers the model

    # The harness's parser reads sys.argv (and inserts `run` when no subcommand is named).
    saved = sys.argv
    sys.argv = ["megabeta lm-eval", *argv]
    try:
        with quiet_harness():
            cli_evaluate()
    finally:
        sys.argv = saved
    return 0


def _eval_settings(args: argparse.Namespace, source: ModelSource) -> tuple[list[str], int, float]:
    """data paths, seq_len, val_fraction: the flags, else the run's, else the fallbacks."""
    run = source.data
    where = source.settings_from or "nowhere (no run config or export metadata found)"
    max_seq_len = source.model_config.max_seq_len
    if args.data:
        paths = [p for p in args.data.split(",") if p.strip()]
    else:
        paths = list(run.get("path") or [])
    if not paths:
        raise UsageError(f"no dataset to evaluate on: pass --data.path=PREFIX (the run's "
                         f"data.path is taken from {where})")
    if args.seq_len is not None:
        seq_len, flag = args.seq_len, f"--seq-len {args.seq_len}"
    elif run.get("seq_len"):
        seq_len, flag = int(run["seq_len"]), f"data.seq_len = {run['seq_len']} (from {where})"
    else:
        seq_len, flag = max_seq_len, ""
    if seq_len < 1:
        raise UsageError(f"{flag}: must be >= 1")
    if seq_len > max_seq_len:
        raise UsageError(f"{flag} exceeds the model's max_seq_len = {max_seq_len} "
                         f"({source.path}); pass --seq-len {max_seq_len} or less")
    if args.val_fraction is not None:
        val_fraction = args.val_fraction
    else:
        val_fraction = float(run.get("val_fraction", FALLBACK_VAL_FRACTION))
    print(f"eval: {','.join(paths)} | seq_len {seq_len} | val_fraction {val_fraction} "
          f"(defaults from {where})", file=sys.stderr)
    return paths, seq_len, val_fraction


def _check_data_tokenizer(data, expected: str | None, source: ModelSource, force: bool) -> None:
    if force or expected is None:
        return
    prefix = data.sources[0].paths.prefix
    if data.tokenizer_sha256 is None:
        print(f"warning: {data.sources[0].paths.sidecar} is missing, so {prefix} cannot be "
              "checked against the model's tokenizer; `megabeta-data tokenize` writes it",
              file=sys.stderr)
        return
    if data.tokenizer_sha256 != expected:
        made_with = (data.sources[0].sidecar or {}).get("tokenizer", {}).get("path", "?")
        raise UsageError(f"{prefix} was tokenized with {made_with} "
                         f"({short_hash(data.tokenizer_sha256)}), not with the model's tokenizer "
                         f"({short_hash(expected)}, recorded with {source.path}): the loss would "
                         "mean nothing. Evaluate on data tokenized with the model's tokenizer, "
                         "or pass --force-tokenizer")


# ---- generate ------------------------------------------------------------------------------------
GENERATE_DESCRIPTION = ("Continue a prompt with the KV cache, from a checkpoint directory, an "
                        "exported .safetensors file or a Hugging Face folder of `megabeta export "
                        "--format hf`, on one process.")
GENERATE_EPILOG = """context:
  The prompt plus --max-new-tokens must fit in the model's context (model.max_seq_len, e.g. 128
  for tiny_cpu): a longer request is an error that names the limit, nothing is truncated. Shorten
  the prompt or ask for fewer new tokens.
tokenizer:
  The checkpoint (or export) records the tokenizer the model was trained with; it is used by
  default, and a different --tokenizer (another sha256) is refused unless --force-tokenizer.
"""


def generate_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megabeta generate", description=GENERATE_DESCRIPTION,
                                     epilog=GENERATE_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="checkpoint dir (RUN/checkpoints/step_N), .safetensors or a folder of "
                        "`megabeta export --format hf` (required)")
    parser.add_argument("--tokenizer", default="",
                        help="sentencepiece .model or Hugging Face tokenizer.json (default: the "
                        "one recorded with the checkpoint; another one needs --force-tokenizer)")
    parser.add_argument("--force-tokenizer", action="store_true",
                        help="use --tokenizer even though the model was trained with another "
                        "(default: off)")
    parser.add_argument("--prompt", required=True, help="text to continue (required)")
    parser.add_argument("--max-new-tokens", type=int, default=64,
                        help="tokens to add; prompt + these must fit in the model's "
                        "max_seq_len (default: 64)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="sampling temperature, 0 = greedy (default: 0.8)")
    parser.add_argument("--top-k", type=int, default=None,
                        help="sample only among the k most likely tokens (default: no limit)")
    parser.add_argument("--top-p", type=float, default=None,
                        help="nucleus sampling: only among the most likely tokens whose "
                        "probability reaches p, in (0, 1] (default: no limit)")
    parser.add_argument("--seed", type=int, default=0,
                        help="random seed; the same seed gives the same text (default: 0)")
    parser.add_argument("--stop-at-eod", action=argparse.BooleanOptionalAction, default=True,
                        help="stop at the end-of-document token (the tokenizer's EOS, which the "
                        "data tools append to every document) and print the text before it; "
                        "without it a model trained on packed documents runs on into another "
                        "document (default: on)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 0:
        parser.error(f"argument --max-new-tokens: {args.max_new_tokens}, must be >= 0")
    if args.temperature < 0:
        parser.error(f"argument --temperature: {args.temperature}, must be >= 0 (0 = greedy)")
    if args.top_k is not None and args.top_k < 1:
        parser.error(f"argument --top-k: {args.top_k}, must be >= 1 (leave it out for no limit)")
    if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
        parser.error(f"argument --top-p: {args.top_p}, must be in (0, 1]")
    try:
        source = read_source(args.checkpoint)
        warn_notes(source)
        tokenizer_path, _ = resolve_tokenizer(source, args.tokenizer, args.force_tokenizer,
                                              need_file=True)
        tokenizer = load_model_tokenizer(tokenizer_path)
        prompt = torch.tensor(tokenizer.encode(args.prompt), dtype=torch.long)
        _check_context(prompt.numel(), args.max_new_tokens, source)
        model = load_model(args.checkpoint)
        check_vocabulary(tokenizer, tokenizer_path, model)
    except (CheckpointError, DataError, UsageError) as err:
        return _fail(str(err))
    eod = tokenizer.eos_id if args.stop_at_eod and tokenizer.eos_id >= 0 else None
    out = generate(model, prompt, args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                   stop=None if eod is None else stop_at_token(eod))
    new = out[prompt.numel():]
    if eod is not None:
        new = cut_at_token(new, eod)
    print(args.prompt + tokenizer.decode(new.tolist()))
    return 0


def _check_context(prompt_tokens: int, new_tokens: int, source: ModelSource) -> None:
    limit = source.model_config.max_seq_len
    if prompt_tokens == 0:
        raise UsageError("--prompt encodes to no tokens; pass some text")
    if prompt_tokens > limit:
        raise UsageError(f"--prompt encodes to {prompt_tokens} tokens, more than the model's "
                         f"context (model.max_seq_len = {limit}); shorten it to at most "
                         f"{limit - 1} tokens, leaving room for new ones")
    if prompt_tokens + new_tokens > limit:
        raise UsageError(f"--prompt ({prompt_tokens} tokens) + --max-new-tokens {new_tokens} = "
                         f"{prompt_tokens + new_tokens} tokens exceeds the model's context "
                         f"(model.max_seq_len = {limit}); pass --max-new-tokens "
                         f"{limit - prompt_tokens} or less, or a shorter prompt")
