"""`megabeta ablate`: train arms through the real trainer on the same data order, evaluate each on
the same held-out split (and the task accuracy), summarise mean ± spread over seeds."""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

from megabeta.ablate.runner import (
    Evaluator,
    Interrupted,
    Settings,
    prepare_task_data,
    run_name,
    run_one,
    write_json_atomic,
)
from megabeta.ablate.suites import (
    EVAL_POINTS,
    SCALES,
    SUITES,
    AblationError,
    build_arms,
    check_equal_parameters,
    eval_interval,
    suite_arms,
)
from megabeta.ablate.plot import write_plot
from megabeta.ablate.summary import summarize, write_summary
from megabeta.checkpoint import CheckpointError
from megabeta.data import DataError
from megabeta.extras import MissingExtra
from megabeta.model.config import ConfigError, preset_names

DESCRIPTION = """Train every arm (preset names or config files) through the real trainer
(`python -m megabeta.train`) on the same data in the same order (same data seed and global
batch), one after another, evaluate each on the same held-out split (and, for task datasets, the
exact-match task accuracy), and write OUT/summary.md, .csv, .json and .png (loss curves and task
accuracies per arm; needs megabeta[plot]): arm, parameters, test loss,
perplexity (or accuracy), s/batch, tokens/s, the reference (standard) arm first, deltas against
it; with several seeds, mean ± sample standard deviation. Each arm-seed is a trainer run under
OUT/runs/ARM-seedS (`tensorboard --logdir OUT/runs` shows them all, test/* scalars included).
Resumable: rerun the same command after a kill and finished runs are skipped, the interrupted one
continues from its newest checkpoint."""

EPILOG = """suites (--suite):
  c-sweep  article §7.1: t16_std_tf_rope (reference), beta_1.2_test (c = 32), beta_1.2_c256
  depth    article §7.2: t16_std_tf_rope (L = 20, reference) against beta_1.2_de10k6,
           beta_1.2_de10k2, beta_1.2_stride2 (L = 10) at equal parameters (resolve_fair_config)
  state    state-tracking tasks (megabeta tasks): standard (reference), looped (L/2 x 2 loops)
           and beta_1.2 at the small c (L/2), at equal parameters; without --data it generates
           its task data under OUT/data (train and test files of other seeds, a tokenizer, the
           masked datasets) and reports accuracy per task next to the loss on the answers

scales (--scale; the summary states it):
  tiny     width x 1/4, layers x 0.4, blocks x 1/4, seq_len 64: L = 20 -> 8, c = 32 -> 8,
           c = 256 -> 64 = T; 300 batches of 16; a suite in under 15 minutes on a 2-core CPU
           (the state suite: about 6 minutes on an idle one)
  small    width x 1/2, layers x 0.6, blocks x 1/2, seq_len 256 (state 128); 1000 batches
  article  the presets as they are (T = 2048, 20000 batches): GPUs, e.g. with
           --base-config configs/t16_std_tf_rope.toml --nproc 8

examples:
  megabeta ablate --suite state --scale tiny --out /tmp/abl-state
  megabeta ablate --suite c-sweep --scale tiny --data data/corpus --seeds 1,2,3 --out abl/c
  megabeta ablate --suite depth --scale small --data data/corpus --plan --out abl/depth
  megabeta ablate --arms t16_std_tf_rope,my_arm.toml --data data/corpus --batches 500 \\
      --scale article --base-config configs/t16_std_tf_rope.toml --out abl/mine
  megabeta ablate ... --set optim.weight_decay=0.05 --set execution.attention=reference

Arms given as config files (or shipped config names: tiny_cpu, ...) contribute their [model]
section, scaled like the presets (--scale article trains them as written), and their
train.block_size_schedule (a block-size curriculum, its block sizes scaled alike; the file is
checked as a whole config, so give it a train.steps past the last stage); the data,
schedule, optimizer and trainer settings are the ablation's (from the scale, --base-config and
--set), the same for every arm. Equal-parameter arms (the depth presets, and all arms with --equal-params) get their
SwiGLU width resolved at the chosen scale against the reference; their counts are printed and
checked to be within 0.5 %.
"""


def _positive(name: str, value: int | None, zero_ok: bool = False) -> None:
    if value is not None and (value < 0 or (value == 0 and not zero_ok)):
        raise AblationError(f"{name} {value}: must be {'>= 0' if zero_ok else '>= 1'}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megabeta ablate", description=DESCRIPTION,
                                     epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_argument_group("what to compare (one of)")
    what.add_argument("--suite", choices=sorted(SUITES), help="a built-in suite (see below)")
    what.add_argument("--arms", help="comma-separated preset names or config files (.toml); "
                      f"presets: {', '.join(preset_names())}")
    what.add_argument("--reference", help="the arm deltas are taken against (default: the "
                      "suite's, else the first standard arm, else the first arm)")
    what.add_argument("--equal-params", action="store_true",
                      help="resolve every --arms arm to the reference's parameter count "
                      "(resolve_fair_config: SwiGLU width; default: only the depth presets)")
    parser.add_argument("--out", required=True, help="output directory (required); rerun with "
                        "the same --out to continue a stopped ablation")
    parser.add_argument("--scale", choices=sorted(SCALES), default="tiny",
                        help="size of the models and sequences (default: tiny)")
    parser.add_argument("--batches", type=int, help="optimizer steps per arm (default: the "
                        "scale's: tiny 300, small 1000, article 20000)")
    parser.add_argument("--seeds", default="1", help="comma-separated seeds; seed S is the data "
                        "order and initialisation of every arm's run S (default: 1)")
    data = parser.add_argument_group("data")
    data.add_argument("--data", help="training dataset prefix(es) made by `megabeta-data "
                      "tokenize`, comma-separated (required, except for --suite state, which "
                      "generates its tasks)")
    data.add_argument("--tokenizer", help="the datasets' tokenizer, .model or tokenizer.json "
                      "(default: the one their sidecar names, where that file exists)")
    data.add_argument("--test-data", help="held-out dataset prefix(es); the arms then train on "
                      "all of --data (default: the validation split of --data)")
    data.add_argument("--val-fraction", type=float, default=0.05,
                      help="share of each dataset's documents held out (the trainer's "
                      "data.val_fraction) when no --test-data (default: 0.05)")
    data.add_argument("--task-files", nargs="+", metavar="FILE", default=[],
                      help="held-out task files of `megabeta tasks make`: report the exact-match "
                      "accuracy per task (needs the tokenizer)")
    data.add_argument("--align", choices=("packed", "document"),
                      help="data.align of the training runs (default: document for task data, "
                      "a --data with a loss mask or the state suite's generated data; packed "
                      "for a corpus, --task-files or not); said at the start")
    data.add_argument("--document-mask", action="store_true",
                      help="data.document_mask for every arm: each token attends only within "
                      "its own document of a packed sample (spec §7), in training and in the "
                      "test evaluation (default: off)")
    train = parser.add_argument_group("training (the same for every arm)")
    train.add_argument("--seq-len", type=int, help="tokens per sample (default: the scale's)")
    train.add_argument("--global-batch", type=int, help="sequences per step (default: 16)")
    train.add_argument("--micro-batch", type=int, help="sequences per forward pass (default: "
                       "the global batch); also the evaluation batch size")
    train.add_argument("--lr", type=float, help="peak learning rate (default: the scale's: tiny "
                       "3e-3, small 2e-3, article 1e-3; with --base-config: the file's)")
    train.add_argument("--warmup", type=int, help="warm-up steps (default: a share of --batches "
                       "by scale; with --base-config: the file's)")
    train.add_argument("--eval-batches", type=int, default=0,
                       help="evaluate at most this many batches of the held-out split; 0 = all "
                       "of it (default: 0)")
    train.add_argument("--eval-every", type=int,
                       help="validation-loss evaluation interval of the training runs, the "
                       "held-out curve of summary.png (default: batches / 10; 0 = at the end "
                       "only)")
    train.add_argument("--checkpoint-every", type=int,
                       help="checkpoint interval in steps, what a killed run resumes from "
                       "(default: batches / 4; article: 1000 per 20000 batches, in proportion "
                       "to --batches)")
    train.add_argument("--threads", type=int,
                       help="intra-op threads of each arm's trainer (OMP_NUM_THREADS; default: "
                       "the environment's OMP_NUM_THREADS, else 1, so that an arm's speed does "
                       "not depend on the machine's load)")
    train.add_argument("--base-config", help="trainer config file for everything but the model "
                       "and the data (parallel backend, precision, optimizer, schedule)")
    train.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="a trainer override for every arm, applied last (repeatable)")
    train.add_argument("--nproc", type=int, default=1,
                       help="ranks per arm (torchrun when > 1; default: 1)")
    train.add_argument("--device", help="where the evaluation runs (default: cuda when "
                       "available, else cpu)")
    control = parser.add_argument_group("control")
    control.add_argument("--plan", action="store_true",
                         help="print the arms, their parameter counts and the trainer command, "
                         "then exit without training")
    control.add_argument("--stop-after", type=int, default=0, metavar="N",
                         help="stop after N arm-seed runs trained in this invocation (a rerun "
                         "continues; 0 = run all; default: 0)")
    return parser


def _sidecar(prefix: str) -> dict:
    """A dataset's sidecar (PREFIX.json), or {} when it has none that reads."""
    try:
        sidecar = json.loads(Path(f"{prefix}.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return sidecar if isinstance(sidecar, dict) else {}


def _sidecar_tokenizer(prefix: str) -> str:
    """The tokenizer file a dataset's sidecar names, absolute, when it exists; else ""."""
    recorded = (_sidecar(prefix).get("tokenizer") or {}).get("path") or ""
    if not recorded:
        return ""
    for candidate in (Path(recorded), Path(prefix).parent / recorded):
        if candidate.is_file():
            return str(candidate.resolve())
    return ""


def _sidecar_vocab(prefix: str) -> int | None:
    vocab = (_sidecar(prefix).get("tokenizer") or {}).get("vocab_size")
    return vocab if isinstance(vocab, int) else None


def _masked(prefixes: list[str]) -> bool:
    """Whether any of the datasets scores only part of its tokens (a loss mask: task data, as
    `megabeta-data tokenize --segments-key` makes it)."""
    return any("loss_mask" in _sidecar(prefix) for prefix in prefixes)


def _prefixes(flag: str, value: str) -> list[str]:
    prefixes = [p.strip() for p in value.split(",") if p.strip()]
    if not prefixes:
        raise AblationError(f"{flag}: empty; pass PREFIX[,PREFIX] (of PREFIX.bin/.idx)")
    out = []
    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            if not Path(f"{prefix}{ext}").is_file():
                raise AblationError(f"{flag} {prefix}: {prefix}{ext} does not exist; pass the "
                                    "prefix of a dataset made by `megabeta-data tokenize`")
        out.append(str(Path(prefix).resolve()))
    return out


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise AblationError(f"--seeds {text}: expected comma-separated integers, e.g. 1,2,3") \
            from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise AblationError(f"--seeds {text}: give distinct integers >= 0, e.g. 1,2,3")
    return seeds


def plan(args: argparse.Namespace, say=print) -> tuple[Settings, list, str, dict[str, Any]]:
    """Settings, arms, reference and the summary's header from the arguments (AblationError
    naming the flag on bad input). Prepares the state suite's data unless --plan."""
    if bool(args.suite) == bool(args.arms):
        raise AblationError("pass either --suite NAME or --arms A,B,... (one of them)")
    for name in ("batches", "global_batch", "micro_batch", "seq_len", "nproc", "warmup",
                 "checkpoint_every", "threads"):
        _positive("--" + name.replace("_", "-"), getattr(args, name),
                  zero_ok=name == "warmup")
    _positive("--eval-batches", args.eval_batches, zero_ok=True)
    _positive("--eval-every", args.eval_every, zero_ok=True)
    _positive("--stop-after", args.stop_after, zero_ok=True)
    if not 0.0 <= args.val_fraction < 1.0:
        raise AblationError(f"--val-fraction {args.val_fraction}: must be in [0, 1)")
    for item in args.set:
        if "=" not in item or "." not in item.partition("=")[0]:
            raise AblationError(f"--set {item}: must look like SECTION.KEY=VALUE")
    if args.base_config and not Path(args.base_config).is_file():
        from megabeta.config import shipped_config

        if shipped_config(args.base_config) is None:
            raise AblationError(f"--base-config {args.base_config}: no such file")
    scale = SCALES[args.scale]
    out = Path(args.out).resolve()
    suite = SUITES.get(args.suite) if args.suite else None
    task_suite = bool(suite and suite.task_data)
    seq_len = args.seq_len or (scale.state_seq_len if task_suite else scale.seq_len)
    if suite:
        if args.reference or args.equal_params:
            raise AblationError(f"--suite {suite.name} sets its own reference and equal "
                                "parameters; use --arms to choose them")
        arms, reference = suite_arms(suite.name, scale, seq_len)
    else:
        arms, reference = build_arms([a.strip() for a in args.arms.split(",") if a.strip()],
                                     scale, seq_len, reference=args.reference,
                                     equal_parameters=args.equal_params)
    seeds = _seeds(args.seeds)
    batches = args.batches or scale.batches

    task_files = [str(Path(f).resolve()) for f in args.task_files]
    for file in task_files:
        if not Path(file).is_file():
            raise AblationError(f"--task-files {file}: no such file")
    tokenizer = ""
    if args.tokenizer:
        if not Path(args.tokenizer).is_file():
            raise AblationError(f"--tokenizer {args.tokenizer}: no such file")
        tokenizer = str(Path(args.tokenizer).resolve())
    generated = None
    if args.data:
        data = _prefixes("--data", args.data)
        test_data = _prefixes("--test-data", args.test_data) if args.test_data else []
        tokenizer = tokenizer or _sidecar_tokenizer(data[0])
        if task_suite and not task_files:
            raise AblationError("--suite state with --data needs --task-files (held-out task "
                                "files of `megabeta tasks make`) to report the task accuracy; "
                                "or leave out --data to generate the tasks")
    elif task_suite:
        data_dir = out / "data"
        if args.plan:
            data, test_data = [str(data_dir / "train")], [str(data_dir / "test")]
        else:
            say(f"preparing the state suite's task data under {data_dir}")
            generated = prepare_task_data(data_dir, scale.tasks, say=say)
            data, test_data = [generated["train"]], [generated["test"]]
            tokenizer = tokenizer or generated["tokenizer"]
            task_files = task_files or generated["test_files"]
    else:
        raise AblationError("--data: required (the prefix of a dataset made by `megabeta-data "
                            "tokenize`); only --suite state generates its own")
    # Samples are cut as the training data wants, whatever is evaluated: task data (a loss mask,
    # or the state suite's generated data) one document per sample, a corpus packed.
    generated_data = task_suite and not args.data
    task_data = generated_data or _masked(data)
    align = args.align or ("document" if task_data else "packed")
    say(f"data.align = {align}: " + (
        "--align" if args.align else
        "the default for the state suite's generated task data" if generated_data else
        "the default for task data (--data has a loss mask); --align packed packs them"
        if task_data else "the default for a corpus (--data has no loss mask); --align "
        "document trains on one document per sample"))
    scored = ("only the answers (the held-out data's loss mask)"
              if generated_data or _masked(test_data or data) else "every token (no loss mask)")
    global_batch = args.global_batch or scale.global_batch
    micro_batch = args.micro_batch or min(global_batch, scale.micro_batch)
    if global_batch % (micro_batch * args.nproc):
        raise AblationError(f"--global-batch {global_batch}: not a multiple of --micro-batch "
                            f"{micro_batch} x --nproc {args.nproc}")
    base = args.base_config
    checkpoint_every = args.checkpoint_every or scale.checkpoint_interval(batches)
    threads = args.threads or _environment_threads()
    settings = Settings(
        out=out, scale=scale, data=data, tokenizer=tokenizer, seq_len=seq_len,
        val_fraction=0.0 if test_data else args.val_fraction, align=align,
        document_mask=args.document_mask,
        test_data=test_data, task_files=task_files, batches=batches, seeds=seeds,
        global_batch=global_batch, micro_batch=micro_batch,
        lr=args.lr if args.lr is not None else (None if base else scale.lr),
        warmup_steps=(args.warmup if args.warmup is not None else
                      None if base else max(1, round(batches * scale.warmup_fraction))),
        eval_batches=args.eval_batches,
        checkpoint_every=checkpoint_every,
        base_config=str(Path(base).resolve()) if base and Path(base).is_file() else base,
        extra=[f"--{item}" for item in args.set], nproc=args.nproc, device=_device(args.device),
        eval_every=eval_interval(batches) if args.eval_every is None else args.eval_every,
        threads=threads)
    say(_scale_settings(args, settings))
    _check_trainer_settings(settings, arms)
    vocab = _sidecar_vocab(data[0]) if Path(f"{data[0]}.json").is_file() else None
    problems = check_equal_parameters(arms, reference, vocab)
    if problems:
        raise AblationError("arms meant to have equal parameters do not: " + "; ".join(problems))
    header = {
        "suite": suite.name if suite else "custom arms",
        "scale": scale.describe(),
        "arms": ", ".join(f"{a.name} ({a.source}{', equal parameters' if a.fair else ''})"
                          for a in arms),
        "reference": reference,
        "data": ", ".join(data) + (" (generated task data)" if generated else ""),
        "held-out": (", ".join(test_data) if test_data else
                     f"validation split, val_fraction {settings.val_fraction}")
        + (f"; task files {', '.join(Path(f).name for f in task_files)}" if task_files else ""),
        "test loss": "mean over the scored targets of "
                     + (f"--test-data {', '.join(test_data)}" if test_data else
                        f"the validation split (val_fraction {settings.val_fraction}) of --data")
                     + f": {scored}",
        "training": f"{batches} batches of {global_batch} x {seq_len} tokens "
                    f"(align {align}), lr {settings.lr if settings.lr is not None else 'base'}, "
                    f"warm-up {settings.warmup_steps if settings.warmup_steps is not None else 'base'}"
                    f"{', base config ' + str(base) if base else ''}"
                    f"{', ' + ' '.join(args.set) if args.set else ''}",
        "seeds": ", ".join(map(str, seeds)),
        "vocabulary": vocab if vocab else "from the data",
    }
    return settings, arms, reference, header


def _environment_threads() -> int:
    """OMP_NUM_THREADS of this process's environment when it is a positive integer, else 1."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def _scale_settings(args: argparse.Namespace, s: Settings) -> str:
    """One line: the run settings the arms share, each with what set it (a flag, the scale,
    the base config or a default)."""
    scale = s.scale
    by_scale = "base config" if s.base_config else "scale"
    threads_from = ("--threads" if args.threads else
                    "OMP_NUM_THREADS" if "OMP_NUM_THREADS" in os.environ else "default")
    rows = [
        ("lr", s.lr if s.lr is not None else "the base config's", args.lr, by_scale),
        ("warm-up", s.warmup_steps if s.warmup_steps is not None else "the base config's",
         args.warmup, f"{scale.warmup_fraction:g} of the batches" if not s.base_config
         else "base config"),
        ("checkpoint every", s.checkpoint_every, args.checkpoint_every,
         "scale, in proportion to the batches" if scale.checkpoint_every else "batches / 4"),
        ("eval every", s.eval_every, args.eval_every, f"batches / {EVAL_POINTS}"),
        ("logging every", scale.logging_interval, None, "scale"),
        ("seq_len", s.seq_len, args.seq_len, "scale"),
        ("global batch", s.global_batch, args.global_batch, "scale"),
        ("micro batch", s.micro_batch, args.micro_batch, "scale"),
        ("intra-op threads per arm", s.threads, args.threads, threads_from),
    ]
    said = ", ".join(f"{name} {value} ({'flag' if given is not None else source})"
                     for name, value, given, source in rows)
    return f"--scale {scale.name} with {s.batches} batches sets: {said}"


def _check_trainer_settings(settings: Settings, arms: list) -> None:
    """Every arm's trainer arguments (the scale's, --base-config, --set, the model) load as a
    valid run config here, before any arm trains: a bad --set fails at once, not in the first
    trainer launch."""
    from megabeta.ablate.runner import trainer_args
    from megabeta.config import load_config

    for arm in arms:
        args = trainer_args(settings, arm, settings.seeds[0], settings.out / "runs" / "check")
        config_file = next((a.partition("=")[2] for a in args if a.startswith("--config=")),
                           None)
        try:
            load_config(config_file, [a for a in args if not a.startswith("--config=")])
        except ConfigError as err:
            raise AblationError(f"arm {arm.name}: its trainer settings (the scale's, "
                                f"--base-config, --set) are not a valid run config: {err}") \
                from None


def _device(given: str | None) -> str:
    if given:
        return given
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _print_arms(arms, reference: str, vocab: int | None, say=print) -> None:
    width = max(len(a.name) for a in arms)
    ref = next(a for a in arms if a.name == reference).parameters(vocab)
    say(f"{'arm':<{width}}  {'arch':<8} {'d':>4} {'L':>3} {'hidden':>6} {'k':>2} {'s':>2} "
        f"{'c':>5} {'params':>11} {'vs ref':>8}")
    for arm in arms:
        m = arm.model
        count = arm.parameters(vocab)
        say(f"{arm.name:<{width}}  {m.arch:<8} {m.d_model:>4} {m.num_layers:>3} "
            f"{m.hidden_dim:>6} {m.depth_window:>2} {m.depth_stride:>2} {m.block_size:>5} "
            f"{count:>11,} {(count - ref) / ref:>+8.3%}"
            + ("  (reference)" if arm.name == reference else
               "  (equal parameters)" if arm.fair else ""))
    if vocab is None:
        say("(parameter counts without the embedding: the vocabulary comes from the data)")


def execute(settings: Settings, arms, reference: str, header: dict[str, Any], *,
            stop_after: int = 0, command: str = "", say=print) -> int:
    """Run every arm-seed (seed-major: all arms of seed 1 first), then write the summary."""
    out = settings.out
    out.mkdir(parents=True, exist_ok=True)
    lock = open(out / ".lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise AblationError(f"--out {out}: another `megabeta ablate` is running there; wait "
                            "for it or choose another --out") from None
    try:
        write_json_atomic(out / "ablation.json", {
            "header": header, "command": command, "settings": settings.describe(),
            "reference": reference,
            "arms": [{"name": a.name, "source": a.source, "fair": a.fair,
                      "model": dataclasses.asdict(a.model)} for a in arms]})
        runs = [(arm, seed) for seed in settings.seeds for arm in arms]
        import torch  # the evaluation runs here, with the arms' threads

        torch.set_num_threads(settings.threads)
        # Opened (datasets, tokenizer, task files checked) before the first arm trains.
        evaluator = Evaluator(settings, max_seq_len=min(a.model.max_seq_len for a in arms))

        results, trained, status = [], 0, 0
        started = time.perf_counter()

        stopped: list[int] = []

        def stop(signum: int, frame: Any) -> None:  # between runs (the runner handles its own)
            stopped.append(signum)
            raise Interrupted(f"stopped by signal {signal.Signals(signum).name}")

        previous = signal.signal(signal.SIGTERM, stop)
        try:
            for index, (arm, seed) in enumerate(runs, 1):
                if stop_after and trained >= stop_after:
                    say(f"stopping after {trained} trained run(s) (--stop-after); rerun the same "
                        "command to continue")
                    break
                say(f"[{index}/{len(runs)}] {arm.name} seed {seed} "
                    f"-> {out / 'runs' / run_name(arm.name, seed)}")
                result, done_before = run_one(settings, arm, seed, evaluator, say=say)
                if stopped:  # raised where Python ignores exceptions (a finaliser): stop here
                    raise Interrupted(f"stopped by signal {signal.Signals(stopped[0]).name}")
                trained += not done_before
                results.append(result)
                say(f"  {'done before' if done_before else 'done'}: test loss "
                    f"{result['test']['loss']:.4f}"
                    + (f", accuracy {result['accuracy']:.3f}" if result.get("accuracy")
                       is not None else f", ppl {result['test']['ppl']:.2f}")
                    + (f", {result['train']['s_per_batch']:.3f} s/batch"
                       if result["train"]["s_per_batch"] else ""))
        except (Interrupted, KeyboardInterrupt) as err:
            say(f"interrupted: {err or 'Ctrl-C'}; rerun the same command to continue")
            status = 130
        finally:
            signal.signal(signal.SIGTERM, previous)
        header = {**header, "runs done": f"{len(results)} of {len(runs)}",
                  "this invocation": f"{time.perf_counter() - started:.0f} s"}
        if results:
            rows = summarize(results, [a.name for a in arms], reference)
            paths = write_summary(out, rows, header, results)
            try:
                paths.append(write_plot(out, rows, results, title=header.get("suite", "")))
            except MissingExtra as err:
                say(f"note: summary.png not written: {err}")
            say(paths[0].read_text(encoding="utf-8"))
            say("wrote " + ", ".join(str(p) for p in paths)
                + f"; tensorboard --logdir {out / 'runs'}")
        return status
    finally:
        lock.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        settings, arms, reference, header = plan(args)
        print(f"scale {header['scale']}")
        _print_arms(arms, reference, header["vocabulary"]
                    if isinstance(header["vocabulary"], int) else None)
        if args.plan:
            from megabeta.ablate.runner import trainer_args

            arm = arms[0]
            run_dir = settings.out / "runs" / run_name(arm.name, settings.seeds[0])
            print(f"\n{len(arms) * len(settings.seeds)} runs of {settings.batches} batches; the "
                  f"first one:\n  {sys.executable} -m megabeta.train "
                  + " ".join(shlex.quote(a) for a in trainer_args(settings, arm,
                                                                   settings.seeds[0], run_dir)))
            return 0
        return execute(settings, arms, reference, header, stop_after=args.stop_after,
                       command="megabeta ablate " + " ".join(shlex.quote(a) for a in argv))
    except (AblationError, ConfigError, DataError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["main", "build_parser", "plan", "execute"]
