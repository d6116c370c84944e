"""beta_1.2's own dials, read from outside the model (spec §2-§3): does it use its depth window?

Per layer l and head h: the depth-bias slope λ_{l,h} = lambda_max·sigmoid(θ_{l,h}) (the model's
`depth_slope()`), the self-slot bias b_σ^l, the norms of e_K^l, e_V^l and f^l; and, on a fixed
probe batch, the share of attention mass each group of keys receives: each finished source
layer m = l + d (d = 0 … k), the in-block keys, and the self slot.

The shares come from the `reference` backend (spec §3's softmax written out): `MassRecorder` is
that backend, also summing each query's probabilities per group of its key set
(`reference.key_set`); the model is run through its decoding path (`prefill`, block by block)
with this backend held for the call. Nothing in the model knows it is measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import torch
from torch import Tensor, nn

from megabeta.model.attention.backend import Biases, Reads
from megabeta.model.attention.reference import ReferenceAttention, key_set, scores


class MassRecorder(ReferenceAttention):
    """The reference backend, also summing each query's attention mass per group and layer."""

    def __init__(self, head_dim: int) -> None:
        super().__init__(head_dim)
        self.mass: dict[tuple[int, str], Tensor] = {}
        self.queries: dict[int, int] = {}

    def attend(self, q: Tensor, k: Tensor, v: Tensor, reads: Reads, biases: Biases, *,
               dropout_p: float) -> Tensor:
        out = super().attend(q, k, v, reads, biases, dropout_p=dropout_p)
        c, nk = q.shape[3], k.shape[3]
        starts = reads.starts(c) if reads.history is not None else [0] * len(reads.layers)
        for i, (layer, start) in enumerate(zip(reads.layers, starts)):
            keys = key_set(q[i], k[i], v[i], reads, biases, i, start)
            p = torch.softmax(scores(q[i], keys, None if reads.lower is None
                                     else reads.lower[i]), dim=-1)
            shares: dict[str, Tensor] = {}
            column = 0
            for kind, offset, width in keys.groups:
                if kind == "finished":
                    name = f"finished_d{offset}"
                    shares[name] = shares.get(name, 0.0) + p[..., column:column + width].sum()
                else:
                    own = p[..., column:column + width]
                    # Query r is own key nk - c + r: its self slot.
                    diagonal = own.diagonal(offset=nk - c, dim1=-2, dim2=-1).sum()
                    shares["self"] = diagonal
                    shares["in_block"] = own.sum() - diagonal
                column += width
            for name, value in shares.items():
                key = (layer, name)
                self.mass[key] = self.mass.get(key, 0.0) + value.double()
            self.queries[layer] = self.queries.get(layer, 0) + q[i].numel() // q.shape[-1]
        return out

    def shares(self) -> dict[str, float]:
        """Mean share per layer and group over every query head and position of the probe."""
        return {f"layer{layer}/{name}": float(total) / self.queries[layer]
                for (layer, name), total in sorted(self.mass.items())}


@contextlib.contextmanager
def _held(model: nn.Module, backend: MassRecorder) -> Iterator[None]:
    """`backend` as the model's attention for the duration (what its layer body reads); its
    own back afterwards."""
    own, body = model.attention_backend, model.body
    model.attention_backend = backend
    model.body = dataclasses.replace(body, attention=backend)
    try:
        yield
    finally:
        model.attention_backend, model.body = own, body


@contextlib.contextmanager
def _whole_parameters(model: nn.Module) -> Iterator[None]:
    """The model's parameters whole for the duration (a collective: every rank enters): FSDP2's
    shards gathered (`unshard`, which puts the whole tensors in the modules) and sharded again
    after; DeepSpeed ZeRO-3's partitions gathered (`GatheredParameters`); as they are otherwise.
    The dials read the layers' weights outside their forward, where neither would gather."""
    sharded = [m for m in model.modules() if hasattr(m, "unshard") and hasattr(m, "reshard")]
    partitioned = [p for p in model.parameters() if hasattr(p, "ds_id")]
    gathered = contextlib.nullcontext()
    if partitioned:
        import deepspeed  # only a ZeRO-3 model has partitioned parameters

        gathered = deepspeed.zero.GatheredParameters(partitioned)
    for module in sharded:
        module.unshard()
    try:
        with gathered:
            yield
    finally:
        for module in sharded:
            module.reshard()


def parameter_dials(model: nn.Module) -> tuple[dict[str, float], dict[str, Tensor]]:
    """(scalars, histograms) of the extras: λ per layer and head, b_σ, |e_K|, |e_V|, |f|."""
    scalars: dict[str, float] = {}
    histograms: dict[str, Tensor] = {}
    slopes = []
    for l, layer in enumerate(model.layers):
        attention = layer.attention
        if attention.depth_bias is not None:
            slope = attention.depth_slope().detach().float()
            slopes.append(slope)
            for h, value in enumerate(slope.tolist()):
                scalars[f"lambda/layer{l}/head{h}"] = value
        if attention.self_bias is not None:
            scalars[f"b_sigma/layer{l}"] = float(attention.self_bias.detach().float().sum())
        for name, p in (("e_K", attention.e_k), ("e_V", attention.e_v), ("f", attention.f_q)):
            if p is not None:
                scalars[f"{name}_norm/layer{l}"] = float(p.detach().float().norm())
    if slopes:
        histograms["lambda"] = torch.cat(slopes)
    return scalars, histograms


@torch.no_grad()
def attention_shares(model: nn.Module, probe: Tensor) -> dict[str, float]:
    """Attention-mass share per layer and group on `probe [B, T]` (eval mode, no dropout)."""
    recorder = MassRecorder(model.config.head_dim)
    was_training = model.training
    model.eval()
    try:
        with _held(model, recorder):
            model.prefill(probe)
    finally:
        model.train(was_training)
    return recorder.shares()


def beta_dials(model: nn.Module, probe: Tensor | None) -> tuple[dict[str, float],
                                                                dict[str, Tensor]]:
    """Every dial: the parameters' and, with a probe batch, the attention-mass shares (a
    collective under FSDP2 and ZeRO-3: every rank calls it, each on its own probe)."""
    with _whole_parameters(model):
        scalars, histograms = parameter_dials(model)
        if probe is not None:
            scalars.update({f"mass/{k}": v for k, v in attention_shares(model, probe).items()})
    return scalars, histograms


def has_dials(model: nn.Module) -> bool:
    """Whether `model` is a beta_1.2 arm (the controls have no extras to read)."""
    return bool(getattr(model, "beta_extras", False))


__all__ = ["MassRecorder", "attention_shares", "beta_dials", "has_dials", "parameter_dials"]
