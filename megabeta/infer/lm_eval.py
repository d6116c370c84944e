"""EleutherAI's lm-evaluation-harness (`lm-eval` 0.4.x, `pip install 'megabeta[eval]'`) on
megabeta models: the harness's model class for them, registered as `megabeta`, and running the
harness's tasks on one.

beta_1.2 is not a Hugging Face architecture, so the harness cannot load it through its `hf`
model; `MegabetaLM` answers the harness's three request types with the model's own forward pass
and KV-cache decoding, as the harness's HF model does:

- `loglikelihood(context, continuation)`: context and continuation are tokenized together (the
  context's trailing spaces moved to the continuation, `TemplateLM._encode_pair`), the last
  `max_length + 1` tokens kept (contexts longer than the window are cut from the left), and the
  continuation's log-probabilities under one forward pass summed; also whether each of its
  tokens is the greedy one. Requests run longest first, `batch_size` per forward pass, right-
  padded to a whole number of blocks: the model is causal, so the padding changes no scored
  position, and since no request's scored positions then lie in a partial block, which float
  arithmetic rounds differently by width and batch, the result is the same bits at any batch
  size (where `max_seq_len` is a multiple of `block_size`, as in every shipped config).
- `loglikelihood_rolling(text)`: the text's tokens in disjoint windows of the model's context
  (the harness's `get_rolling_token_windows`; the first token predicted from the EOS, the
  document separator megabeta's data is tokenized with), their log-likelihoods summed.
- `generate_until(context, gen_kwargs)`: `megabeta.infer.generate` from the last
  `max_length - max_gen_toks` context tokens, greedy unless `do_sample` (then `temperature`,
  `top_k`, `top_p`), ended at the first stop sequence (`until`) or EOS; requests of the same
  context length and settings are batched; the prompt's last block may be partial, so a
  greedy choice between tokens whose logits tie within float rounding may differ by batch size.

`import megabeta.infer.lm_eval` registers the class as `megabeta`, and the package declares it in
the harness's plugin group `lm_eval.models` (pyproject.toml), which a harness with plugin
discovery reads for `lm_eval --model megabeta`; lm-eval 0.4.13 has none, and `megabeta lm-eval`
is its command line with the class registered (`megabeta.infer.cli.lm_eval_main`). Python:
`lm_eval.simple_evaluate(model="megabeta", model_args="checkpoint=m.safetensors", tasks=[...])`.
`megabeta eval --lm-eval TASKS` and the trainer's `eval.lm_eval_tasks` use `run_tasks`.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lm_eval import utils as harness_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.tasks import TaskManager

from data_tools.tokenizer import Tokenizer
from megabeta.infer.generate import generate
from megabeta.infer.loading import UsageError, load_checkpoint
from megabeta.model import DecoderLM
from megabeta.storage.durable import write_durably

GENERATION_KEYS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")
"""The `generation_kwargs` of a task that `generate_until` understands; any other is an error."""


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not str(value).isdigit() or int(value) < 1:
        raise UsageError(f"{name}={value!r}: must be a whole number >= 1")
    return int(value)


@register_model("megabeta")
class MegabetaLM(TemplateLM):
    """A megabeta model as the harness sees it.

    `checkpoint` (or `pretrained`, the harness's name for it): an export (.safetensors) or
    checkpoint directory, or a loaded model;
    `tokenizer`: its tokenizer file (default: the one recorded with the checkpoint, which another
    one may replace only with `force_tokenizer`), or a loaded `Tokenizer` (required with a loaded
    model). `batch_size`: requests per forward pass (a number; the result is the same for any).
    `device`: where a loaded checkpoint runs (default: cuda when available; a CUDA device on a
    machine without CUDA, as the harness's command line asks by default, runs on the CPU with a
    warning). `seed`: of sampled generation. `max_gen_toks`: new tokens when a task sets none.
    """

    def __init__(self, checkpoint: str | DecoderLM = "", tokenizer: str | Tokenizer = "",
                 force_tokenizer: bool = False, batch_size: int | str | None = 8,
                 max_batch_size: int | None = None, device: str | None = None,
                 seed: int = 1234, max_gen_toks: int = 256, pretrained: str = "") -> None:
        super().__init__()
        if pretrained:
            # The harness's usual name for the model's path, from which its --output_path
            # names the results' folder (with `checkpoint=` it draws a random name).
            if checkpoint:
                raise UsageError("model_args: checkpoint= and pretrained= name the same thing; "
                                 "give one")
            checkpoint = pretrained
        del max_batch_size  # the harness passes it for batch_size "auto", which is not offered
        self.batch_size = _positive_int("batch_size", 8 if batch_size is None else batch_size)
        self.max_gen_toks = _positive_int("max_gen_toks", max_gen_toks)
        self.seed = int(seed)
        if isinstance(checkpoint, DecoderLM):
            if not isinstance(tokenizer, Tokenizer):
                raise UsageError("a loaded model needs its loaded Tokenizer (tokenizer=...)")
            self.model, self.tokenizer = checkpoint, tokenizer
        else:
            if not checkpoint:
                raise UsageError("model_args: checkpoint=PATH is required (an export "
                                 ".safetensors or a checkpoint directory)")
            self.model, self.tokenizer = load_checkpoint(
                str(checkpoint), tokenizer=str(tokenizer), force_tokenizer=force_tokenizer,
                device=run_device(device))
        if self.tokenizer.eos_id < 0:
            raise UsageError(f"tokenizer {self.tokenizer.info.path} has no end-of-text token; "
                             "the harness's requests start from it (pass the tokenizer the model "
                             "was trained with)")
        self._device = next(self.model.parameters()).device

    @property
    def device(self) -> torch.device:
        """Where the model runs (a read-only property of the harness's LM from lm-eval 0.4.10)."""
        return self._device

    # ---- what TemplateLM asks for ----------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self.model.config.max_seq_len

    def tok_encode(self, string: str, **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(string).tolist()

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    # ---- log-likelihoods -------------------------------------------------------------------------
    @torch.no_grad()
    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), all tokens greedy) per (cache key, context
        tokens, continuation tokens), in the order given."""
        rows = []
        for _, context, continuation in requests:
            if not continuation:
                raise ValueError("a loglikelihood request with an empty continuation: nothing "
                                 "to score")
            if len(continuation) > self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens, more than the "
                                 f"model's context ({self.max_length})")
            # The window's last max_length inputs; token i + 1 is predicted at position i.
            inputs = (list(context) + list(continuation))[-(self.max_length + 1):][:-1]
            rows.append((inputs, list(continuation)))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        block = self.model.config.block_size
        for batch in self._longest_first(range(len(rows)), lambda i: len(rows[i][0])):
            # Whole blocks (at most the model's context): no scored position in a partial block.
            longest = max(len(rows[i][0]) for i in batch)
            width = min(-(-longest // block) * block, max(self.max_length, longest))
            inputs = torch.full((len(batch), width), max(self.tokenizer.pad_id, 0),
                                dtype=torch.long)
            for row, index in enumerate(batch):
                inputs[row, :len(rows[index][0])] = torch.tensor(rows[index][0])
            logits = self.model(inputs.to(self.device))
            # At least float32 for the softmax (the model may run in bf16).
            logprobs = torch.log_softmax(
                logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
            for row, index in enumerate(batch):
                tokens, continuation = rows[index]
                target = torch.tensor(continuation, device=self.device)
                scored = logprobs[row, len(tokens) - len(continuation):len(tokens)]
                results[index] = (float(scored.gather(-1, target[:, None]).sum()),
                                  bool((scored.argmax(dim=-1) == target).all()))
        for (key, _, _), result in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            for window in harness_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1):
                windows.append((None, *harness_utils.make_disjoint_window(window)))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # ---- generation ------------------------------------------------------------------------------
    def _generation_settings(self, gen_kwargs: dict) -> tuple[tuple[str, ...], int, float,
                                                              int | None, float | None]:
        """(stop sequences, new tokens, temperature (0 = greedy), top_k, top_p) of a request."""
        unknown = sorted(set(gen_kwargs) - set(GENERATION_KEYS))
        if unknown:
            raise ValueError(f"generation_kwargs {', '.join(unknown)}: not supported by the "
                             f"megabeta model (it understands {', '.join(GENERATION_KEYS)})")
        until = gen_kwargs.get("until") or ()
        until = (until,) if isinstance(until, str) else tuple(until)
        new_tokens = _positive_int("max_gen_toks", gen_kwargs.get("max_gen_toks",
                                                                  self.max_gen_toks))
        sample = bool(gen_kwargs.get("do_sample", False))
        temperature = float(gen_kwargs.get("temperature", 1.0)) if sample else 0.0
        top_k = gen_kwargs.get("top_k") if sample else None
        top_p = gen_kwargs.get("top_p") if sample else None
        return until, new_tokens, temperature, top_k, (None if top_p is None else float(top_p))

    @torch.no_grad()
    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        prepared = []
        for context, gen_kwargs in (request.args for request in requests):
            until, new_tokens, temperature, top_k, top_p = self._generation_settings(gen_kwargs)
            # Room for the new tokens; the context cut from the left, as the harness's HF model.
            new_tokens = min(new_tokens, self.max_length - 1)
            tokens = self.tok_encode(context)[-(self.max_length - new_tokens):] or [
                self.prefix_token_id]
            prepared.append((tokens, (until, new_tokens, temperature, top_k, top_p)))
        results = [""] * len(prepared)
        # Only prompts of one length batch together: the cache has no padding.
        groups: dict[tuple, list[int]] = {}
        for index, (tokens, settings) in enumerate(prepared):
            groups.setdefault((len(tokens), settings), []).append(index)
        for (length, settings), members in sorted(groups.items(), key=lambda g: -g[0][0]):
            until, new_tokens, temperature, top_k, top_p = settings
            for start in range(0, len(members), self.batch_size):
                batch = members[start:start + self.batch_size]
                prompt = torch.tensor([prepared[i][0] for i in batch], device=self.device)
                out = generate(self.model, prompt, new_tokens, temperature=temperature,
                               top_k=top_k, top_p=top_p, seed=self.seed + batch[0],
                               stop=lambda new: all(self._stopped(row, until) for row in new))
                for row, index in enumerate(batch):
                    results[index] = self._cut(out[row, length:].tolist(), until)
        for request, text in zip(requests, results):
            self.cache_hook.add_partial("generate_until", request.args, text)
        return results

    def _stopped(self, new: torch.Tensor, until: tuple[str, ...]) -> bool:
        tokens = new.tolist()
        return self.eot_token_id in tokens or any(stop in self.tok_decode(tokens)
                                                  for stop in until)

    def _cut(self, tokens: list[int], until: tuple[str, ...]) -> str:
        """The text of `tokens` before the EOS and before the first stop sequence."""
        if self.eot_token_id in tokens:
            tokens = tokens[:tokens.index(self.eot_token_id)]
        text = self.tok_decode(tokens)
        for stop in until:
            text = text.split(stop)[0]
        return text

    def _longest_first(self, indices, length) -> list[list[int]]:
        """`indices` in batches of `batch_size`, longest first (the biggest batch runs first, so
        an out-of-memory shows at once; similar lengths pad little)."""
        order = sorted(indices, key=lambda i: -length(i))
        return [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]


def run_device(given: str | None) -> str:
    """Where a checkpoint runs: `given`, else cuda when available, else the CPU. A CUDA device
    on a machine without CUDA (the harness's command line passes `--device cuda:0` unless told
    otherwise) runs on the CPU, with one warning."""
    if not given:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if given.startswith("cuda") and not torch.cuda.is_available():
        print(f"warning: device {given} asked for (the harness's --device defaults to cuda:0), "
              "but this machine has no CUDA: running on the CPU (--device cpu says so)",
              file=sys.stderr)
        return "cpu"
    return given


# ---- tasks -----------------------------------------------------------------------------------------
@dataclass
class HarnessTasks:
    """lm-eval task names checked to exist, and the task manager that knows them."""

    names: list[str]
    manager: TaskManager


def find_tasks(names: list[str], include: str = "", *, names_flag: str = "--lm-eval",
               include_flag: str = "--lm-eval-include") -> HarnessTasks:
    """The harness's tasks `names` (task, group or tag names), from the folder of YAML task
    definitions `include` and the harness's own; UsageError naming the flag for an unknown name
    or a missing folder. Indexing the harness's ~10 000 task files takes seconds: when every name
    is in `include`, they are not read."""
    names = [name.strip() for name in names if name.strip()]
    if not names:
        raise UsageError(f"{names_flag}: no task names; pass comma-separated lm-eval tasks, "
                         "e.g. hellaswag,arc_easy")
    if include and not Path(include).is_dir():
        raise UsageError(f"{include_flag} {include}: no such folder; pass the folder of your "
                         "task YAML files")
    if include:
        local = TaskManager(include_path=include, include_defaults=False)
        if all(name in local.all_tasks for name in names):
            return HarnessTasks(names, local)
    manager = TaskManager(include_path=include or None)
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, manager.all_tasks, n=3)
            hints.append(f"{name}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
        where = f" or in {include_flag} {include}" if include else (
            f"; task definitions of your own: {include_flag} FOLDER")
        raise UsageError(f"{names_flag}: unknown lm-eval task(s) {'; '.join(hints)}: not among "
                         f"the harness's tasks{where}; `lm-eval ls tasks` lists them")
    return HarnessTasks(names, manager)


def check_limit(limit: float | None, flag: str) -> float | int | None:
    """lm-eval's `limit`: None or 0 = every document, a count >= 1 (whole), or a share < 1."""
    if not limit:
        return None
    if limit < 0 or (limit >= 1 and not float(limit).is_integer()):
        raise UsageError(f"{flag} {limit}: must be a whole number of documents per task, or a "
                         "share in (0, 1)")
    return int(limit) if limit >= 1 else float(limit)


def run_tasks(lm: MegabetaLM, tasks: HarnessTasks, *, limit: float | int | None = None,
              num_fewshot: int | None = None, bootstrap_iters: int = 100000) -> dict[str, Any]:
    """The harness's results dict (`results`, `versions`, `n-shot`, `config`, ...) of `lm` on
    `tasks`. The harness seeds Python's, NumPy's and torch's global generators itself."""
    from lm_eval import simple_evaluate

    with quiet_harness():
        results = simple_evaluate(model=lm, tasks=tasks.names, task_manager=tasks.manager,
                                  limit=limit, num_fewshot=num_fewshot, log_samples=False,
                                  bootstrap_iters=bootstrap_iters)
    if results is None:  # only on ranks other than 0, which megabeta never gives the harness
        raise RuntimeError("lm-eval returned no results")
    return results


class _DefaultMetricNotes(logging.Filter):
    """Drops the harness's two warnings per metric of a task YAML that leaves out `aggregation`
    or `higher_is_better` (six for a minimal multiple-choice and perplexity task): the metric's
    registered defaults are what such a task means."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(f"is defined, but {key} is not. using default" in message
                       for key in ("aggregation", "higher_is_better"))


def _quiet_git_hash() -> str | None:
    """The harness's `get_git_commit_hash` without git's `fatal: not a git repository` on
    stderr when the working directory is not in a repository: the same probe, its stderr
    dropped, and the same fallback."""
    from lm_eval.loggers.utils import get_commit_from_path

    try:
        return subprocess.check_output(["git", "describe", "--always"],  # noqa: S607
                                       stderr=subprocess.DEVNULL).strip().decode()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return get_commit_from_path(os.getcwd())


@contextlib.contextmanager
def quiet_harness() -> Iterator[None]:
    """A harness run without its noise: git's error from the results' git probe and the
    warnings about metrics left to their defaults (both say nothing about the model)."""
    import lm_eval.evaluator as evaluator

    task_log = logging.getLogger("lm_eval.api.task")
    notes = _DefaultMetricNotes()
    probe = evaluator.get_git_commit_hash
    task_log.addFilter(notes)
    evaluator.get_git_commit_hash = _quiet_git_hash
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = probe
        task_log.removeFilter(notes)


def metric_values(results: dict[str, Any]) -> dict[str, float]:
    """`TASK/METRIC` -> value of every numeric result (groups too); standard errors left out.
    A metric under a filter other than the default `none` is `METRIC-FILTER`."""
    values: dict[str, float] = {}
    for task, metrics in {**results.get("results", {}), **results.get("groups", {})}.items():
        for key, value in metrics.items():
            metric, _, kind = key.partition(",")
            if not kind or "_stderr" in metric or isinstance(value, bool) or not isinstance(
                    value, (int, float)):
                continue
            values[f"{task}/{metric if kind == 'none' else f'{metric}-{kind}'}"] = float(value)
    return values


def table(results: dict[str, Any]) -> str:
    """The harness's own table of `results` (and of its groups)."""
    text = harness_utils.make_table(results)
    if results.get("groups"):
        text += "\n" + harness_utils.make_table(results, "groups")
    return text


def write_results(results: dict[str, Any], path: Path) -> Path:
    """`results` as JSON (the harness's encoding of what is not JSON), written atomically and
    durably."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_durably(path, (json.dumps(results, indent=2,
                                    default=harness_utils.handle_non_serializable,
                                    ensure_ascii=False) + "\n").encode("utf-8"))
    return path


__all__ = ["MegabetaLM", "HarnessTasks", "find_tasks", "check_limit", "run_tasks",
           "metric_values", "table", "write_results", "quiet_harness", "run_device"]
