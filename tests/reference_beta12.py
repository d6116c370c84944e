"""Naive reference implementation of the beta_1.2 model function (ground truth for tests).

This module is deliberately slow and literal so that it stays independent of the optimized
model code: it never vectorizes across tokens or blocks, never builds masks, and never calls
``F.scaled_dot_product_attention``. For every query token ``i`` and layer ``l`` it lists each key
of spec §3 (``/work/shared/spec/beta12.md``) explicitly as a ``(kind, source layer m, token j)``
entry with its score bias and takes one plain softmax over that list.

Order of computation (spec §3 dependencies): tokens are processed one at a time, ``i = 0..T-1``,
each through all layers ``0..L-1``. Every finished KV a query reads belongs to a token ``j`` of an
earlier block, hence ``j < i``, and that token has already finished every layer, so its stored
output ``h_j^(m)`` exists when needed. Construction KVs of layer ``l`` for in-block tokens
``j < i`` were stored when those tokens passed layer ``l``.

State-dict contract (torchtitan style, Linear weights ``[out, in]``, no Linear biases): see
``reference_logits``. Keys not used by the selected ``cfg`` (for example torchtitan's
``freqs_cis`` buffer, or beta_1.2 extras when ``arch == "standard"``) are ignored on purpose, so
one state dict can be evaluated under both architectures (spec §4.1).

Documents (spec §7): with ``documents`` (an id per token, non-decreasing along each sequence) a
query's key list keeps only the keys of tokens with the query's own id, in every row of the
table; nothing else changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_ARCHES = ("beta12", "standard")


@dataclass(frozen=True)
class _Shape:
    """Hyper-parameters read from ``cfg``, validated once."""

    arch: str
    vocab_size: int
    d_model: int
    hidden_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    block_size: int
    depth_window: int
    depth_stride: int
    deep_token_window: int
    lambda_max: float
    depth_bias: bool
    layer_enc: bool
    self_slot: bool
    qk_norm: bool
    tie_embedding: bool
    rope_theta: float
    norm_eps: float


def _cfg_value(cfg: object, name: str) -> object:
    if not hasattr(cfg, name):
        raise ValueError(f"reference_beta12: cfg has no attribute {name!r}; set it on the config object")
    return getattr(cfg, name)


def _read_shape(cfg: object) -> _Shape:
    arch = str(_cfg_value(cfg, "arch"))
    if arch not in _ARCHES:
        raise ValueError(f"reference_beta12: cfg.arch={arch!r}; expected one of {_ARCHES}")
    num_heads = int(_cfg_value(cfg, "num_heads"))
    kv = _cfg_value(cfg, "num_kv_heads")
    num_kv_heads = num_heads if kv is None else int(kv)  # torchtitan: None means MHA
    d_model = int(_cfg_value(cfg, "d_model"))
    if num_heads <= 0 or d_model % num_heads != 0:
        raise ValueError(f"reference_beta12: cfg.d_model={d_model} must be a positive multiple of cfg.num_heads={num_heads}")
    if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"reference_beta12: cfg.num_heads={num_heads} must be a multiple of cfg.num_kv_heads={num_kv_heads}")
    head_dim = d_model // num_heads
    if head_dim % 2 != 0:
        raise ValueError(f"reference_beta12: head width d_model/num_heads={head_dim} must be even for RoPE")
    shape = _Shape(
        arch=arch,
        vocab_size=int(_cfg_value(cfg, "vocab_size")),
        d_model=d_model,
        hidden_dim=int(_cfg_value(cfg, "hidden_dim")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_layers=int(_cfg_value(cfg, "num_layers")),
        block_size=int(_cfg_value(cfg, "block_size")),
        depth_window=int(_cfg_value(cfg, "depth_window")),
        depth_stride=int(_cfg_value(cfg, "depth_stride")),
        deep_token_window=int(_cfg_value(cfg, "deep_token_window")),
        lambda_max=float(_cfg_value(cfg, "lambda_max")),
        depth_bias=bool(_cfg_value(cfg, "depth_bias")),
        layer_enc=bool(_cfg_value(cfg, "layer_enc")),
        self_slot=bool(_cfg_value(cfg, "self_slot")),
        qk_norm=bool(_cfg_value(cfg, "qk_norm")),
        tie_embedding=bool(_cfg_value(cfg, "tie_embedding")),
        rope_theta=float(_cfg_value(cfg, "rope_theta")),
        norm_eps=float(_cfg_value(cfg, "norm_eps")),
    )
    for name, low in (("vocab_size", 1), ("hidden_dim", 1), ("num_layers", 1), ("block_size", 1),
                      ("depth_window", 0), ("depth_stride", 1), ("deep_token_window", 0)):
        if getattr(shape, name) < low:
            raise ValueError(f"reference_beta12: cfg.{name}={getattr(shape, name)} must be >= {low}")
    return shape


class _Weights:
    """Looks up state-dict tensors by name and checks their shapes against the contract."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.state:
            raise KeyError(f"reference_beta12: state dict lacks {name!r} (expected shape {list(shape)})")
        tensor = self.state[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"reference_beta12: state[{name!r}] has shape {list(tensor.shape)}, expected {list(shape)}")
        return tensor


# ---- building blocks (spec §1 skeleton, §2 projections) -------------------------------------

def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) * weight."""
    return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    """RoPE at absolute position ``position`` (spec §1), rotate-half convention, x: [heads, d_h]."""
    d_h = x.shape[-1]
    half = d_h // 2
    inv_freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / d_h)
    angles = position * inv_freq
    cos = torch.cat([torch.cos(angles), torch.cos(angles)]).to(device=x.device, dtype=x.dtype)
    sin = torch.cat([torch.sin(angles), torch.sin(angles)]).to(device=x.device, dtype=x.dtype)
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@dataclass(frozen=True)
class _KV:
    """One token's key and value at one layer, per kv head: [Hkv, d_h] each."""

    key: torch.Tensor
    value: torch.Tensor


class _Layer:
    """Weights of one layer plus the §2 projections that use them."""

    def __init__(self, weights: _Weights, shape: _Shape, index: int) -> None:
        d, hd, dh = shape.d_model, shape.hidden_dim, shape.head_dim
        H, Hkv = shape.num_heads, shape.num_kv_heads
        p = f"layers.{index}."
        self.shape = shape
        self.index = index
        self.attention_norm = weights.get(p + "attention_norm.weight", (d,))
        self.ffn_norm = weights.get(p + "ffn_norm.weight", (d,))
        self.wq = weights.get(p + "attention.wq.weight", (H * dh, d))
        self.wk = weights.get(p + "attention.wk.weight", (Hkv * dh, d))
        self.wv = weights.get(p + "attention.wv.weight", (Hkv * dh, d))
        self.wo = weights.get(p + "attention.wo.weight", (d, H * dh))
        self.w1 = weights.get(p + "feed_forward.w1.weight", (hd, d))
        self.w3 = weights.get(p + "feed_forward.w3.weight", (hd, d))
        self.w2 = weights.get(p + "feed_forward.w2.weight", (d, hd))
        beta = shape.arch == "beta12"
        self.q_norm = weights.get(p + "attention.q_norm.weight", (dh,)) if shape.qk_norm else None
        self.k_norm = weights.get(p + "attention.k_norm.weight", (dh,)) if shape.qk_norm else None
        # §1: e_K, e_V, f exist only with layer_enc; the standard arch never uses them.
        use_enc = beta and shape.layer_enc
        self.e_k = weights.get(p + "attention.e_k", (Hkv * dh,)) if use_enc else None
        self.e_v = weights.get(p + "attention.e_v", (Hkv * dh,)) if use_enc else None
        self.f_q = weights.get(p + "attention.f_q", (H * dh,)) if use_enc else None
        self.theta = weights.get(p + "attention.depth_bias", (H,)) if beta and shape.depth_bias else None
        self.self_bias = weights.get(p + "attention.self_bias", (1,)) if beta and shape.self_slot else None

    def _qk_norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """N_qk of §2: per-head RMS norm over d_h when qk_norm, identity otherwise."""
        if weight is None:
            return x
        return _rms_norm(x, weight, self.shape.norm_eps)

    def project_kv(self, x: torch.Tensor, position: int, finished: bool) -> _KV:
        """§2 proj_l(x, j). finished=True adds e_K, e_V (layer_enc); construction KV uses e = e' = 0."""
        s = self.shape
        xn = _rms_norm(x, self.attention_norm, s.norm_eps)
        k = self.wk @ xn
        v = self.wv @ xn
        if finished and self.e_k is not None:
            k = k + self.e_k
            v = v + self.e_v
        k = k.view(s.num_kv_heads, s.head_dim)
        v = v.view(s.num_kv_heads, s.head_dim)
        k = _rope(self._qk_norm(k, self.k_norm), position, s.rope_theta)
        return _KV(key=k, value=v)

    def query(self, x: torch.Tensor, position: int) -> torch.Tensor:
        """§2 q_i^l = RoPE_i(N_qk(W_Q · RMSNorm(h_i^(l-1)) + f^l)), shape [H, d_h]."""
        s = self.shape
        q = self.wq @ _rms_norm(x, self.attention_norm, s.norm_eps)
        if self.f_q is not None:
            q = q + self.f_q
        q = q.view(s.num_heads, s.head_dim)
        return _rope(self._qk_norm(q, self.q_norm), position, s.rope_theta)

    def depth_lambda(self, head: int) -> torch.Tensor:
        """§3 λ_{l,h} = lambda_max · sigmoid(θ_{l,h}) (0-d: differentiable w.r.t. θ)."""
        return self.shape.lambda_max * torch.sigmoid(self.theta[head])

    def feed_forward(self, a: torch.Tensor) -> torch.Tensor:
        """SwiGLU_l(RMSNorm_l^mlp(a)) = w2(silu(w1 x) * w3 x)."""
        x = _rms_norm(a, self.ffn_norm, self.shape.norm_eps)
        return self.w2 @ (torch.nn.functional.silu(self.w1 @ x) * (self.w3 @ x))


# ---- key sets (spec §3) ---------------------------------------------------------------------

@dataclass(frozen=True)
class _KeyEntry:
    """One key of a query's softmax, named by where it comes from (spec §3 table row)."""

    kind: str      # "finished", "in_block" or "self"
    layer: int     # source layer m (finished) or the query's own layer l (construction KV)
    token: int     # token j whose K/V this is


def _source_layers(shape: _Shape, layer: int) -> list[int]:
    """§3 M(l) = {l, l+s, l+2s, ...} ∩ [l, top(l)], top(l) = min(l + k, L - 1)."""
    top = min(layer + shape.depth_window, shape.num_layers - 1)
    return list(range(layer, top + 1, shape.depth_stride))


def _beta12_key_entries(shape: _Shape, i: int, layer: int) -> list[_KeyEntry]:
    """Every key of query i at layer l, listed row by row from the table of spec §3."""
    block_start = (i // shape.block_size) * shape.block_size  # start(block(i)) = floor(i/c)·c
    entries: list[_KeyEntry] = []
    # Row "finished, source layer m ∈ M(l)": tokens j < start(block(i)); with w > 0 and m > l only
    # j ≥ start(block(i)) - w (clipped at 0). The m = l group always sees all earlier-block tokens.
    for m in _source_layers(shape, layer):
        first = 0
        if shape.deep_token_window > 0 and m > layer:
            first = max(0, block_start - shape.deep_token_window)
        for j in range(first, block_start):
            entries.append(_KeyEntry("finished", m, j))
    # Row "in-block": construction KV of layer l, start(block(i)) ≤ j < i.
    for j in range(block_start, i):
        entries.append(_KeyEntry("in_block", layer, j))
    # Row "self slot σ": construction KV of layer l, j = i.
    entries.append(_KeyEntry("self", layer, i))
    return entries


def _standard_key_entries(i: int, layer: int) -> list[_KeyEntry]:
    """Plain causal attention: construction KV of the query's own layer for all j ≤ i, no bias."""
    return [_KeyEntry("in_block", layer, j) for j in range(i + 1)]


def _score_bias(entry: _KeyEntry, layer: _Layer, head: int) -> torch.Tensor | float:
    """The 'score added to q·k/√d_h' column of spec §3 (a tensor where a parameter sets it)."""
    if entry.kind == "finished" and layer.theta is not None:
        return -layer.depth_lambda(head) * (entry.layer - layer.index)
    if entry.kind == "self" and layer.self_bias is not None:
        return layer.self_bias[0]
    return 0.0


# ---- the forward pass of one sequence -------------------------------------------------------

class _Sequence:
    """Runs one sequence token by token, storing every h_j^(l) and construction KV."""

    def __init__(self, shape: _Shape, layers: list[_Layer], embedding: torch.Tensor,
                 documents: list[int] | None = None) -> None:
        self.shape = shape
        self.documents = documents  # D(j) per token (spec §7); None: one document
        self.layers = layers
        self.embedding = embedding
        self.outputs: list[list[torch.Tensor]] = []          # outputs[j][l] = h_j^(l)
        self.construction: list[list[_KV]] = []              # construction[j][l] = proj_l(h_j^(l-1), j)
        self._finished: dict[tuple[int, int], _KV] = {}       # memo of finished KVs, (j, m) -> KV

    def finished_kv(self, token: int, m: int) -> _KV:
        """§2 finished KV of layer m for token j: proj_m(h_j^(m), j) with e_K^m, e_V^m."""
        if (token, m) not in self._finished:
            self._finished[(token, m)] = self.layers[m].project_kv(self.outputs[token][m], token, finished=True)
        return self._finished[(token, m)]

    def _kv_of(self, entry: _KeyEntry) -> _KV:
        if entry.kind == "finished":
            return self.finished_kv(entry.token, entry.layer)
        return self.construction[entry.token][entry.layer]

    def _attention(self, layer: _Layer, x: torch.Tensor, i: int) -> torch.Tensor:
        """Attn_l for query token i with input x = h_i^(l-1): one softmax over the §3 key list."""
        s = self.shape
        if s.arch == "beta12":
            entries = _beta12_key_entries(s, i, layer.index)
        else:
            entries = _standard_key_entries(i, layer.index)
        if self.documents is not None:
            # §7: every group restricted to the query's own document (the self slot always is).
            entries = [e for e in entries if self.documents[e.token] == self.documents[i]]
        q = layer.query(x, i)
        kvs = [self._kv_of(e) for e in entries]
        group = s.num_heads // s.num_kv_heads
        scale = 1.0 / math.sqrt(s.head_dim)
        heads = []
        for h in range(s.num_heads):
            g = h // group  # grouped-query attention: query head h reads kv head h // (H / Hkv)
            scores = torch.stack([
                (q[h] * kv.key[g]).sum() * scale + _score_bias(e, layer, h) for e, kv in zip(entries, kvs)
            ])
            probs = torch.softmax(scores, dim=0)
            heads.append(sum(p * kv.value[g] for p, kv in zip(probs, kvs)))
        return layer.wo @ torch.cat(heads)  # heads concatenated, then W_O^l (§3)

    def append_token(self, token_id: int) -> torch.Tensor:
        """Runs token i = len(outputs) through all layers; returns h_i^(L-1)."""
        i = len(self.outputs)
        self.outputs.append([])
        self.construction.append([])
        x = self.embedding[token_id]  # h_i^(-1) = Embed(t_i)
        for layer in self.layers:
            # The construction KV of (i, l) is stored before attending: the self slot reads it.
            self.construction[i].append(layer.project_kv(x, i, finished=False))
            a = x + self._attention(layer, x, i)        # §1: a = h^(l-1) + Attn_l(...)
            x = a + layer.feed_forward(a)               # §1: h^(l) = a + SwiGLU_l(RMSNorm(a))
            self.outputs[i].append(x)
        return x


def reference_logits(state: dict[str, torch.Tensor], cfg: object, tokens: torch.Tensor,
                     documents: torch.Tensor | None = None, *,
                     differentiable: bool = False) -> torch.Tensor:
    """Logits [B, T, V] of the beta_1.2 (or standard) model, computed naively from spec §1-§3,
    and §7 when ``documents`` (integer [B, T], non-decreasing along T) gives each token's
    document id.

    state: torchtitan-style state dict (tok_embeddings.weight, output.weight unless tie_embedding,
    norm.weight, layers.{l}.*). cfg: any object with the hyper-parameter attributes listed in
    ``_Shape``. tokens: integer tensor [B, T]. The result has the dtype of the state tensors.
    ``differentiable``: build the logits under autograd (state tensors that require grad get
    their gradients): the independent reference for the model's gradients.
    """
    shape = _read_shape(cfg)
    if tokens.dim() != 2 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise ValueError(f"reference_beta12: tokens must be an integer tensor [B, T], got {tokens.dtype} {list(tokens.shape)}")
    if tokens.numel() and (tokens.min() < 0 or tokens.max() >= shape.vocab_size):
        raise ValueError(f"reference_beta12: token ids must lie in [0, cfg.vocab_size={shape.vocab_size})")
    if documents is not None:
        if documents.shape != tokens.shape or documents.dtype.is_floating_point:
            raise ValueError(f"reference_beta12: documents must be an integer tensor shaped like "
                             f"tokens {list(tokens.shape)}, got {documents.dtype} "
                             f"{list(documents.shape)}")
        if documents.shape[1] > 1 and bool((documents[:, 1:] < documents[:, :-1]).any()):
            raise ValueError("reference_beta12: documents must be non-decreasing along T "
                             "(documents are contiguous, spec §7)")
    weights = _Weights(state)
    V, d = shape.vocab_size, shape.d_model
    embedding = weights.get("tok_embeddings.weight", (V, d))
    head = embedding if shape.tie_embedding else weights.get("output.weight", (V, d))
    final_norm = weights.get("norm.weight", (d,))
    layers = [_Layer(weights, shape, index) for index in range(shape.num_layers)]

    B, T = tokens.shape
    rows: list[list[torch.Tensor]] = []
    with torch.set_grad_enabled(differentiable):
        for b in range(B):
            ids = None if documents is None else [int(t) for t in documents[b]]
            sequence = _Sequence(shape, layers, embedding, ids)
            rows.append([])
            for i in range(T):
                top = sequence.append_token(int(tokens[b, i]))
                # §1: logits = LMHead(RMSNorm_final(h^(L-1)))
                rows[b].append(head @ _rms_norm(top, final_norm, shape.norm_eps))
        return torch.stack([torch.stack(r) for r in rows]).reshape(B, T, V)
