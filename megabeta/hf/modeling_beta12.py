"""beta_1.2 (Beta12Transformer) for Hugging Face transformers: a plain PyTorch implementation
for inference, with the cache that lets `generate()` decode incrementally.

Written by `megabeta export --format hf` beside `configuration_beta12.py`; it depends on torch and
transformers only and loads with `AutoModelForCausalLM.from_pretrained(DIR,
trust_remote_code=True)`. The function is defined in megabeta's spec (shared/spec/beta12.md,
cited as "spec §N"); megabeta's tests hold this file to megabeta's own model.

How it is computed: block by block (spec §5, block-sequential). The tokens of one block of
`block_size` tokens run through layers 0 .. L-1 together; at layer l each query attends, in one
softmax (one `scaled_dot_product_attention` call with an additive bias), to

- the finished keys/values of layers m in M(l) = {l, l+s, ...} ∩ [l, min(l+k, L-1)] of every
  token before the block (layer m's own norm and projections applied to layer m's OUTPUT, plus
  e_K, e_V; spec §2), scored with -λ_{l,h}·(m - l), λ = lambda_max·sigmoid(θ); with a deep-token
  window w > 0 the groups m > l see only the last w of those tokens;
- the construction keys/values (layer l's own input, as in a standard Transformer) of the
  block's earlier tokens, and of the token itself (the self slot), scored + b_σ (spec §3).

After a block has passed layer m, its finished keys/values of layer m are kept; they become
visible to the blocks after it. `arch = "standard"` is one block of the whole sequence (plain
causal attention, spec §4.1); `"looped"` applies that stack `loops` times, each application with
its own keys/values.

The cache (`Beta12Cache`, spec §4.5) holds per layer the finished keys/values of completed
blocks, the construction keys/values of the current block's tokens and their finished
keys/values, visible once the block completes. Prefill and token-by-token decoding compute the
same function as one forward over the whole sequence, for prompts that end anywhere in a block.

Documents (spec §7): `forward(..., documents=ids)` with ids `[B, T]` non-decreasing along each
sequence restricts every key group to the query's own document (one forward, no cache: a cache
holds one document). Padding is not supported: positions and blocks count from the first token,
so a left-padded batch would compute another function; an `attention_mask` with zeros is
refused. Batch prompts of one length, or one at a time.
"""

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_beta12 import Beta12Config


CACHE_KEY = ("past_key_values" if "past_key_values" in
             {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "cache")
"""What this transformers calls the cache in model inputs and outputs (`past_key_values` in
4.x, `cache` in newer releases); the forward takes either."""


def _output(cls, cache, **fields):
    return cls(**fields, **{CACHE_KEY: cache})


def _compute_dtype(dtype):
    """Norms and RoPE of half-precision activations run in float32, rounded once."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


class Beta12RMSNorm(nn.Module):
    """`x · rsqrt(mean(x²) + eps) · weight` over the last dimension."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        y = x.to(_compute_dtype(x.dtype))
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight


def rope_tables(head_dim, start, length, theta, device, dtype):
    """cos/sin `[length, head_dim]` of positions start .. start+length-1 (rotate-half RoPE,
    inverse frequencies theta^(-2i/d_h), each repeated for both halves), built in float64."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(start, start + length, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    compute = _compute_dtype(dtype)
    return angles.cos().to(device, compute), angles.sin().to(device, compute)


def apply_rope(x, cos, sin):
    """Rotate `x [B, heads, n, d_h]` by the positions of `cos/sin [n, d_h]`."""
    y = x.to(cos.dtype)
    half = y.shape[-1] // 2
    rotated = torch.cat([-y[..., half:], y[..., :half]], dim=-1)
    return (y * cos + rotated * sin).to(x.dtype)


class Beta12Attention(nn.Module):
    """A layer's projections and beta_1.2's extras (spec §1-§2): W_Q, W_K, W_V, W_O; with
    `qk_norm` per-head norms of queries and keys; in the beta12 arm e_K, e_V, f (`layer_enc`),
    θ (`depth_bias`, one per head) and b_σ (`self_slot`)."""

    def __init__(self, config, beta):
        super().__init__()
        d, heads = config.hidden_size, config.num_attention_heads
        kv_heads = config.num_key_value_heads
        self.heads, self.kv_heads = heads, kv_heads
        self.head_dim = d // heads
        self.lambda_max = config.lambda_max
        self.q_proj = nn.Linear(d, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, d, bias=False)
        norm = config.qk_norm
        self.q_norm = Beta12RMSNorm(self.head_dim, config.rms_norm_eps) if norm else None
        self.k_norm = Beta12RMSNorm(self.head_dim, config.rms_norm_eps) if norm else None
        enc = beta and config.layer_enc
        self.e_k = nn.Parameter(torch.zeros(kv_heads * self.head_dim)) if enc else None
        self.e_v = nn.Parameter(torch.zeros(kv_heads * self.head_dim)) if enc else None
        self.f_q = nn.Parameter(torch.zeros(heads * self.head_dim)) if enc else None
        self.depth_bias = nn.Parameter(torch.zeros(heads)) if beta and config.depth_bias else None
        self.self_bias = nn.Parameter(torch.zeros(1)) if beta and config.self_slot else None

    def _heads(self, y, heads, norm):
        """`[B, n, heads·d_h]` -> `[B, heads, n, d_h]`, normed per head when `norm`."""
        y = y.view(*y.shape[:2], heads, self.head_dim).transpose(1, 2)
        return y if norm is None else norm(y)

    def construction(self, normed, cos, sin):
        """Queries (with f) and the construction keys/values of a layer's normed input."""
        q = self.q_proj(normed)
        if self.f_q is not None:
            q = q + self.f_q
        q = apply_rope(self._heads(q, self.heads, self.q_norm), cos, sin)
        k = apply_rope(self._heads(self.k_proj(normed), self.kv_heads, self.k_norm), cos, sin)
        return q, k, self._heads(self.v_proj(normed), self.kv_heads, None)

    def finished(self, normed, cos, sin):
        """Finished keys/values (spec §2) of the layer's normed OUTPUT: with e_K, e_V."""
        k, v = self.k_proj(normed), self.v_proj(normed)
        if self.e_k is not None:
            k, v = k + self.e_k, v + self.e_v
        k = apply_rope(self._heads(k, self.kv_heads, self.k_norm), cos, sin)
        return k, self._heads(v, self.kv_heads, None)

    def depth_slope(self):
        """λ_{l,h} = lambda_max · sigmoid(θ_{l,h}) `[H]`, or None without `depth_bias`."""
        if self.depth_bias is None:
            return None
        theta = self.depth_bias
        return self.lambda_max * torch.sigmoid(theta.to(_compute_dtype(theta.dtype)))

    def attend(self, q, keys, values, bias):
        """One softmax per query over the concatenated key groups, heads concatenated and
        projected by W_O: `[B, n, d]`."""
        k, v = torch.cat(keys, dim=2), torch.cat(values, dim=2)
        if self.kv_heads != self.heads:  # grouped-query: head h reads kv head h // (H / H_kv)
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))
        return self.o_proj(o.transpose(1, 2).flatten(2))


class Beta12MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x))."""

    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Beta12DecoderLayer(nn.Module):
    """Pre-norm residual layer (spec §1): a = h + Attn(...), h' = a + SwiGLU(RMSNorm(a))."""

    def __init__(self, config, beta):
        super().__init__()
        self.input_layernorm = Beta12RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Beta12Attention(config, beta)
        self.post_attention_layernorm = Beta12RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Beta12MLP(config)

    def finish(self, x, attended):
        a = x + attended
        return a + self.mlp(self.post_attention_layernorm(a))


class Beta12Cache:
    """The decoding state of one batch (spec §4.5): how many tokens it holds (`length`); per
    layer the finished keys/values of completed blocks (`finished`), the finished keys/values
    of the current block's tokens, visible once it completes (`pending`); per layer application
    the construction keys/values of the current block (`block`; the standard and looped arms:
    of the whole sequence). Keys and values are `[B, H_kv, tokens, d_h]`, keys rotated."""

    is_compileable = False  # what transformers' generate() asks of a cache
    is_croppable = False

    def __init__(self, layers, applications):
        self.length = 0
        self.finished = [None] * layers
        self.pending = [None] * layers
        self.block = [None] * applications

    def get_seq_length(self, layer_idx=0):
        return self.length

    def reorder_cache(self, beam_idx):
        """Keep the rows `beam_idx` (beam search)."""
        for slots in (self.finished, self.pending, self.block):
            for i, kv in enumerate(slots):
                if kv is not None:
                    slots[i] = tuple(t.index_select(0, beam_idx.to(t.device)) for t in kv)


def _append(kv, new):
    return new if kv is None else (torch.cat([kv[0], new[0]], dim=2),
                                   torch.cat([kv[1], new[1]], dim=2))


class Beta12PreTrainedModel(PreTrainedModel):
    config_class = Beta12Config
    base_model_prefix = "model"
    _no_split_modules = ["Beta12DecoderLayer"]
    supports_gradient_checkpointing = False

    def _init_weights(self, module):
        """megabeta's initialisation: matrices normal(0, initializer_range), norms 1, beta_1.2's
        extras 0 (the output projections' 1/√(2L) scaling aside: weights are loaded anyway)."""
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, Beta12RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, Beta12Attention):
            for extra in (module.e_k, module.e_v, module.f_q, module.depth_bias, module.self_bias):
                if extra is not None:
                    nn.init.zeros_(extra)


class Beta12Model(Beta12PreTrainedModel):
    """Embedding, the layers, the final norm: hidden states `[B, T, d]`."""

    def __init__(self, config):
        super().__init__(config)
        self.arch = config.arch
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Beta12DecoderLayer(config, config.arch == "beta12")
                                    for _ in range(config.num_hidden_layers))
        self.norm = Beta12RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def new_cache(self):
        """An empty `Beta12Cache` for this model."""
        repeats = self.config.loops if self.arch == "looped" else 1
        return Beta12Cache(len(self.layers), len(self.layers) * repeats)

    # ---- the schedule ------------------------------------------------------------------------
    def _tables(self, start, length, like):
        return rope_tables(self.config.hidden_size // self.config.num_attention_heads, start,
                           length, self.config.rope_theta, like.device, like.dtype)

    def _source_layers(self, layer):
        """M(l) = {l, l+s, ...} ∩ [l, min(l+k, L-1)] (spec §3)."""
        c = self.config
        top = min(layer + c.depth_window, len(self.layers) - 1)
        return range(layer, top + 1, c.depth_stride)

    @staticmethod
    def _document_mask(bias, documents, queries, keys):
        """-inf where the key's document is not the query's (spec §7); `bias [1|B, H, n, K]`."""
        if documents is None:
            return bias
        other = documents[:, queries, None] != documents[:, None, keys]
        return bias.masked_fill(other[:, None], float("-inf"))

    @staticmethod
    def _in_block_bias(start, end, block_start, self_bias, like):
        """Queries start .. end-1 over the block's keys block_start .. end-1: 0 for earlier
        tokens of the block, `self_bias` (or 0) for the token itself, -inf after it."""
        queries = torch.arange(start, end, device=like.device)[:, None]
        keys = torch.arange(block_start, end, device=like.device)[None, :]
        bias = torch.zeros(queries.shape[0], keys.shape[1], device=like.device, dtype=like.dtype)
        bias = bias.masked_fill(keys > queries, float("-inf"))
        if self_bias is not None:
            bias = bias + (keys == queries) * self_bias.to(like.dtype)
        return bias[None, None]

    def _beta12_block(self, h, start, end, cache, documents, hidden):
        """Tokens start .. end-1, all of one block, through every layer (spec §3, §5)."""
        c = self.config
        block_start = start // c.block_size * c.block_size
        completes = end == block_start + c.block_size
        cos, sin = self._tables(start, end - start, h)
        device, heads = h.device, c.num_attention_heads
        zero = torch.zeros((), device=device, dtype=cos.dtype)  # biases in the compute dtype
        rows = torch.arange(block_start, end, device=device)
        queries = torch.arange(start, end, device=device)
        for l, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, k, v = attn.construction(layer.input_layernorm(h), cos, sin)
            keys, values, biases = [], [], []
            slope = attn.depth_slope()
            for m in self._source_layers(l):
                if cache.finished[m] is None:  # the first block: nothing finished yet
                    break
                first = 0
                if c.deep_token_window and m > l:
                    first = max(0, block_start - c.deep_token_window)
                fk, fv = cache.finished[m]
                keys.append(fk[:, :, first:])
                values.append(fv[:, :, first:])
                bias = zero.expand(1, heads, end - start, block_start - first)
                if slope is not None:
                    bias = bias - (slope * (m - l)).to(zero)[None, :, None, None]
                biases.append(self._document_mask(
                    bias, documents, queries, torch.arange(first, block_start, device=device)))
            own = _append(cache.block[l], (k, v))
            keys.append(own[0])
            values.append(own[1])
            in_block = self._in_block_bias(start, end, block_start, attn.self_bias, zero)
            biases.append(self._document_mask(in_block.expand(1, heads, -1, -1), documents,
                                              queries, rows))
            width = max(b.shape[0] for b in biases)
            bias = torch.cat([b.expand(width, -1, -1, -1) for b in biases], dim=-1)
            h = layer.finish(h, attn.attend(q, keys, values, bias))
            if hidden is not None:
                hidden[l + 1].append(h)
            cache.block[l] = own
            # Finished keys/values of layer l: computed once the tokens have passed it,
            # visible once their block completes.
            cache.pending[l] = _append(cache.pending[l],
                                       attn.finished(layer.input_layernorm(h), cos, sin))
        if completes:
            for l in range(len(self.layers)):
                cache.finished[l] = _append(cache.finished[l], cache.pending[l])
                cache.pending[l], cache.block[l] = None, None
        return h

    def _standard_block(self, h, start, end, cache, documents, hidden):
        """Tokens start .. end-1 through the stack (`loops` times for the looped arm), each
        application causal over its own construction keys/values."""
        cos, sin = self._tables(start, end - start, h)
        device = h.device
        queries = torch.arange(start, end, device=device)
        causal = self._in_block_bias(start, end, 0, None, cos[:0])
        bias = self._document_mask(causal, documents, queries, torch.arange(0, end, device=device))
        for a in range(len(cache.block)):
            layer = self.layers[a % len(self.layers)]
            attn = layer.self_attn
            q, k, v = attn.construction(layer.input_layernorm(h), cos, sin)
            own = _append(cache.block[a], (k, v))
            h = layer.finish(h, attn.attend(q, [own[0]], [own[1]], bias))
            if hidden is not None:
                hidden[a + 1].append(h)
            cache.block[a] = own
        return h

    def run(self, embeds, cache, documents=None, hidden=None):
        """Final hidden states (before the norm) of `embeds [B, n, d]`, the tokens after what
        `cache` holds; the cache advances. `hidden`: a list per layer application (and the
        embedding first) that collects each one's outputs, or None."""
        start = cache.length
        total = start + embeds.shape[1]
        if hidden is not None:
            hidden[0].append(embeds)
        if self.arch != "beta12":
            out = self._standard_block(embeds, start, total, cache, documents, hidden)
        else:
            c, pieces, position = self.config.block_size, [], start
            while position < total:  # the new tokens, cut at block boundaries
                end = min((position // c + 1) * c, total)
                pieces.append(self._beta12_block(embeds[:, position - start:end - start],
                                                 position, end, cache, documents, hidden))
                position = end
            out = torch.cat(pieces, dim=1)
        cache.length = total
        return out

    def _check_inputs(self, input_ids, inputs_embeds, attention_mask, position_ids, documents,
                      cache):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("beta12: pass exactly one of input_ids and inputs_embeds")
        n = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        if cache.length + n > self.config.max_position_embeddings:
            raise ValueError(f"beta12: {cache.length + n} tokens exceed the model's context "
                             f"(max_position_embeddings = {self.config.max_position_embeddings})")
        if attention_mask is not None and attention_mask.dim() == 2 and not bool(
                attention_mask.bool().all()):
            raise ValueError("beta12: padded batches are not supported (positions and blocks "
                             "count from each sequence's first token); batch sequences of one "
                             "length, or run them one at a time")
        if position_ids is not None:
            expected = torch.arange(cache.length, cache.length + n, device=position_ids.device)
            if not bool((position_ids == expected).all()):
                raise ValueError("beta12: position_ids must count on from the cache "
                                 f"({cache.length} .. {cache.length + n - 1}); positions are "
                                 "the tokens' own")
        if documents is not None and cache.length:
            raise ValueError("beta12: documents= with a cache that holds tokens: a cache holds "
                             "one document (spec §7); pass documents on a forward without one")

    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                past_key_values=None, inputs_embeds=None, use_cache=None,
                output_hidden_states=None, return_dict=None, documents=None, cache=None,
                **kwargs):
        cache = past_key_values if past_key_values is not None else cache
        if cache is not None and not isinstance(cache, Beta12Cache):
            if cache.get_seq_length():
                raise ValueError("beta12: the cache must be the Beta12Cache this model returned")
            cache = None  # an empty cache of another kind, made by generate(): replaced
        use_cache = self.config.use_cache if use_cache is None else use_cache
        state = cache if cache is not None else self.new_cache()
        self._check_inputs(input_ids, inputs_embeds, attention_mask, position_ids, documents,
                           state)
        embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        output_hidden_states = (self.config.output_hidden_states if output_hidden_states is None
                                else output_hidden_states)
        hidden = None
        if output_hidden_states:
            hidden = [[] for _ in range(len(state.block) + 1)]
        out = self.norm(self.run(embeds, state, documents, hidden))
        states = None if hidden is None else tuple(torch.cat(h, dim=1) for h in hidden)
        if states is not None:
            states = states[:-1] + (out,)
        return _output(BaseModelOutputWithPast, state if use_cache else None,
                       last_hidden_state=out, hidden_states=states)


class Beta12ForCausalLM(Beta12PreTrainedModel, GenerationMixin):
    """The causal LM: logits `[B, T, V]`, the LM head tied to the embedding unless
    `tie_word_embeddings` is false; `labels` give the mean next-token loss."""

    def __init__(self, config):
        super().__init__(config)
        self.model = Beta12Model(config)
        self.lm_head = (None if config.tie_word_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False  # beta_1.2 keeps its own cache (Beta12Cache), made by its forward

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def head_weight(self):
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                past_key_values=None, inputs_embeds=None, labels=None, use_cache=None,
                output_hidden_states=None, return_dict=None, logits_to_keep=0, documents=None,
                cache=None, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids, past_key_values=past_key_values,
                             inputs_embeds=inputs_embeds, use_cache=use_cache,
                             output_hidden_states=output_hidden_states, documents=documents,
                             cache=cache)
        h = outputs.last_hidden_state
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = F.linear(h, self.head_weight())
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                   labels[:, 1:].flatten().to(logits.device), ignore_index=-100)
        return _output(CausalLMOutputWithPast, outputs.get(CACHE_KEY), loss=loss, logits=logits,
                       hidden_states=outputs.hidden_states)

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None,
                                      inputs_embeds=None, cache=None, use_cache=True, **kwargs):
        """The tokens the cache has not seen yet, and the cache (this model's own: an empty one
        of another kind is replaced by the forward)."""
        state = past_key_values if past_key_values is not None else cache
        inputs = {"attention_mask": attention_mask, "use_cache": use_cache, CACHE_KEY: state}
        seen = state.get_seq_length() if state is not None else 0
        if inputs_embeds is not None and seen == 0:
            inputs["inputs_embeds"] = inputs_embeds
        else:
            inputs["input_ids"] = input_ids[:, seen:]
        return inputs

    @staticmethod
    def _reorder_cache(past_key_values, beam_idx):
        past_key_values.reorder_cache(beam_idx)
        return past_key_values
