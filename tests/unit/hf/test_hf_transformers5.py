"""Issue 45, item 2: the folder loads and computes megabeta's function on the newest
transformers 5.x as on the 4.x of the venv (whose lm-eval needs transformers < 5).

transformers 5 is installed apart, like the oldest triton (make test: `pip install --target
.venv/transformers-5`, tests/support/scripts/install_apart.py), and the check runs in a child
Python that imports it first (tests/support/scripts/hf_transformers_check.py): model in float32
and bfloat16, logits, prefill plus decoding through the cache, greedy generate(), AutoTokenizer.
Without that folder the 5.x case skips, unless MEGABETA_REQUIRE_TRANSFORMERS5=1 (CI) makes it
fail. The same check runs on the venv's 4.x, so that it is known to pass where it should.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from support import SCRIPTS
from support.hf_helpers import TRANSFORMERS5, child_env, export_folder, greedy
from support.model_helpers import tiny_model, tokens

from data_tools.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def checked(tokenizer_files, tmp_path_factory):
    """(folder, expectations file) of a tiny model with the sentencepiece tokenizer."""
    root = tmp_path_factory.mktemp("hf_transformers5")
    model = tiny_model(torch.float32, vocab_size=320, max_seq_len=64, block_size=4,
                       num_kv_heads=2, deep_token_window=3).eval()
    folder = export_folder(model, tokenizer_files["sp_unigram"], root)
    tokenizer = load_tokenizer(tokenizer_files["sp_unigram"])
    x = tokens(2, 21, seed=4)
    # Ids from 4 on: generate() takes a prompt's pad ids (0 here) for padding.
    prompt = tokens(1, 6, seed=9) % 30 + 4
    texts = ["alpha beta gamma", "  indented\n\tcode(x) = 42", "unicode: café 🙂"]
    with torch.no_grad():
        expected = {"tokens": x, "logits": model(x), "prompt_length": 7,
                    "generate_prompt": prompt,
                    "generated": torch.tensor([greedy(model, prompt[0], 15)]),
                    "texts": texts, "ids": [tokenizer.encode(t).tolist() for t in texts],
                    "eos_id": tokenizer.eos_id}
    torch.save(expected, root / "expected.pt")
    return folder, root / "expected.pt"


def _run(folder, expected, major: str, env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, str(SCRIPTS / "hf_transformers_check.py"),
                           str(folder), str(expected), major], capture_output=True, text=True,
                          env=env, stdin=subprocess.DEVNULL, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.rstrip().endswith("ok"), done.stdout
    return done.stdout


def test_the_folder_runs_on_the_newest_transformers_5(checked):
    if not TRANSFORMERS5.is_dir():
        # CI sets MEGABETA_REQUIRE_TRANSFORMERS5: there a missing install fails, not skips.
        message = f"transformers 5 is not installed at {TRANSFORMERS5} (make test installs it)"
        if os.environ.get("MEGABETA_REQUIRE_TRANSFORMERS5") == "1":
            pytest.fail(message)
        pytest.skip(message)
    stdout = _run(*checked, "5", child_env(TRANSFORMERS5))
    assert stdout.startswith("transformers 5.")


def test_the_same_check_on_the_venvs_transformers_4(checked):
    stdout = _run(*checked, "4", child_env())
    assert stdout.startswith("transformers 4.")


def test_the_check_fails_on_a_model_that_differs(checked, tmp_path):
    """The child's comparisons can fail: expectations of other weights are refused."""
    folder, expected_file = checked
    expected = torch.load(expected_file, weights_only=True)
    expected["logits"] = expected["logits"] + 1e-3
    torch.save(expected, tmp_path / "wrong.pt")
    done = subprocess.run([sys.executable, str(SCRIPTS / "hf_transformers_check.py"),
                           str(folder), str(tmp_path / "wrong.pt"), "4"], capture_output=True,
                          text=True, env=child_env(), stdin=subprocess.DEVNULL, timeout=600)
    assert done.returncode != 0 and "differ from megabeta's" in done.stderr
