"""Running an ablation: every arm-seed through the real trainer, one after another, resumable.

Layout under OUT (`--out`):

    ablation.json             the plan of the last invocation: scale, arms, models, settings
    data/                     the `state` suite's generated task data (when no --data is given)
    runs/ARM-seedS/           one trainer run directory per arm and seed (`tensorboard --logdir
        config.toml,            OUT/runs` shows every arm; the test metrics are added to each
        metrics.jsonl, tb/,     run's tb/ as test/loss, test/ppl, test/accuracy[/TASK])
        checkpoints/
        train.log             the trainer's output (appended over launches)
        ablate_run.json       the run's spec: the trainer arguments and the evaluation settings
        launches.jsonl        wall time of each trainer launch
        result.json           written atomically after the evaluation: the run is done
    summary.md, .csv, .json   (megabeta.ablate.summary)

A run whose result.json exists (with the same spec) is skipped; any other is launched with
`--resume=auto`, so a killed ablation continues from the newest checkpoint of the run it was in.
A run directory whose spec differs from the current one is an error (results of other settings
are never mixed in). The trainer is a subprocess (`python -m megabeta.train`, or torchrun with
--nproc > 1); SIGTERM/SIGINT to the ablation are passed on to it as SIGTERM, so it saves a
checkpoint before exiting, and on Linux it is sent SIGTERM if the ablation dies.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from megabeta.ablate.suites import AblationError, Arm, Scale, TaskSpec, model_overrides
from megabeta.checkpoint import CheckpointManager
from megabeta.checkpoint.export import load_model
from megabeta.data import GlobalSampler, build_train_val, file_sha256
from megabeta.infer.evaluate import evaluate
from megabeta.storage.durable import write_durably

RESULT_FORMAT = "megabeta.ablate.result"
RESULT_VERSION = 1


class Interrupted(RuntimeError):
    """The ablation was asked to stop (a signal); rerunning the same command continues it."""


@dataclass
class Settings:
    """What every arm of an ablation shares (the data, its order, the schedule, the evaluation)."""

    out: Path
    scale: Scale
    data: list[str]
    """Training dataset prefixes (absolute)."""
    tokenizer: str
    """The datasets' sentencepiece model (absolute), or "" when unknown."""
    seq_len: int
    val_fraction: float
    """data.val_fraction of the training runs (0 when the held-out set is --test-data)."""
    align: str
    document_mask: bool
    """data.document_mask of every arm (spec §7), also in the test evaluation."""
    test_data: list[str]
    """Held-out dataset prefixes; empty: the validation split of `data`."""
    task_files: list[str]
    """Held-out task files (JSONL of `megabeta tasks make`) scored for exact-match accuracy."""
    batches: int
    seeds: list[int]
    global_batch: int
    micro_batch: int
    lr: float | None
    """optim.lr; None: the base config's."""
    warmup_steps: int | None
    eval_batches: int
    """Evaluation batches of micro_batch samples; 0 = the whole held-out set."""
    checkpoint_every: int
    base_config: str | None
    extra: list[str] = field(default_factory=list)
    """--set overrides, applied to every arm last."""
    nproc: int = 1
    device: str = "cpu"
    eval_every: int = 0
    """eval.interval of the training runs: their validation loss curve (0 = at the end only)."""
    threads: int = 1
    """OMP_NUM_THREADS of each trainer (its intra-op threads); not part of a run's spec."""

    def describe(self) -> dict[str, Any]:
        plain = dataclasses.asdict(self)
        plain["out"] = str(self.out)
        plain["scale"] = self.scale.name
        return plain


def run_name(arm: str, seed: int) -> str:
    return f"{re.sub(r'[^A-Za-z0-9._-]', '_', arm)}-seed{seed}"


def trainer_args(settings: Settings, arm: Arm, seed: int, run_dir: Path) -> list[str]:
    """The `megabeta train` arguments of one arm-seed run."""
    s = settings
    args: list[str] = []
    if s.base_config:
        args.append(f"--config={s.base_config}")
    else:
        args += list(s.scale.trainer_defaults)
    if s.lr is not None:
        args.append(f"--optim.lr={s.lr}")
    if s.warmup_steps is not None:
        args.append(f"--schedule.warmup_steps={s.warmup_steps}")
    args += model_overrides(arm.model)
    if arm.block_size_schedule:
        args.append("--train.block_size_schedule="
                    + json.dumps([list(stage) for stage in arm.block_size_schedule]))
    args += [f"--run_dir={run_dir}", "--resume=auto",
             f"--data.path={','.join(s.data)}", f"--data.seq_len={s.seq_len}",
             f"--data.val_fraction={s.val_fraction}", f"--data.align={s.align}",
             f"--data.document_mask={str(s.document_mask).lower()}",
             f"--train.steps={s.batches}", f"--train.seed={seed}",
             f"--train.global_batch={s.global_batch}", f"--train.micro_batch={s.micro_batch}",
             "--train.exit_after=0", "--schedule.total_steps=0",
             f"--eval.interval={s.eval_every}", f"--eval.batches={s.eval_batches}",
             f"--checkpoint.interval={s.checkpoint_every}", "--checkpoint.keep=2",
             "--checkpoint.save_at_end=true",
             f"--logging.interval={s.scale.logging_interval}", "--logging.tensorboard=true"]
    if s.tokenizer:
        args.append(f"--data.tokenizer={s.tokenizer}")
    return args + list(s.extra)


def run_spec(settings: Settings, arm: Arm, seed: int, run_dir: Path) -> dict[str, Any]:
    """What defines a run's result: compared with the spec a run directory was started with."""
    s = settings
    return {"arm": arm.name, "seed": seed, "trainer_args": trainer_args(s, arm, seed, run_dir),
            "evaluation": {"test_data": s.test_data, "task_files": s.task_files,
                           "eval_batches": s.eval_batches, "batch_size": s.micro_batch}}


# ---- small file helpers ---------------------------------------------------------------------------
def write_json_atomic(path: Path, obj: Any) -> None:
    """Write `obj` as JSON under `path`, atomically and durably."""
    write_durably(path, json.dumps(obj, indent=2, allow_nan=False, default=_jsonable) + "\n")


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {value!r}")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise AblationError(f"{path}: unreadable ({err}); delete it to redo that run") from None


def _spec_difference(old: dict[str, Any], new: dict[str, Any]) -> str:
    old_args = dict(a.partition("=")[::2] for a in old.get("trainer_args", []))
    new_args = dict(a.partition("=")[::2] for a in new.get("trainer_args", []))
    diffs = [f"{k}: {old_args.get(k, '(unset)')} -> {new_args.get(k, '(unset)')}"
             for k in sorted(old_args.keys() | new_args.keys())
             if old_args.get(k) != new_args.get(k)]
    if old.get("evaluation") != new.get("evaluation"):
        diffs.append(f"evaluation: {old.get('evaluation')} -> {new.get('evaluation')}")
    return "; ".join(diffs[:6]) + (" ..." if len(diffs) > 6 else "")


# ---- metrics --------------------------------------------------------------------------------------
def _logged(run_dir: Path) -> tuple[dict[int, dict], dict[int, dict], dict[int, dict]]:
    """The trainer's metrics.jsonl records of training steps, of its evaluations on the
    validation split (loss) and of beta_1.2's dials, each by step: the last one of a step,
    should a resumed launch repeat steps."""
    path = run_dir / "metrics.jsonl"
    steps: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    dials: dict[int, dict] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
            if "step" not in record:
                continue
            if "split" not in record:
                steps[int(record["step"])] = record
            elif record["split"] == "eval" and "loss" in record:
                evals[int(record["step"])] = record
            elif record["split"] == "dials":
                dials[int(record["step"])] = record
    return steps, evals, dials


def read_train_metrics(run_dir: Path) -> dict[str, Any]:
    """Timing and final loss from the trainer's metrics.jsonl: the training records, the first
    logged step left out of the timing (it includes the warm-up of kernels and allocator) when
    there are others. s_per_batch is their mean; tokens_per_s = global_batch x seq_len / that
    mean."""
    by_step, _, _ = _logged(run_dir)
    records = [by_step[k] for k in sorted(by_step)]
    if not records:
        return {"final_loss": None, "s_per_batch": None, "tokens_per_s": None, "steps_timed": 0}
    timed = records[1:] if len(records) > 1 else records
    seconds = sum(r["s_per_batch"] for r in timed) / len(timed)
    tokens_per_batch = records[-1]["tokens_per_s"] * records[-1]["s_per_batch"]
    return {"final_loss": records[-1]["loss"], "s_per_batch": seconds,
            "tokens_per_s": tokens_per_batch / seconds, "steps_timed": len(timed)}


def read_curves(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) in step order, non-finite values left out: the loss of the run's training
    steps (`train`) and of its validation evaluations (`eval`), and the mean over layers of the
    finished values' cosine between positions (`value_cosine`, beta_1.2's dials; empty for
    the other arms)."""
    steps, evals, dials = _logged(run_dir)
    curves = {name: [(step, float(records[step]["loss"])) for step in sorted(records)
                     if _finite(records[step]["loss"]) is not None]
              for name, records in (("train", steps), ("eval", evals))}
    cosine = []
    for step in sorted(dials):
        layers = [value for key, value in dials[step].items()
                  if key.startswith("diversity/") and key.endswith("/value_cosine")
                  and _finite(value) is not None]
        if layers:
            cosine.append((step, sum(layers) / len(layers)))
    curves["value_cosine"] = cosine
    return curves


def _finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


# ---- one run --------------------------------------------------------------------------------------
def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Linux: the trainer gets SIGTERM (and saves) should the ablation process die."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _trainer_command(settings: Settings, args: list[str]) -> list[str]:
    if settings.nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={settings.nproc}", "-m", "megabeta.train", *args]
    return [sys.executable, "-m", "megabeta.train", *args]


def launch_trainer(settings: Settings, args: list[str], run_dir: Path) -> float:
    """Run the trainer to its end; returns its wall seconds. Interrupted when a signal stopped
    it (after it saved), AblationError (with the end of its log) when it failed."""
    log_path = run_dir / "train.log"
    command = _trainer_command(settings, args)
    received: list[int] = []
    start = time.perf_counter()
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"\n# {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n")
        log.flush()
        process: subprocess.Popen | None = None

        def forward(signum: int, frame: Any) -> None:
            received.append(signum)
            if process is not None:
                _pass_on(process, received)

        # Installed before the fork: a signal raised as an exception during it would land in
        # an at-fork callback, where Python ignores exceptions, and the trainer would run on.
        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "OMP_NUM_THREADS": str(settings.threads)},
                preexec_fn=_die_with_parent if sys.platform == "linux" else None)
            if received:  # signalled while it started
                _pass_on(process, received)
            code = process.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    wall = time.perf_counter() - start
    with open(run_dir / "launches.jsonl", "a", encoding="utf-8") as stream:
        stream.write(json.dumps({"wall_s": wall, "returncode": code}) + "\n")
    if received:
        raise Interrupted(f"stopped by signal {signal.Signals(received[0]).name} while training "
                          f"{run_dir.name} (its newest checkpoint is kept)")
    if code != 0:
        tail = "\n".join(log_path.read_text(encoding="utf-8", errors="replace")
                         .splitlines()[-15:])
        raise AblationError(f"{run_dir.name}: the trainer exited with status {code}; the end of "
                            f"{log_path}:\n{tail}")
    return wall


def _pass_on(process: subprocess.Popen, received: list[int]) -> None:
    """The first signal asks the trainer to save and stop; a second one kills it."""
    process.send_signal(signal.SIGTERM if len(received) == 1 else signal.SIGKILL)


def _final_checkpoint(run_dir: Path, steps: int) -> Path | None:
    """The run's newest usable checkpoint when it is at `steps`, else None."""
    found = CheckpointManager(run_dir, keep=2).resolve("auto") if (
        run_dir / "checkpoints").is_dir() else None
    if found is None:
        return None
    path, state = found
    return path if state.step >= steps else None


class Evaluator:
    """The held-out evaluation every arm gets: loss (and perplexity) on the same samples, and the
    task accuracy on the same task files. Datasets, the tokenizer and the task files are opened
    and checked once, before any arm trains: a task document longer than the arms' context
    (`max_seq_len`, the smallest of them) is an error then, not after the training."""

    def __init__(self, settings: Settings, max_seq_len: int) -> None:
        self.settings = settings
        s = settings
        expected = file_sha256(s.tokenizer) if s.tokenizer else None
        if s.test_data:
            data = build_train_val(s.test_data, None, seq_len=s.seq_len, val_fraction=0.0,
                                   expected_tokenizer_hash=expected, align=s.align,
                                   document_mask=s.document_mask)
            self.dataset = data.train
            self.sampler: Callable[[], GlobalSampler] = lambda: GlobalSampler(
                len(self.dataset), shuffle=False, num_epochs=1)
            self.where = f"--test-data {','.join(s.test_data)}"
        else:
            data = build_train_val(s.data, None, seq_len=s.seq_len,
                                   val_fraction=s.val_fraction,
                                   expected_tokenizer_hash=expected, align=s.align,
                                   document_mask=s.document_mask)
            if data.val is None:
                raise AblationError(f"--val-fraction {s.val_fraction}: leaves no validation "
                                    f"documents in --data {','.join(s.data)}; raise it or pass "
                                    "--test-data")
            self.dataset = data.val
            # The trainer's own evaluation order (one rank): its eval/loss is this test/loss.
            self.sampler = lambda: data.val_sampler(1, 0)
            self.where = f"the validation split (val_fraction {s.val_fraction}) of --data"
        self.vocab_size = data.vocab_size
        self.processor = None
        self.documents = []
        if s.task_files:
            from megabeta.infer.loading import UsageError, load_model_tokenizer
            from megabeta.tasks.document import TaskFileError
            from megabeta.tasks.evaluate import read_encoded

            if not s.tokenizer:
                raise AblationError("--task-files needs the tokenizer of the data: pass "
                                    "--tokenizer MODEL (the dataset's sidecar names none that "
                                    "exists)")
            try:
                self.processor = load_model_tokenizer(s.tokenizer)
                self.documents = read_encoded(s.task_files, self.processor, max_seq_len,
                                              flag="--task-files")
            except (TaskFileError, UsageError) as err:
                raise AblationError(f"{err} (the arms' context is --seq-len, max_seq_len = "
                                    f"{max_seq_len})") from None

    def __call__(self, checkpoint: Path) -> dict[str, Any]:
        s = self.settings
        with warnings.catch_warnings():  # DCP's "assuming ... a single process": intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            model = load_model(checkpoint, device=s.device)
        loss = evaluate(model, self.dataset, self.sampler(), batch_size=s.micro_batch,
                        max_batches=s.eval_batches, device=model_device(model))
        out: dict[str, Any] = {"test": {"loss": loss["loss"], "ppl": loss["ppl"],
                                        "samples": loss["samples"],
                                        "scored_targets": loss["scored_targets"],
                                        "on": self.where}}
        if self.processor is not None:
            from megabeta.tasks.evaluate import score_encoded

            scores = list(score_encoded(model, self.documents,
                                        pad_id=max(self.processor.pad_id, 0),
                                        batch_size=s.micro_batch,
                                        device=model_device(model)).values())
            out["tasks"] = {score.task: score.as_dict() for score in scores}
            accuracies = [sc.accuracy for sc in scores if not math.isnan(sc.accuracy)]
            out["accuracy"] = sum(accuracies) / len(accuracies) if accuracies else None
        return out


def model_device(model: Any) -> Any:
    return next(model.parameters()).device


def write_test_scalars(run_dir: Path, step: int, evaluation: dict[str, Any]) -> None:
    """The test metrics as TensorBoard scalars in the run's own tb/ (the arm's TensorBoard run)."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(run_dir / "tb"))
    try:
        writer.add_scalar("test/loss", evaluation["test"]["loss"], step)
        writer.add_scalar("test/ppl", evaluation["test"]["ppl"], step)
        if evaluation.get("accuracy") is not None:
            writer.add_scalar("test/accuracy", evaluation["accuracy"], step)
        for task, score in evaluation.get("tasks", {}).items():
            if score["accuracy"] is not None:
                writer.add_scalar(f"test/accuracy/{task}", score["accuracy"], step)
    finally:
        writer.close()


def run_one(settings: Settings, arm: Arm, seed: int, evaluator: Evaluator,
            say: Callable[[str], None] = print) -> tuple[dict[str, Any], bool]:
    """Train (or resume) and evaluate one arm-seed; (its result, whether it was already done)."""
    run_dir = settings.out / "runs" / run_name(arm.name, seed)
    spec = run_spec(settings, arm, seed, run_dir)
    result_path = run_dir / "result.json"
    spec_path = run_dir / "ablate_run.json"
    if result_path.is_file():
        result = _read_json(result_path)
        if result.get("spec") != spec:
            raise AblationError(f"{run_dir}: finished with other settings "
                                f"({_spec_difference(result.get('spec', {}), spec)}); pass "
                                "another --out, or delete that directory to retrain it")
        return result, True
    if spec_path.is_file():
        old = _read_json(spec_path)
        if old != spec:
            raise AblationError(f"{run_dir}: started with other settings "
                                f"({_spec_difference(old, spec)}); pass another --out, or "
                                "delete that directory to start it afresh")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(spec_path, spec)
    checkpoint = _final_checkpoint(run_dir, settings.batches)
    if checkpoint is None:
        say(f"  training {settings.batches} batches (log: {run_dir / 'train.log'})")
        launch_trainer(settings, spec["trainer_args"], run_dir)
        checkpoint = _final_checkpoint(run_dir, settings.batches)
        if checkpoint is None:
            raise AblationError(f"{run_dir}: the trainer exited 0 without a checkpoint at step "
                                f"{settings.batches}; see {run_dir / 'train.log'}")
    else:
        say(f"  trained already ({checkpoint.name}); evaluating")
    started = time.perf_counter()
    evaluation = evaluator(checkpoint)
    eval_s = time.perf_counter() - started
    write_test_scalars(run_dir, settings.batches, evaluation)
    vocab = load_vocab(run_dir)
    launches = [json.loads(line) for line in
                (run_dir / "launches.jsonl").read_text(encoding="utf-8").splitlines()
                if line.strip()] if (run_dir / "launches.jsonl").is_file() else []
    result = {"format": RESULT_FORMAT, "format_version": RESULT_VERSION,
              "arm": arm.name, "seed": seed, "source": arm.source, "fair": arm.fair,
              "model": dataclasses.asdict(arm.model.replace(vocab_size=vocab or -1)),
              "parameters": arm.parameters(vocab),
              "non_embedding_parameters": arm.parameters(None),
              "steps": settings.batches, "checkpoint": str(checkpoint),
              **evaluation,
              "train": {**read_train_metrics(run_dir),
                        "wall_s": sum(launch["wall_s"] for launch in launches),
                        "launches": len(launches)},
              "eval_s": eval_s, "spec": spec}
    result["test"]["loss"] = _finite(result["test"]["loss"])
    result["test"]["ppl"] = _finite(result["test"]["ppl"])
    write_json_atomic(result_path, result)
    return result, False


def load_vocab(run_dir: Path) -> int | None:
    """The vocabulary size the trainer took from the data (its saved config.toml)."""
    from megabeta.config_loader import tomllib

    try:
        with open(run_dir / "config.toml", "rb") as stream:
            vocab = tomllib.load(stream).get("model", {}).get("vocab_size")
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return vocab if isinstance(vocab, int) and vocab > 0 else None


# ---- the state suite's data -----------------------------------------------------------------------
def prepare_task_data(directory: Path, tasks: tuple[TaskSpec, ...], vocab_size: int = 320,
                      say: Callable[[str], None] = print) -> dict[str, Any]:
    """Generate the task files (train and held-out test, other seeds), train a sentencepiece
    tokenizer on the training files and tokenize both with their loss masks, under `directory`;
    every step is skipped when its output exists, so a rerun reuses them. Returns the paths."""
    from data_tools.cli import main as data_main
    from megabeta.tasks.make import TASKS, generate_documents, write_task_file

    directory.mkdir(parents=True, exist_ok=True)
    manifest = {"tasks": [dataclasses.asdict(spec) for spec in tasks], "vocab_size": vocab_size,
                "seeds": "train 1000 + i, test 2000 + i for the i-th task"}
    manifest_path = directory / "manifest.json"
    if manifest_path.is_file():
        if _read_json(manifest_path) != manifest:
            raise AblationError(f"{directory}: holds task data generated with other options "
                                f"(see {manifest_path}); pass another --out, or delete that "
                                "directory to generate it again")
    else:
        write_json_atomic(manifest_path, manifest)
    train_files, test_files = [], []
    for index, spec in enumerate(tasks):
        task = TASKS[spec.task](**spec.options)
        for split, count, seed, files in (("train", spec.train, 1000 + index, train_files),
                                          ("test", spec.test, 2000 + index, test_files)):
            path = directory / f"{task.name}.{split}.jsonl"
            if not path.is_file():
                write_task_file(path, generate_documents(task, count, seed))
            files.append(str(path))
    tokenizer = directory / "tokenizer"
    if not Path(f"{tokenizer}.model").is_file():
        say(f"  training a {vocab_size}-piece tokenizer on {len(train_files)} task files")
        _data_tool(data_main, ["train-tokenizer", "--inputs", *train_files, "--vocab-size",
                               str(vocab_size), "--output", str(tokenizer), "--quiet"])
    prefixes = {}
    for split, files in (("train", train_files), ("test", test_files)):
        prefix = directory / split
        if not all(Path(f"{prefix}{ext}").is_file() for ext in (".bin", ".idx", ".mask", ".json")):
            _data_tool(data_main, ["tokenize", "--tokenizer", f"{tokenizer}.model", "--inputs",
                                   *files, "--segments-key", "segments", "--output-prefix",
                                   str(prefix), "--workers", "1", "--overwrite", "--quiet"])
        prefixes[split] = str(prefix)
    return {"train": prefixes["train"], "test": prefixes["test"], "tokenizer":
            f"{tokenizer}.model", "train_files": train_files, "test_files": test_files}


def _data_tool(main: Callable[[list[str]], int], argv: list[str]) -> None:
    code = main(argv)
    if code != 0:
        raise AblationError(f"megabeta-data {' '.join(argv[:1])} failed (status {code}) while "
                            "preparing the state suite's data; see the error above")


__all__ = ["Settings", "Evaluator", "Interrupted", "run_one", "run_name", "trainer_args",
           "read_train_metrics", "read_curves", "prepare_task_data", "write_json_atomic", "launch_trainer"]
