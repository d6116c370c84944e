"""Sanity checks of the naive beta_1.2 reference itself (tests/reference_beta12.py).

The standard path is compared with an independently written vectorized Transformer (complex-number
RoPE, masked SDPA); the beta_1.2 path is checked through the spec §3-§4 relations that have a
closed form: c ≥ T collapses to the standard model (§4.1), the first block never sees finished
KVs, limits of the depth bias / self bias / windows reduce to simpler key sets, and causality.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from reference_beta12 import reference_logits

T = 10
ATOL = 1e-10


def make_cfg(**overrides: object) -> SimpleNamespace:
    base = dict(
        vocab_size=13, d_model=16, hidden_dim=24, num_heads=4, num_kv_heads=2, num_layers=3,
        block_size=3, depth_window=1, depth_stride=1, deep_token_window=0, lambda_max=2.0,
        depth_bias=True, layer_enc=True, self_slot=True, qk_norm=True, tie_embedding=False,
        rope_theta=10000.0, norm_eps=1e-6, arch="beta12",
    )
    base.update(overrides)
    return SimpleNamespace(**base)


def make_state(cfg: SimpleNamespace, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float64 weights for every parameter of the contract (extras included)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    d, hd, V = cfg.d_model, cfg.hidden_dim, cfg.vocab_size
    dh = d // cfg.num_heads
    q_out, kv_out = cfg.num_heads * dh, cfg.num_kv_heads * dh
    state = {"tok_embeddings.weight": rnd(V, d), "norm.weight": 1 + rnd(d, scale=0.1)}
    if not cfg.tie_embedding:
        state["output.weight"] = rnd(V, d, scale=d ** -0.5)
    for l in range(cfg.num_layers):
        p = f"layers.{l}."
        state.update({
            p + "attention_norm.weight": 1 + rnd(d, scale=0.1),
            p + "ffn_norm.weight": 1 + rnd(d, scale=0.1),
            p + "attention.wq.weight": rnd(q_out, d, scale=d ** -0.5),
            p + "attention.wk.weight": rnd(kv_out, d, scale=d ** -0.5),
            p + "attention.wv.weight": rnd(kv_out, d, scale=d ** -0.5),
            p + "attention.wo.weight": rnd(d, q_out, scale=q_out ** -0.5),
            p + "attention.q_norm.weight": 1 + rnd(dh, scale=0.1),
            p + "attention.k_norm.weight": 1 + rnd(dh, scale=0.1),
            p + "attention.e_k": rnd(kv_out, scale=0.5),
            p + "attention.e_v": rnd(kv_out, scale=0.5),
            p + "attention.f_q": rnd(q_out, scale=0.5),
            p + "attention.depth_bias": rnd(cfg.num_heads),
            p + "attention.self_bias": rnd(1),
            p + "feed_forward.w1.weight": rnd(hd, d, scale=d ** -0.5),
            p + "feed_forward.w3.weight": rnd(hd, d, scale=d ** -0.5),
            p + "feed_forward.w2.weight": rnd(d, hd, scale=hd ** -0.5),
        })
    return state


def set_all(state: dict[str, torch.Tensor], suffix: str, value: float) -> dict[str, torch.Tensor]:
    """Copy of state with every tensor whose name ends with suffix filled with value."""
    return {k: (torch.full_like(v, value) if k.endswith(suffix) else v) for k, v in state.items()}


def make_tokens(cfg: SimpleNamespace, length: int = T, batch: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def vectorized_standard(state: dict[str, torch.Tensor], cfg: SimpleNamespace, tokens: torch.Tensor) -> torch.Tensor:
    """Independent causal pre-norm RoPE/SwiGLU Transformer: complex RoPE on (x_i, x_{i+d_h/2}) pairs,
    masked SDPA with GQA; a second formulation of what the reference's standard arch must compute."""
    H, Hkv = cfg.num_heads, cfg.num_kv_heads
    dh = cfg.d_model // H
    half = dh // 2
    B, n = tokens.shape

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * w

    freqs = torch.outer(torch.arange(n, dtype=torch.float64),
                        1.0 / cfg.rope_theta ** (torch.arange(0, dh, 2, dtype=torch.float64) / dh))
    rotation = torch.polar(torch.ones_like(freqs), freqs)  # [n, half]

    def rope(x: torch.Tensor) -> torch.Tensor:  # x [B, heads, n, dh]
        z = torch.complex(x[..., :half], x[..., half:]) * rotation
        return torch.cat([z.real, z.imag], dim=-1)

    x = state["tok_embeddings.weight"][tokens]
    for l in range(cfg.num_layers):
        p = f"layers.{l}."
        xn = norm(x, state[p + "attention_norm.weight"])
        q = (xn @ state[p + "attention.wq.weight"].T).view(B, n, H, dh).transpose(1, 2)
        k = (xn @ state[p + "attention.wk.weight"].T).view(B, n, Hkv, dh).transpose(1, 2)
        v = (xn @ state[p + "attention.wv.weight"].T).view(B, n, Hkv, dh).transpose(1, 2)
        if cfg.qk_norm:
            q = norm(q, state[p + "attention.q_norm.weight"])
            k = norm(k, state[p + "attention.k_norm.weight"])
        o = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True, enable_gqa=True)
        x = x + o.transpose(1, 2).reshape(B, n, -1) @ state[p + "attention.wo.weight"].T
        a = norm(x, state[p + "ffn_norm.weight"])
        x = x + (F.silu(a @ state[p + "feed_forward.w1.weight"].T) * (a @ state[p + "feed_forward.w3.weight"].T)) \
            @ state[p + "feed_forward.w2.weight"].T
    head = state["tok_embeddings.weight"] if cfg.tie_embedding else state["output.weight"]
    return norm(x, state["norm.weight"]) @ head.T


@pytest.mark.parametrize("qk_norm,tie,kv_heads", [(True, False, 2), (False, True, 4), (True, True, 1)])
def test_standard_reference_matches_vectorized_transformer(qk_norm: bool, tie: bool, kv_heads: int) -> None:
    cfg = make_cfg(arch="standard", qk_norm=qk_norm, tie_embedding=tie, num_kv_heads=kv_heads)
    state, tokens = make_state(cfg), make_tokens(cfg, batch=2)
    torch.testing.assert_close(reference_logits(state, cfg, tokens), vectorized_standard(state, cfg, tokens),
                               rtol=0, atol=ATOL)


@pytest.mark.parametrize("block_size", [T, T + 5])
def test_one_block_equals_standard_transformer(block_size: int) -> None:
    """Spec §4.1: with c ≥ T, b_σ = 0 and f = 0, beta_1.2 is the standard Transformer; the random
    e_K, e_V and depth-bias parameters must then have no effect (no finished group exists)."""
    cfg = make_cfg(block_size=block_size, depth_window=2)
    state = set_all(set_all(make_state(cfg), "self_bias", 0.0), "f_q", 0.0)
    tokens = make_tokens(cfg)
    beta = reference_logits(state, cfg, tokens)
    standard = reference_logits(state, make_cfg(arch="standard"), tokens)
    torch.testing.assert_close(beta, standard, rtol=0, atol=ATOL)


def test_first_block_equals_standard_and_later_blocks_differ() -> None:
    """Tokens of block 0 have no finished keys, so they match the standard model; later ones do not."""
    cfg = make_cfg(block_size=4, depth_window=1)
    state = set_all(set_all(make_state(cfg), "self_bias", 0.0), "f_q", 0.0)
    tokens = make_tokens(cfg)
    beta = reference_logits(state, cfg, tokens)
    standard = reference_logits(state, make_cfg(arch="standard"), tokens)
    torch.testing.assert_close(beta[:, :4], standard[:, :4], rtol=0, atol=ATOL)
    assert (beta[:, 4:] - standard[:, 4:]).abs().max() > 1e-3


def test_per_token_blocks_differ_from_one_block() -> None:
    cfg_c1 = make_cfg(block_size=1, depth_window=1)
    state, tokens = make_state(cfg_c1), make_tokens(cfg_c1)
    per_token = reference_logits(state, cfg_c1, tokens)
    one_block = reference_logits(state, make_cfg(block_size=T, depth_window=1), tokens)
    torch.testing.assert_close(per_token[:, 0], one_block[:, 0], rtol=0, atol=ATOL)
    assert (per_token[:, 1:] - one_block[:, 1:]).abs().max() > 1e-3


@pytest.mark.parametrize("block_size,window", [(1, 0), (3, 2), (4, 0)])
def test_causal(block_size: int, window: int) -> None:
    cfg = make_cfg(block_size=block_size, depth_window=2, deep_token_window=window)
    state, tokens = make_state(cfg), make_tokens(cfg)
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % cfg.vocab_size
    a, b = reference_logits(state, cfg, tokens), reference_logits(state, cfg, changed)
    torch.testing.assert_close(a[:, :-1], b[:, :-1], rtol=0, atol=0)
    assert (a[:, -1] - b[:, -1]).abs().max() > 1e-3


def test_huge_depth_bias_removes_deeper_groups() -> None:
    """λ ≈ 1e3 gives the m > l groups scores ≈ -1e3·(m-l): their weight underflows to 0, leaving k = 0.
    A wrong sign would instead make those groups dominate."""
    cfg = make_cfg(depth_window=2, lambda_max=1e3)
    state = set_all(make_state(cfg), "depth_bias", 40.0)
    tokens = make_tokens(cfg)
    shallow = reference_logits(state, make_cfg(depth_window=0, lambda_max=1e3), tokens)
    torch.testing.assert_close(reference_logits(state, cfg, tokens), shallow, rtol=0, atol=ATOL)
    plain = reference_logits(state, make_cfg(depth_window=2, depth_bias=False), tokens)
    assert (plain - shallow).abs().max() > 1e-3


def test_vanishing_depth_bias_equals_no_depth_bias() -> None:
    cfg = make_cfg(depth_window=2)
    state = set_all(make_state(cfg), "depth_bias", -60.0)
    tokens = make_tokens(cfg)
    torch.testing.assert_close(reference_logits(state, cfg, tokens),
                               reference_logits(state, make_cfg(depth_window=2, depth_bias=False), tokens),
                               rtol=0, atol=ATOL)


def test_huge_self_bias_attends_only_to_self() -> None:
    """b_σ = 1e3 puts all attention on the self slot, whose value carries no position, so every
    token's logits equal those of the same token run alone."""
    cfg = make_cfg(block_size=3)
    state = set_all(make_state(cfg), "self_bias", 1e3)
    tokens = make_tokens(cfg)
    full = reference_logits(state, cfg, tokens)
    alone = reference_logits(state, cfg, tokens.view(-1, 1)).view(1, T, -1)
    torch.testing.assert_close(full, alone, rtol=0, atol=ATOL)


def test_key_set_limits() -> None:
    """Stride > k and k = 0 give M(l) = {l}; k ≥ L equals k = L-1; a deep-token window covering the
    whole context equals no window; and each genuine restriction changes the result."""
    state, tokens = make_state(make_cfg()), make_tokens(make_cfg(), length=12)

    def run(**kw: object) -> torch.Tensor:
        return reference_logits(state, make_cfg(block_size=2, **kw), tokens)

    k0 = run(depth_window=0)
    torch.testing.assert_close(run(depth_window=2, depth_stride=3), k0, rtol=0, atol=ATOL)
    torch.testing.assert_close(run(depth_window=7), run(depth_window=2), rtol=0, atol=ATOL)
    full_window = run(depth_window=2, deep_token_window=12)
    torch.testing.assert_close(full_window, run(depth_window=2), rtol=0, atol=ATOL)
    assert (run(depth_window=2, deep_token_window=3) - full_window).abs().max() > 1e-3
    assert (run(depth_window=2, depth_stride=2) - run(depth_window=2)).abs().max() > 1e-3
    assert (run(depth_window=2, depth_stride=2) - k0).abs().max() > 1e-3
    torch.testing.assert_close(run(depth_window=0, deep_token_window=3), k0, rtol=0, atol=ATOL)


def test_batch_rows_are_independent_and_ragged_block_works() -> None:
    cfg = make_cfg(block_size=4)  # T = 10 is not a multiple of 4
    state, tokens = make_state(cfg), make_tokens(cfg, batch=2)
    both = reference_logits(state, cfg, tokens)
    assert both.shape == (2, T, cfg.vocab_size) and both.dtype == torch.float64
    for b in range(2):
        torch.testing.assert_close(both[b:b + 1], reference_logits(state, cfg, tokens[b:b + 1]), rtol=0, atol=0)


def test_missing_parameter_is_named() -> None:
    cfg = make_cfg()
    state = make_state(cfg)
    del state["layers.1.attention.e_v"]
    with pytest.raises(KeyError, match=r"layers\.1\.attention\.e_v"):
        reference_logits(state, cfg, make_tokens(cfg))


def test_hand_computed_single_layer_per_token_blocks() -> None:
    """One layer, one head, c = 1, k = 0, computed by hand from the spec formulas: token i attends to
    the finished KVs (with e_K, e_V, RoPE at their own positions) of all j < i plus its own
    construction KV with b_σ; RoPE written as explicit pair rotations."""
    cfg = make_cfg(num_layers=1, num_heads=1, num_kv_heads=1, d_model=4, hidden_dim=6, block_size=1,
                   depth_window=0, qk_norm=False, tie_embedding=True)
    state = make_state(cfg)
    n = 4
    tokens = make_tokens(cfg, length=n)
    w = {k[len("layers.0."):]: v for k, v in state.items() if k.startswith("layers.0.")}

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(x.pow(2).mean() + cfg.norm_eps) * weight

    def rot(x: torch.Tensor, pos: int) -> torch.Tensor:  # d_h = 4: frequencies 1 and theta^-1/2
        out = x.clone()
        for i, f in enumerate([1.0, cfg.rope_theta ** -0.5]):
            c, s = math.cos(pos * f), math.sin(pos * f)
            out[i], out[i + 2] = x[i] * c - x[i + 2] * s, x[i] * s + x[i + 2] * c
        return out

    emb = state["tok_embeddings.weight"]
    finished: list[tuple[torch.Tensor, torch.Tensor]] = []
    expected = []
    for i in range(n):
        x = emb[tokens[0, i]]
        xn = norm(x, w["attention_norm.weight"])
        q = rot(w["attention.wq.weight"] @ xn + w["attention.f_q"], i)
        k_self, v_self = rot(w["attention.wk.weight"] @ xn, i), w["attention.wv.weight"] @ xn
        # score scale 1/sqrt(d_h) = 1/2; depth bias -λ·(m - l) is 0 for the only group m = l
        scores = [float(q @ k) / 2.0 for k, _ in finished] + [float(q @ k_self) / 2.0 + float(w["attention.self_bias"])]
        values = [v for _, v in finished] + [v_self]
        top = max(scores)
        weights = [math.exp(sc - top) for sc in scores]
        attn = sum(wt * v for wt, v in zip(weights, values)) / sum(weights)
        a = x + w["attention.wo.weight"] @ attn
        an = norm(a, w["ffn_norm.weight"])
        h = a + w["feed_forward.w2.weight"] @ (F.silu(w["feed_forward.w1.weight"] @ an) * (w["feed_forward.w3.weight"] @ an))
        hn = norm(h, w["attention_norm.weight"])
        finished.append((rot(w["attention.wk.weight"] @ hn + w["attention.e_k"], i), w["attention.wv.weight"] @ hn + w["attention.e_v"]))
        expected.append(norm(h, state["norm.weight"]) @ emb.T)
    torch.testing.assert_close(reference_logits(state, cfg, tokens)[0], torch.stack(expected), rtol=0, atol=ATOL)


# ---- documents in one packed sample (spec §7) -----------------------------------------------

def _packed(lengths: list[int], seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens `[1, Σ lengths]` and their document ids (0, 1, … per document)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 13, (1, sum(lengths)), generator=g)
    ids = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None]
    return tokens, ids


def test_one_document_is_the_unmasked_model() -> None:
    cfg = make_cfg()
    state = make_state(cfg)
    tokens, _ = _packed([T])
    same = torch.full_like(tokens, 7)
    assert torch.equal(reference_logits(state, cfg, tokens, same),
                       reference_logits(state, cfg, tokens))


@pytest.mark.parametrize("overrides", [dict(), dict(deep_token_window=2, depth_window=2),
                                       dict(arch="standard")], ids=["beta12", "window", "standard"])
def test_block_aligned_documents_equal_each_document_alone(overrides: dict) -> None:
    """§7: documents starting at multiples of c (here 3) give each document the logits it has
    alone from position 0 (RoPE is relative: equal up to rounding)."""
    cfg = make_cfg(**overrides)
    state = make_state(cfg)
    lengths = [6, 1, 2, 4]  # the 1-token and 2-token documents are padded to a block below
    padded = [6, 3, 3, 4]
    tokens, _ = _packed(padded)
    # The padding after a document carries an id of its own (spec §7).
    ids = torch.tensor([[2 * d + (j >= n) for d, (n, r) in enumerate(zip(lengths, padded))
                         for j in range(r)]])
    got = reference_logits(state, cfg, tokens, ids)
    start = 0
    for length, room in zip(lengths, padded):
        alone = reference_logits(state, cfg, tokens[:, start:start + length])
        torch.testing.assert_close(got[:, start:start + length], alone, rtol=0, atol=ATOL)
        start += room


def test_unaligned_documents_differ_from_alone_but_the_standard_arm_does_not() -> None:
    """A document starting inside a block shares that block with the previous one's tail: its
    block partition is not its own, so (beta12) its logits differ from alone; the standard arm
    has no blocks, and the mask alone makes packed equal to alone."""
    lengths = [4, 5]
    tokens, ids = _packed(lengths)
    for arch, differs in (("beta12", True), ("standard", False)):
        cfg = make_cfg(arch=arch)
        state = make_state(cfg)
        got = reference_logits(state, cfg, tokens, ids)[:, 4:]
        alone = reference_logits(state, cfg, tokens[:, 4:])
        assert not torch.allclose(got, alone, rtol=0, atol=1e-6) if differs else \
            torch.allclose(got, alone, rtol=0, atol=ATOL)


def test_a_masked_token_reads_nothing_of_the_documents_before_it() -> None:
    """Changing an earlier document's tokens leaves a later document's logits unchanged
    (unaligned too: the restriction holds in every group)."""
    cfg = make_cfg(deep_token_window=2)
    state = make_state(cfg)
    tokens, ids = _packed([5, 5])
    other = tokens.clone()
    other[:, :5] = (other[:, :5] + 1) % 13
    a, b = (reference_logits(state, cfg, t, ids) for t in (tokens, other))
    assert torch.equal(a[:, 5:], b[:, 5:]) and not torch.equal(a[:, :5], b[:, :5])


def test_malformed_documents_are_refused() -> None:
    cfg = make_cfg()
    state = make_state(cfg)
    tokens, ids = _packed([5, 5])
    with pytest.raises(ValueError, match="non-decreasing"):
        reference_logits(state, cfg, tokens, ids.flip(1))
    with pytest.raises(ValueError, match="shaped like tokens"):
        reference_logits(state, cfg, tokens, ids[:, :-1])
