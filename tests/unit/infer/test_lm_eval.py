"""Issue 32, items 1-2: the lm-evaluation-harness model for megabeta and `megabeta eval --lm-eval`.

Exactness against a naive reference written here: a request's log-likelihood is the sum of the
log-softmax of the model's own logits over the continuation (one unpadded forward pass per
request), contexts longer than the window cut from the left; a rolling log-likelihood scores every
token once, each from the window of up to max_seq_len tokens before it (the first from the EOS);
greedy generation is the argmax decoded token by token without the cache, cut at the stop
sequence. Neither depends on the batch size. The CLI runs the real harness on task definitions of
the project's own over local JSONL files (tests/lm_eval_helpers.py): no network.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from support.lm_eval_helpers import TASKS, write_tasks
from support.model_helpers import tiny_model
from safetensors.torch import save_file

from data_tools.tokenizer import load_tokenizer
from megabeta.checkpoint.export import EXPORT_FORMAT
from megabeta.cli import main
from megabeta.data import file_sha256
from megabeta.infer.lm_eval import MegabetaLM

WINDOW = 24


class Request:
    """What the harness hands a model: `args`."""

    def __init__(self, *args) -> None:
        self.args = args


@pytest.fixture(scope="module")
def tokenizer(tiny_data):
    return load_tokenizer(tiny_data[1])


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model(torch.float64, vocab_size=tokenizer.vocab_size, max_seq_len=WINDOW,
                      block_size=4).eval()


def naive_logprobs(model, inputs: list[int]) -> torch.Tensor:
    """log p(next token) at every position of one unpadded forward pass."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([inputs]))[0], dim=-1)


TEXTS = [("alpha beta gamma", " delta"), ("model token", " layer block depth"),
         ("", " train value"),  # an empty context: the continuation follows the EOS
         (" ".join(["sample data loader"] * 12), " return import"),  # longer than the window
         ("while for if", " else")]


def test_loglikelihood_is_the_sum_of_the_models_own_logprobs(model, tokenizer):
    requests = [Request(context, continuation) for context, continuation in TEXTS]
    results = MegabetaLM(model, tokenizer, batch_size=2).loglikelihood(requests)
    eos = tokenizer.eos_id
    truncated = 0
    for (context, continuation), (logprob, greedy) in zip(TEXTS, results):
        context_ids = tokenizer.encode(context).tolist() if context else [eos]
        whole = tokenizer.encode(context + continuation).tolist() if context else None
        target = whole[len(context_ids):] if context else tokenizer.encode(continuation).tolist()
        sequence = context_ids + target
        if len(sequence) - 1 > WINDOW:
            truncated += 1
            sequence = sequence[-(WINDOW + 1):]  # cut from the left, as the HF model
        logprobs = naive_logprobs(model, sequence[:-1])
        positions = range(len(sequence) - 1 - len(target), len(sequence) - 1)
        want = sum(float(logprobs[p, t]) for p, t in zip(positions, target))
        assert logprob == pytest.approx(want, abs=1e-9, rel=0)
        assert greedy == all(int(logprobs[p].argmax()) == t for p, t in zip(positions, target))
    assert truncated == 1


def test_loglikelihood_does_not_depend_on_the_batch_size(model, tokenizer):
    requests = [Request(context, continuation) for context, continuation in TEXTS]
    one = MegabetaLM(model, tokenizer, batch_size=1).loglikelihood(requests)
    for batch_size in (2, 3, 8):
        other = MegabetaLM(model, tokenizer, batch_size=batch_size).loglikelihood(requests)
        assert [g for _, g in other] == [g for _, g in one]
        assert [l for l, _ in other] == pytest.approx([l for l, _ in one], abs=1e-10, rel=0)


def test_rolling_scores_every_token_once_from_its_window(model, tokenizer):
    texts = ["alpha beta", " ".join(["gamma delta epsilon model token"] * 9)]
    results = MegabetaLM(model, tokenizer, batch_size=3).loglikelihood_rolling(
        [Request(text) for text in texts])
    for text, total in zip(texts, results):
        sequence = [tokenizer.eos_id] + tokenizer.encode(text).tolist()
        want = 0.0
        for start in range(1, len(sequence), WINDOW):  # predicted tokens, WINDOW at a time
            end = min(start + WINDOW, len(sequence))
            first = max(0, end - 1 - WINDOW)  # as much context as fits before the last one
            logprobs = naive_logprobs(model, sequence[first:end - 1])
            want += sum(float(logprobs[j - 1 - first, sequence[j]]) for j in range(start, end))
        assert total == pytest.approx(want, abs=1e-9, rel=0)
    assert len(tokenizer.encode(texts[1])) > 2 * WINDOW  # three windows


def naive_greedy(model, tokenizer, context: str, new_tokens: int, stop: str) -> str:
    ids = tokenizer.encode(context).tolist()[-(WINDOW - new_tokens):]
    out: list[int] = []
    for _ in range(new_tokens):
        token = int(naive_logprobs(model, ids + out)[-1].argmax())
        if token == tokenizer.eos_id:
            break
        out.append(token)
    return tokenizer.decode(out).split(stop)[0]


def test_greedy_generation_with_a_stop_sequence(model, tokenizer):
    contexts = ["alpha beta", "model token layer", "alpha gamma", " ".join(["data"] * 40)]
    texts = {}
    for batch_size in (1, 4):
        lm = MegabetaLM(model, tokenizer, batch_size=batch_size)
        texts[batch_size] = lm.generate_until(
            [Request(c, {"until": [" be"], "max_gen_toks": 8, "do_sample": False})
             for c in contexts])
    assert texts[1] == texts[4]
    assert texts[1] == [naive_greedy(model, tokenizer, c, 8, " be") for c in contexts]


def test_sampled_generation_is_seeded_and_unknown_settings_are_refused(model, tokenizer):
    request = [Request("alpha beta", {"until": ["\n"], "max_gen_toks": 6, "do_sample": True,
                                      "temperature": 1.5, "top_k": 20})]
    first = MegabetaLM(model, tokenizer, seed=3).generate_until(request)
    assert MegabetaLM(model, tokenizer, seed=3).generate_until(request) == first
    with pytest.raises(ValueError, match="num_beams"):
        MegabetaLM(model, tokenizer).generate_until([Request("a", {"num_beams": 4})])


# ---- megabeta eval --lm-eval -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def exported(tiny_data, tokenizer, tmp_path_factory) -> Path:
    """A float32 export of a tiny model, recording the tokenizer (as `megabeta export` does)."""
    model = tiny_model(torch.float32, vocab_size=tokenizer.vocab_size, max_seq_len=WINDOW,
                       block_size=4)
    path = tmp_path_factory.mktemp("lm_eval_export") / "m.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path),
              metadata={"format": EXPORT_FORMAT, "model_config": json.dumps(model.config.__dict__),
                        "tokenizer": json.dumps({"path": str(tiny_data[1]),
                                                 "sha256": file_sha256(tiny_data[1])})})
    return path


def test_eval_lm_eval_runs_the_harness_and_writes_json(exported, tmp_path, capsys):
    include = write_tasks(tmp_path / "tasks")
    status = main(["eval", f"--checkpoint={exported}", "--lm-eval", ",".join(TASKS),
                   "--lm-eval-include", str(include), "--limit", "4", "--batch-size", "3",
                   "--bootstrap-iters", "0"])
    out, err = capsys.readouterr()
    assert status == 0, err
    written = exported.with_name("m.lm_eval.json")
    assert f"wrote {written}" in out
    results = json.loads(written.read_text())["results"]
    assert sorted(results) == sorted(TASKS)
    assert 0.0 <= results["mb_choice"]["acc,none"] <= 1.0
    assert results["mb_generate"]["exact_match,none"] in (0.0, 0.25, 0.5, 0.75, 1.0)
    assert results["mb_rolling"]["word_perplexity,none"] > 1.0
    for task in TASKS:
        assert task in out  # the harness's table


def refused(capsys, *argv: str) -> str:
    try:
        status = main(list(argv))
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    assert status == 2 and "Traceback" not in out + err, (status, out, err)
    return err


def test_eval_lm_eval_bad_input_is_named_before_the_model_loads(exported, tmp_path, capsys):
    include = write_tasks(tmp_path / "tasks")
    nowhere = str(tmp_path / "no_model.safetensors")  # never read: the tasks fail first
    err = refused(capsys, "eval", f"--checkpoint={nowhere}", "--lm-eval", "mb_choice,mb_chioce",
                  "--lm-eval-include", str(include))
    assert "--lm-eval: unknown lm-eval task(s) mb_chioce (did you mean mb_choice" in err
    err = refused(capsys, "eval", f"--checkpoint={nowhere}", "--lm-eval", "mb_choice",
                  "--lm-eval-include", str(tmp_path / "missing"))
    assert "--lm-eval-include" in err and "no such folder" in err
    assert "--limit 2.5" in refused(capsys, "eval", f"--checkpoint={exported}", "--lm-eval",
                                    "mb_choice", "--limit", "2.5")
    assert "only with --lm-eval" in refused(capsys, "eval", f"--checkpoint={exported}",
                                            "--limit", "3")
    assert "--seq-len: not used with --lm-eval" in refused(
        capsys, "eval", f"--checkpoint={exported}", "--lm-eval", "mb_choice", "--seq-len", "8")


def test_without_lm_eval_the_flag_names_the_extra(exported, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now fails
    err = refused(capsys, "eval", f"--checkpoint={exported}", "--lm-eval", "hellaswag")
    assert "--lm-eval needs lm-evaluation-harness (lm-eval), which is not installed: " \
           "pip install 'megabeta[eval]'" in err
    err = refused(capsys, "lm-eval", "--model", "megabeta", "--tasks", "hellaswag")
    assert "megabeta lm-eval needs lm-evaluation-harness (lm-eval), which is not installed: " \
           "pip install 'megabeta[eval]'" in err


# ---- the same at any batch size, bitwise ---------------------------------------------------------
def test_results_are_bitwise_the_same_at_any_batch_size(tokenizer):
    """In float32, a forward pass over a width that ends inside a block rounds the partial
    block's positions differently, and differently again in a batch (the perplexities of batch 1
    and 4 once differed in the 8th digit): batches are padded to whole blocks, so every
    request's log-likelihood and rolling sum are the same bits at any batch size. The model has
    tiny_cpu's shape (d 64, 4 heads, 2 layers, c = 16, k = 1, T = 128)."""
    model = tiny_model(torch.float32, vocab_size=tokenizer.vocab_size, d_model=64, hidden_dim=192,
                       num_heads=4, num_layers=2, block_size=16, depth_window=1,
                       max_seq_len=128).eval()
    texts = [" ".join(["alpha beta gamma delta epsilon model token"] * n) for n in range(1, 9)]
    pairs = [Request(context, continuation) for context, continuation in TEXTS]
    rolled, scored = [], []
    for batch_size in (1, 2, 3, 4, 8):
        lm = MegabetaLM(model, tokenizer, batch_size=batch_size)
        rolled.append(lm.loglikelihood_rolling([Request(text) for text in texts]))
        scored.append(lm.loglikelihood(pairs))
    assert all(r == rolled[0] for r in rolled) and all(s == scored[0] for s in scored), \
        (rolled, scored)


# ---- the harness's own command line --------------------------------------------------------------
def test_the_harness_finds_the_model_by_its_entry_point():
    """`lm_eval --model megabeta`: the package declares the model in the harness's plugin group
    `lm_eval.models`, which a harness with plugin discovery registers as a lazy placeholder
    (lm_eval.api.registry.load_plugins); looking the name up then loads the class."""
    from importlib.metadata import entry_points

    from lm_eval.api.model import LM
    from lm_eval.api.registry import Registry

    found = [ep for ep in entry_points(group="lm_eval.models") if ep.name == "megabeta"]
    assert len(found) == 1 and found[0].value == "megabeta.infer.lm_eval:MegabetaLM"
    registry = Registry("model", base_cls=LM)
    registry.register("megabeta", target=found[0])
    assert registry.get("megabeta") is MegabetaLM


def test_megabeta_lm_eval_is_the_harness_command_line(exported, tmp_path, monkeypatch, capfd):
    """`megabeta lm-eval` takes the harness's own flags, with the model registered (its path as
    `pretrained=`, which the harness names its --output_path folder after); with the harness's
    default --device (cuda:0) on a machine without CUDA the model runs on the CPU with one
    warning. Neither git's `fatal: not a git repository` (the harness's git probe, run
    outside a repository) nor the harness's warnings about a task YAML without `aggregation` or
    `higher_is_better` reach the terminal."""
    include = write_tasks(tmp_path / "tasks")
    monkeypatch.chdir(tmp_path)  # not a git repository
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    try:
        status = main(["lm-eval", "--model", "megabeta", "--model_args",
                       f"pretrained={exported}", "--tasks", "mb_choice,mb_rolling",
                       "--include_path", str(include), "--limit", "3", "--batch_size", "2",
                       "--output_path", str(tmp_path / "results")])
    except SystemExit as exit_:
        status = exit_.code
    out, err = capfd.readouterr()
    # `pretrained=` (the harness's name for the model's path) names the results' folder.
    (folder,) = (tmp_path / "results").iterdir()
    assert folder.name.endswith("m.safetensors") and list(folder.glob("results_*.json"))
    assert status in (0, None), err
    assert "mb_choice" in out and "mb_rolling" in out and "word_perplexity" in out, out
    assert err.count("no CUDA") == 1 and "running on the CPU" in err, err
    assert "not a git repository" not in err, err
    assert "is defined, but aggregation is not" not in err
    assert "is defined, but higher_is_better is not" not in err


def test_the_model_given_cuda_without_cuda_runs_on_the_cpu(exported, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    lm = MegabetaLM(str(exported), device="cuda:0")
    assert lm.device == torch.device("cpu")
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "device cuda:0" in err and "no CUDA" in err, err
