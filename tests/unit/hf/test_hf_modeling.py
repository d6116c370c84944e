"""Issue 45, item 4: the transformers model of a beta_1.2 folder (megabeta/hf/modeling_beta12.py,
torch and transformers only) computes megabeta's function.

Its logits equal megabeta's on the same tokens within 1e-5 in float32, for presets and flag
combinations (depth window and stride, GQA, deep-token window, self slot, layer encodings, the
standard and looped arms, documents); in float64 with unit-scale weights within 1e-10, and
against the naive literal reference of the spec (tests/reference_beta12.py). Prefill plus
token-by-token decoding through its cache equals one forward for prompts that end anywhere in a
block (spec §4.5), and greedy `generate()` gives megabeta's greedy tokens. These run on the
transformers 4.x of the venv; tests/unit/hf/test_hf_transformers5.py runs the folder on 5.x.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from reference_beta12 import reference_logits
from support.hf_helpers import greedy, hf_model
from support.model_helpers import VOCAB, randomise, tiny_model, tokens

from megabeta.model import ExecutionConfig, build_model, get_preset

REFERENCE = ExecutionConfig(attention="reference")

FLAGS = {
    "default": {},
    "k0": dict(depth_window=0),
    "k_beyond_L": dict(depth_window=5),
    "stride2": dict(depth_window=2, depth_stride=2),
    "gqa2": dict(num_kv_heads=2),
    "mqa": dict(num_kv_heads=1),
    "deep_window": dict(deep_token_window=2, block_size=4),
    "no_self_slot": dict(self_slot=False),
    "no_layer_enc": dict(layer_enc=False),
    "no_depth_bias": dict(depth_bias=False),
    "qk_norm_untied": dict(qk_norm=True, tie_embedding=False),
    "c1": dict(block_size=1),
    "theta_eps": dict(rope_theta=500.0, norm_eps=1e-5, lambda_max=4.0),
    "standard": dict(arch="standard"),
    "looped": dict(arch="looped", loops=3),
}

SHRINK = dict(vocab_size=VOCAB, d_model=64, hidden_dim=96, num_heads=4, num_kv_heads=None,
              max_seq_len=128)
PRESETS = ("t19_flash", "beta_1.2_test", "beta_1.2_c256", "t16_std_tf_rope", "beta_1.2_stride2",
           "beta_1.2_de10k6")


def _preset_model(name: str, dtype: torch.dtype):
    torch.manual_seed(0)
    config = get_preset(name, **SHRINK)
    return randomise(build_model(config, REFERENCE).to(dtype)).eval()


def _flag_model(name: str, dtype: torch.dtype, matrices: bool = False):
    model = tiny_model(dtype, attention="reference", **FLAGS[name]).eval()
    return randomise(model, matrices=matrices) if matrices else model


def _logits(model, x, **kwargs):
    with torch.no_grad():
        return model(x, **kwargs)


@pytest.mark.parametrize("name", PRESETS)
def test_presets_match_megabeta_in_float32(name):
    model = _preset_model(name, torch.float32)
    x = tokens(2, 70)
    want = _logits(model, x)
    got = _logits(hf_model(model), x).logits
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", FLAGS)
def test_flag_combinations_match_megabeta_in_float32(name):
    model = _flag_model(name, torch.float32)
    x = tokens(2, 19)
    torch.testing.assert_close(_logits(hf_model(model), x).logits, _logits(model, x),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", FLAGS)
def test_flag_combinations_match_megabeta_in_float64_at_unit_scale(name):
    """Unit-scale weights make attention far from uniform: a wrong key set cannot hide."""
    model = _flag_model(name, torch.float64, matrices=True)
    x = tokens(2, 19)
    torch.testing.assert_close(_logits(hf_model(model), x).logits, _logits(model, x),
                               atol=1e-10, rtol=0)


@pytest.mark.parametrize("name", ["default", "stride2", "deep_window", "gqa2", "standard"])
def test_logits_equal_the_naive_reference(name):
    model = _flag_model(name, torch.float64, matrices=True)
    x = tokens(1, 13)
    documents = torch.tensor([[0] * 5 + [1] * 6 + [2] * 2])
    for kwargs in ({}, {"documents": documents}):
        want = reference_logits(model.state_dict(), model.config, x, **kwargs)
        torch.testing.assert_close(_logits(hf_model(model), x, **kwargs).logits, want,
                                   atol=1e-10, rtol=0)


def test_a_different_block_partition_is_caught():
    """The comparisons above can fail: the same weights with another block size (another
    function, spec §3) are far outside their tolerance."""
    model = _flag_model("default", torch.float32)
    other = tiny_model(torch.float32, attention="reference", block_size=4).eval()
    other.load_state_dict(model.state_dict())
    x = tokens(2, 19)
    assert (_logits(hf_model(other), x).logits - _logits(model, x)).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["default", "deep_window", "c1", "standard", "looped"])
def test_documents_match_megabeta(name):
    model = _flag_model(name, torch.float64, matrices=True)
    x = tokens(2, 19)
    documents = torch.tensor([[0] * 4 + [1] * 9 + [2] * 6, [5] * 19])
    torch.testing.assert_close(_logits(hf_model(model), x, documents=documents).logits,
                               _logits(model, x, documents=documents), atol=1e-10, rtol=0)


def _incremental(hf, x, prompt: int, step: int):
    """Logits of `x` fed as a prompt of `prompt` tokens, then `step` tokens at a time."""
    with torch.no_grad():
        out = hf(x[:, :prompt], use_cache=True)
        pieces, cache = [out.logits], out.get(_cache_key(out))
        for start in range(prompt, x.shape[1], step):
            out = hf(x[:, start:start + step], past_key_values=cache, use_cache=True)
            pieces.append(out.logits)
            cache = out.get(_cache_key(out))
    assert cache.get_seq_length() == x.shape[1]
    return torch.cat(pieces, dim=1)


def _cache_key(out) -> str:
    return "past_key_values" if "past_key_values" in out else "cache"


@pytest.mark.parametrize("name", ["default", "deep_window", "stride2", "c1", "standard", "looped"])
def test_prefill_then_decoding_equals_one_forward(name):
    """Spec §4.5 through the transformers model's cache: prompts ending before, at and after
    block boundaries (c = 3, or 4 for deep_window), fed on token by token or two at a time."""
    model = _flag_model(name, torch.float64, matrices=True)
    hf = hf_model(model)
    x = tokens(2, 17)
    want = _logits(model, x)
    for prompt, step in ((1, 1), (2, 2), (3, 1), (4, 2), (5, 1), (9, 2)):
        torch.testing.assert_close(_incremental(hf, x, prompt, step), want, atol=1e-10, rtol=0,
                                   msg=f"prompt {prompt}, step {step}")


@pytest.mark.parametrize("name", ["default", "gqa2", "standard"])
def test_greedy_generate_gives_megabetas_tokens(name):
    model = _flag_model(name, torch.float32, matrices=True)
    hf = hf_model(model)
    for prompt_length in (1, 5, 7):
        prompt = tokens(1, prompt_length, seed=prompt_length)[0]
        want = greedy(model, prompt, 20)
        got = hf.generate(prompt[None], max_new_tokens=20, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
        assert got[0, prompt_length:].tolist() == want


def test_generate_decodes_one_token_at_a_time(monkeypatch):
    """`generate()` runs the prompt once, then one token per forward (it uses the cache)."""
    model = _flag_model("default", torch.float32)
    hf = hf_model(model)
    widths = []
    forward = type(hf.model).forward

    def spy(self, input_ids=None, **kwargs):
        widths.append(input_ids.shape[1])
        return forward(self, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(type(hf.model), "forward", spy)
    hf.generate(tokens(1, 7), max_new_tokens=6, do_sample=False, eos_token_id=None,
                pad_token_id=0)
    assert widths == [7, 1, 1, 1, 1, 1]


def test_bfloat16_is_close_to_float32():
    model = _flag_model("default", torch.float32)
    x = tokens(2, 19)
    want = _logits(hf_model(model), x).logits
    half = hf_model(model).to(torch.bfloat16)
    got = _logits(half, x).logits
    assert got.dtype == torch.bfloat16
    scale = want.abs().max()
    assert (got.float() - want).abs().max() < 0.02 * scale


def test_padding_and_documents_with_a_cache_are_refused():
    hf = hf_model(_flag_model("default", torch.float32))
    x = tokens(2, 6)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    with pytest.raises(ValueError, match="padded batches are not supported"):
        hf(x, attention_mask=mask)
    hf(x, attention_mask=torch.ones_like(mask))  # a mask of ones is no padding
    out = hf(x, use_cache=True)
    with pytest.raises(ValueError, match="a cache holds one document"):
        hf(x[:, :1], past_key_values=out.get(_cache_key(out)), documents=x[:, :1] * 0)
    with pytest.raises(ValueError, match="exceed the model's context"):
        hf(tokens(1, 65))


@pytest.mark.parametrize("settings", [dict(num_beams=3, do_sample=False),
                                      dict(do_sample=True, top_k=10, num_return_sequences=2)])
def test_beam_search_and_sampling_with_the_cache_equal_without(settings):
    """Beam search reorders the cache (`reorder_cache`) and sampling expands it per sequence:
    the tokens are those of generating without a cache (each step a full forward)."""
    hf = hf_model(_flag_model("default", torch.float64, matrices=True))
    prompt = tokens(2, 5, seed=6) % 30 + 4
    out = {}
    for use_cache in (True, False):
        torch.manual_seed(0)
        out[use_cache] = hf.generate(prompt, max_new_tokens=9, use_cache=use_cache,
                                     eos_token_id=None, pad_token_id=0, **settings)
    assert out[True].shape[1] == 5 + 9
    assert torch.equal(out[True], out[False])
