"""The transformers model of a `megabeta export --format hf` folder on a CUDA GPU
(megabeta/hf/modeling_beta12.py): float32 logits against the float64 CPU ones of megabeta's model,
prefill plus decoding through its cache against its own forward, greedy `generate()` against
megabeta's greedy tokens, and bfloat16 near float32."""

from __future__ import annotations

import importlib.util
import pytest
import torch

from support.hf_helpers import greedy, hf_model
from support.model_helpers import tiny_model, tokens

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device (pytest -m gpu tests runs on a GPU)"),
    pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers (megabeta[eval]) is not installed")]

CUDA = torch.device("cuda")
CASES = {"default": {}, "gqa_deep_window": dict(num_kv_heads=2, deep_token_window=2,
                                                block_size=4),
         "standard": dict(arch="standard")}


@pytest.mark.parametrize("case", CASES)
def test_transformers_model_on_cuda(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Against float64: TF32 products would be a 1e-3 error of their own.
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = tiny_model(torch.float64, attention="reference", **CASES[case]).eval()
    x = tokens(2, 19)
    with torch.no_grad():
        want = model(x)
    hf = hf_model(model.float()).to(CUDA)
    with torch.no_grad():
        logits = hf(x.to(CUDA)).logits
        out = hf(x[:, :5].to(CUDA), use_cache=True)
        pieces, cache = [out.logits], out.get("past_key_values", out.get("cache"))
        for i in range(5, 19):
            out = hf(x[:, i:i + 1].to(CUDA), past_key_values=cache, use_cache=True)
            pieces.append(out.logits)
            cache = out.get("past_key_values", out.get("cache"))
        decoded = torch.cat(pieces, dim=1)
        half = hf_model(model.float()).to(CUDA, torch.bfloat16)(x.to(CUDA)).logits
    assert (logits.double().cpu() - want).abs().max().item() < 1e-5
    assert (decoded - logits).abs().max().item() < 1e-5
    assert (half.float().cpu() - want.float()).abs().max() < 0.02 * want.abs().max()
    prompt = tokens(1, 6, seed=2)[0] % 30 + 4
    new = hf.generate(prompt[None].to(CUDA), max_new_tokens=10, do_sample=False,
                      eos_token_id=None, pad_token_id=0)[0, 6:].cpu().tolist()
    assert new == greedy(model.float(), prompt, 10)
