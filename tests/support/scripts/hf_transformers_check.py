"""Load a `megabeta export --format hf` folder with the transformers on the path and check it
against what megabeta computed (a file of expectations), in a process of its own:

    python hf_transformers_check.py FOLDER EXPECTED.pt MAJOR

MAJOR: the transformers major version that must be the one imported. Checks: the causal LM loads
with trust_remote_code=True in float32 and bfloat16; float32 logits within 1e-5 of megabeta's;
prefill of a prompt ending mid-block then token-by-token decoding through the model's cache
equals one forward; greedy generate() gives megabeta's tokens; AutoTokenizer gives megabeta's
ids. Prints one line per check; exits non-zero on the first failure.
"""

from __future__ import annotations

import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer


def main(folder: str, expected_file: str, major: str) -> None:
    expected = torch.load(expected_file, weights_only=True)
    assert transformers.__version__.split(".")[0] == major, transformers.__version__
    print(f"transformers {transformers.__version__}")
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert next(model.parameters()).dtype == torch.float32
    tokens = expected["tokens"]
    with torch.no_grad():
        logits = model(tokens).logits
        error = (logits - expected["logits"]).abs().max().item()
        assert error < 1e-5, f"float32 logits differ from megabeta's by {error}"
        print(f"logits: max difference {error:.2e}")
        prompt = expected["prompt_length"]
        out = model(tokens[:, :prompt], use_cache=True)
        pieces, cache = [out.logits], out.get("past_key_values", out.get("cache"))
        for i in range(prompt, tokens.shape[1]):
            out = model(tokens[:, i:i + 1], past_key_values=cache, use_cache=True)
            pieces.append(out.logits)
            cache = out.get("past_key_values", out.get("cache"))
        error = (torch.cat(pieces, dim=1) - logits).abs().max().item()
        assert error < 1e-5, f"prefill + decoding differs from one forward by {error}"
        print(f"prefill {prompt} + decoding: max difference {error:.2e}")
    generated = model.generate(expected["generate_prompt"], max_new_tokens=expected[
        "generated"].shape[1], do_sample=False, eos_token_id=None)
    new = generated[:, expected["generate_prompt"].shape[1]:]
    assert torch.equal(new, expected["generated"]), (new, expected["generated"])
    print(f"generate: {new.shape[1]} greedy tokens as megabeta's")
    half = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True,
                                                dtype=torch.bfloat16)
    assert next(half.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        gap = (half(tokens).logits.float() - expected["logits"]).abs().max().item()
    assert gap < 0.02 * expected["logits"].abs().max().item(), gap
    print(f"bfloat16: max difference {gap:.2e}")
    for kwargs in ({}, {"trust_remote_code": True}):
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
        for text, ids in zip(expected["texts"], expected["ids"]):
            assert tokenizer(text).input_ids == ids, (text, tokenizer(text).input_ids, ids)
        assert tokenizer.eos_token_id == expected["eos_id"]
    print(f"tokenizer: {len(expected['texts'])} texts as megabeta's ids")
    print("ok")


if __name__ == "__main__":
    main(*sys.argv[1:])
