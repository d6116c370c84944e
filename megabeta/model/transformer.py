"""The decoder-only language-model skeleton shared by all arms, and the two control arms.

`DecoderLM` owns what every arm has (spec §1): token embedding, the layer stack, final RMSNorm,
LM head, initialisation, the next-token loss and the decoding API. Subclasses decide how the
layers are applied: `StandardTransformer` (full-sequence causal attention), `LoopedTransformer`
(the weight-tied stack applied `loops` times, the article's looped-Transformer comparison) and
`Beta12Transformer` (block by block, spec §3; in `beta12.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megabeta.model.attention.backend import NO_BIASES, AttentionBackend, Reads
from megabeta.model.attention.select import select_attention
from megabeta.model.cache import DecodeCache
from megabeta.model.config import ConfigError, ModelConfig
from megabeta.model.documents import document_starts
from megabeta.model.elementwise import select_elementwise_kernels
from megabeta.model.execution import ExecutionConfig
from megabeta.model.executor import Executor
from megabeta.model.layers import (
    BranchWeights,
    ElementwiseKernels,
    Projection,
    RMSNorm,
    TransformerLayer,
    autocast_dtype,
    matmul_dtype,
    rope_tables,
)
from megabeta.model.wave import Body, OwnKeys
from megabeta.model.loss import IGNORE_INDEX, linear_cross_entropy

LOSS_CHUNK = 512
"""Tokens (of the whole batch) per piece of the chunked training loss (see `DecoderLM.head`)."""


@dataclass(frozen=True)
class ParallelPlan:
    """What the parallelisms (`megabeta.parallel.wrap`) need to know of an arm, declared by the
    arm so that they need not know its class."""

    fsdp_units: tuple[nn.Module, ...]
    """Submodules sharded as FSDP units of their own (the root is one more)."""


class DecoderLM(nn.Module):
    """Embedding → layers → RMSNorm → LM head, with the next-token loss and KV-cache decoding."""

    beta_extras = False

    def __init__(self, config: ModelConfig, execution: ExecutionConfig | None = None) -> None:
        super().__init__()
        if config.vocab_size < 1:
            raise ConfigError("model.vocab_size = -1 must be resolved before building the model: "
                              "set --model.vocab_size or take it from the dataset sidecar")
        self.config = config
        self.execution = ExecutionConfig() if execution is None else execution
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(TransformerLayer(config, self.beta_extras)
                                    for _ in range(config.num_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.output = (None if config.tie_embedding
                       else nn.Linear(config.d_model, config.vocab_size, bias=False))
        self.init_weights()
        self._select_kernels()

    def parallel_plan(self) -> ParallelPlan:
        """One FSDP unit per layer."""
        return ParallelPlan(tuple(self.layers))

    def branches(self, x: Tensor, o: Tensor, weights: BranchWeights) -> tuple[Tensor, Tensor]:
        """The residual branches of the cells `x [n, B, c, d]` (`layers.residual_branches`,
        compiled where the executor compiles): the stream after attention and the SwiGLU
        branch, with this model's kernels and, in training, its dropout."""
        return self.executor.branches(x, o, weights, kernels=self.elementwise_kernels,
                                      eps=self.config.norm_eps,
                                      dropout=self.config.dropout if self.training else 0.0)

    # ---- parameters -----------------------------------------------------------------------------
    def init_weights(self) -> None:
        """Normal(0, init_std) matrices; the embedding's times init_embed_scale, the residual
        projections' times init_branch_scale/√(2L); norms 1; extras 0 (spec §2: the layer
        encodings and biases start at zero; the rest the spec leaves to us)."""
        c = self.config
        std = c.init_std
        depth_scale = c.init_branch_scale / math.sqrt(2 * c.num_layers)
        for name, p in self.named_parameters():
            if name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(p, std=std * depth_scale)
            elif name == "tok_embeddings.weight":
                nn.init.normal_(p, std=std * c.init_embed_scale)
            elif p.dim() == 2:
                nn.init.normal_(p, std=std)
            elif name.endswith("norm.weight"):
                nn.init.ones_(p)
            else:
                nn.init.zeros_(p)

    # ---- execution ------------------------------------------------------------------------------
    def _select_kernels(self) -> None:
        """Choose the attention backend (attention/select.py), the elementwise kernels
        (elementwise.py) and the executor (executor.py) for the parameters' device, once: here
        and whenever the model moves to another device (`_apply`), never per call."""
        c = self.config
        device = self.tok_embeddings.weight.device
        self.kernels_device = device
        """The device the kernels were chosen for."""
        self.elementwise_kernels: ElementwiseKernels = select_elementwise_kernels(
            self.execution.elementwise_kernels, device=device)
        self.attention_backend: AttentionBackend = select_attention(
            self.execution.attention, device=device, dropout=c.dropout, head_dim=c.head_dim)
        if self.execution.cuda_graphs and c.dropout:
            raise ConfigError(f"execution.cuda_graphs = true replays the pass with fixed random "
                              f"numbers; model.dropout = {c.dropout} draws new ones every step: "
                              f"set execution.cuda_graphs = false")
        self.executor = Executor(self.execution, backend=self.attention_backend, device=device,
                                 layers=c.num_layers)
        self.body = Body(self.attention_backend, self.elementwise_kernels, c.norm_eps)
        """What the layer body reads of this model (model/wave.py)."""

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> "DecoderLM":
        # `to`, `cuda`, `cpu`, `to_empty`, dtype casts all end here: the device may have changed.
        # Only a new device makes a new choice (and drops what the old one kept: captured
        # graphs, pooled buffers); a dtype cast keeps them, they are keyed by dtype.
        out = super()._apply(fn, recurse)
        if self.tok_embeddings.weight.device != self.kernels_device:
            self._select_kernels()
        return out

    def head_weight(self) -> Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def logits(self, h: Tensor) -> Tensor:
        return F.linear(self.norm(h), self.head_weight())

    def rope(self, start: int, length: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """RoPE tables for positions `start … start+length-1` in `like`'s dtype and device.

        Built in float64 on the fly (cheap: once per block) so that a float64 model is exact.
        """
        cos, sin = rope_tables(self.config.head_dim, start, length, self.config.rope_theta)
        return cos.to(like.device, like.dtype), sin.to(like.device, like.dtype)

    # ---- helpers for subclasses -----------------------------------------------------------------
    def _document_starts(self, documents: Tensor | None, tokens: Tensor) -> Tensor | None:
        """The pass's document starts (`documents.document_starts`)."""
        return document_starts(documents, tokens)

    def _check_length(self, length: int) -> None:
        if length > self.config.max_seq_len:
            raise ValueError(f"sequence of {length} tokens exceeds model.max_seq_len = "
                             f"{self.config.max_seq_len}; raise max_seq_len or shorten the input")

    def head(self, h: Tensor, targets: Tensor | None) -> Tensor:
        """Logits of final hidden states `h [B, T, d]`, or the mean next-token loss over the
        scored targets (those not IGNORE_INDEX; 0, with no gradient, when none is scored).

        The loss runs over LOSS_CHUNK tokens of the whole batch (the `[B, T]` tokens flattened)
        at a time (`loss.linear_cross_entropy`), so the `[B·T, vocab]` logits never exist at
        once in training. Chunks are not blocks: the LM head's weight gradient (vocab x d) is
        accumulated once per chunk, and per 32-token block it dominated a t19_flash step.
        """
        if targets is None:
            return self.logits(h)
        total = linear_cross_entropy(self.norm(h).flatten(0, 1), self.head_weight(),
                                     targets.flatten(), LOSS_CHUNK)
        # clamp: a micro-batch whose targets are all masked gives 0, not 0/0 (its scale in the
        # trainer is 0 then; a NaN times 0 would still poison the gradients).
        return total / (targets != IGNORE_INDEX).sum().clamp(min=1)

    # ---- decoding (spec §4.5) -------------------------------------------------------------------
    def new_cache(self, batch: int, capacity: int | None = None) -> DecodeCache:
        raise NotImplementedError

    def extend(self, tokens: Tensor, cache: DecodeCache) -> Tensor:
        """Feed `tokens [B, n]` after what `cache` holds; return their logits `[B, n, V]`."""
        raise NotImplementedError

    def decode_weights(self, cache: DecodeCache, build: Callable[[], Any]) -> Any:
        """`build()` (the fused weights of one pass), kept in `cache` while the parameters are
        unchanged: decoding calls `extend` once per token, and rebuilding every layer's fused
        weights each time would copy them all per token. A parameter's `_version` counts its
        in-place updates (optimizer steps, `load_state_dict`), so changed weights are rebuilt."""
        stamp = tuple((id(p), p._version) for p in self.parameters())
        if cache.weights is None or cache.weights[0] != stamp:
            cache.weights = (stamp, build())
        return cache.weights[1]

    def _capacity(self, capacity: int | None) -> int:
        capacity = self.config.max_seq_len if capacity is None else capacity
        self._check_length(capacity)
        return capacity

    @torch.no_grad()
    def prefill(self, tokens: Tensor, capacity: int | None = None) -> tuple[Tensor, DecodeCache]:
        """Logits `[B, T, V]` of a prompt and the cache to continue it (at most `capacity` tokens)."""
        cache = self.new_cache(tokens.shape[0], capacity)
        return self.extend(tokens, cache), cache

    @torch.no_grad()
    def step(self, token: Tensor, cache: DecodeCache) -> Tensor:
        """Logits `[B, V]` of the next token `token [B]`; the cache advances in place."""
        return self.extend(token[:, None], cache)[:, -1]


class StandardTransformer(DecoderLM):
    """Plain pre-norm RoPE/SwiGLU Transformer: each layer attends causally to its own input."""

    def _repeats(self) -> int:
        """How many times the stack is applied (the looped arm repeats it)."""
        return 1

    def _applications(self, dtype: torch.dtype | None = None
                      ) -> list[tuple[Projection, BranchWeights]]:
        """Per layer application, its fused input projection (in the compute `dtype`) and branch
        weights (layers.Projection, layers.BranchWeights), built once per pass."""
        c = self.config
        weights = [(Projection(layer.attention.input_rows(layer.attention_norm), c.head_dim,
                               self.elementwise_kernels, dtype=dtype),
                    layer.pass_weights())
                   for layer in self.layers]
        return weights * self._repeats()

    def _layer(self, weights: tuple[Projection, BranchWeights], x: Tensor, cos: Tensor,
               sin: Tensor, lower: Tensor | None, own: OwnKeys | None = None,
               application: int = 0) -> Tensor:
        """One layer on the tokens `x [B, n, d]` (RoPE tables `cos/sin`): one cell of n tokens
        (spec §4.1: c = T), reading the earlier tokens' K/V from `own` when decoding; `lower
        [B, n]`: the queries' document bounds (spec §7), or None."""
        projection, branches = weights
        kernels, eps = self.elementwise_kernels, self.config.norm_eps
        q, k, v = (t[None] for t in projection(kernels.rms_normalize(x, eps, dtype=matmul_dtype(x)), cos, sin))
        if own is not None:
            k, v = own.extend(application, k, v)
        dropout = self.config.dropout if self.training else 0.0
        reads = Reads((0,), None, None if lower is None else lower[None])
        o = self.attention_backend.attend(q, k, v, reads, NO_BIASES, dropout_p=dropout)
        a, mlp = self.branches(x[None], o.reshape(1, -1, o.shape[3] * o.shape[4]), branches)
        return (a + mlp).squeeze(0)

    def forward(self, tokens: Tensor, targets: Tensor | None = None,
                documents: Tensor | None = None) -> Tensor:
        """Logits `[B, T, V]`, or the mean next-token loss when `targets [B, T]` is given;
        `documents [B, T]`: the tokens' document ids (spec §7), None: one document."""
        self._check_length(tokens.shape[1])
        starts = self._document_starts(documents, tokens)
        x = self.tok_embeddings(tokens)
        cos, sin = self.rope(0, tokens.shape[1], x)
        for weights in self._applications(autocast_dtype(x.device)):
            x = self.executor.layer(lambda h, weights=weights:
                                    self._layer(weights, h, cos, sin, starts), x)
        return self.head(x, targets)

    def new_cache(self, batch: int, capacity: int | None = None) -> DecodeCache:
        capacity = self._capacity(capacity)
        c, p = self.config, self.tok_embeddings.weight
        shape = (len(self.layers) * self._repeats(), batch, c.num_kv_heads, capacity, c.head_dim)
        return DecodeCache(0, capacity, p.new_empty(shape), p.new_empty(shape))

    @torch.no_grad()
    def extend(self, tokens: Tensor, cache: DecodeCache) -> Tensor:
        cache.reserve(tokens.shape[1])
        x = self.tok_embeddings(tokens)
        cos, sin = self.rope(cache.position, tokens.shape[1], x)
        own = OwnKeys(cache.construction_k, cache.construction_v, cache.position)
        for application, weights in enumerate(self.decode_weights(cache, self._applications)):
            x = self._layer(weights, x, cos, sin, None, own, application)
        cache.position += tokens.shape[1]
        return self.logits(x)


class LoopedTransformer(StandardTransformer):
    """The weight-tied stack applied `config.loops` times (article §9: depth bought with FLOPs)."""

    def _repeats(self) -> int:
        return self.config.loops
