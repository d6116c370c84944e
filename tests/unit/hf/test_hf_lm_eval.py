"""Issue 45, item 4: lm-evaluation-harness's own `hf` model, loading the folder with
`trust_remote_code=True`, gives the scores `megabeta eval --lm-eval` gives on the same folder, on
local tasks of each request type (multiple choice, rolling perplexity, generation with stop
sequences: tests/support/lm_eval_helpers.py). Both run one request at a time (the `hf` model
pads a batch of prompts of different lengths, which beta_1.2 refuses: its blocks count from each
sequence's first token)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from support.hf_helpers import export_folder
from support.lm_eval_helpers import TASKS, write_tasks
from support.model_helpers import tiny_model

from megabeta.cli import main
from megabeta.infer.lm_eval import metric_values


def test_the_harness_hf_model_scores_like_megabeta_eval(tokenizer_files, tmp_path, capsys):
    import lm_eval.models  # noqa: F401 - registers `hf` (the registry is not empty: `megabeta`)
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    model = tiny_model(torch.float32, vocab_size=320, max_seq_len=48, block_size=4,
                       num_kv_heads=2, deep_token_window=3)
    folder = export_folder(model, tokenizer_files["sp_bpe"], tmp_path)
    tasks = write_tasks(tmp_path / "tasks", documents=4)
    output = tmp_path / "megabeta.json"
    assert main(["eval", "--checkpoint", str(folder), "--lm-eval", ",".join(TASKS),
                 "--lm-eval-include", str(tasks), "--batch-size", "1", "--bootstrap-iters", "0",
                 "--device", "cpu", "--lm-eval-output", str(output)]) == 0
    capsys.readouterr()
    ours = metric_values(json.loads(output.read_text()))
    theirs = metric_values(simple_evaluate(
        model="hf", model_args={"pretrained": str(folder), "trust_remote_code": True,
                                "dtype": "float32", "device": "cpu"},
        tasks=list(TASKS), task_manager=TaskManager(include_path=str(tasks),
                                                    include_defaults=False),
        batch_size=1, bootstrap_iters=0, log_samples=False))
    assert set(ours) == set(theirs) and len(ours) >= 6
    for key, value in ours.items():
        assert theirs[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert any(value not in (0.0, 1.0) for key, value in ours.items()
               if "perplexity" in key)  # the scores are real numbers, not a default


class Request:
    """What the harness hands a model: `args`."""

    def __init__(self, *args) -> None:
        self.args = args


def test_the_harness_hf_model_generates_megabetas_text(tokenizer_files, tmp_path):
    """generate_until request by request: the same continuations, stop sequences applied."""
    import lm_eval.models  # noqa: F401
    from lm_eval.api.registry import get_model

    from megabeta.infer.lm_eval import MegabetaLM

    model = tiny_model(torch.float32, vocab_size=320, max_seq_len=48, block_size=4, seed=3)
    folder = export_folder(model, tokenizer_files["sp_bpe"], tmp_path)
    theirs = get_model("hf")(pretrained=str(folder), trust_remote_code=True, dtype="float32",
                             device="cpu", batch_size=1)
    ours = MegabetaLM(str(folder), batch_size=1, device="cpu")
    requests = [Request(context, {"until": ["\n", " gamma"], "max_gen_toks": 9,
                                  "do_sample": False})
                for context in ("alpha beta", "model token layer", "x", "while for if else")]
    want = ours.generate_until(requests)
    assert theirs.generate_until(requests) == want
    assert any(text.strip() for text in want)
