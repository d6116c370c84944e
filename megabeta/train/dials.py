"""beta_1.2's own dials, read from outside the model (spec §2-§3): does it use its depth window?

Per layer l and head h: the depth-bias slope λ_{l,h} = lambda_max·sigmoid(θ_{l,h}) (the model's
`depth_slope()`), the self-slot bias b_σ^l, the norms of e_K^l, e_V^l and f^l; and, on a fixed
probe batch, the share of attention mass each group of keys receives: each finished source
layer m = l + d (d = 0 … k), the in-block keys, and the self slot.

The shares come from the model's own `explicit` attention (spec §3's softmax written out):
`MassRecorder` is that backend, attending a second time with the values replaced by group
indicators, so that the output IS each group's probability mass; the model is run through its
decoding path (`prefill`, block by block, history as pieces) with this backend held for the
call. Nothing in the model knows it is measured.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor, nn

from megabeta.model.attention.backend import AttentionBias, KeySet
from megabeta.model.attention.explicit import ExplicitAttention


class MassRecorder(ExplicitAttention):
    """The explicit backend, also summing each query's attention mass per group and layer."""

    def __init__(self, head_dim: int) -> None:
        super().__init__(head_dim)
        self.mass: dict[tuple[int, str], Tensor] = {}
        self.queries: dict[int, int] = {}

    def attend(self, q: Tensor, keys: KeySet, bias: AttentionBias, *, layer: int,
               dropout_p: float) -> Tensor:
        out = super().attend(q, keys, bias, layer=layer, dropout_p=dropout_p)
        batch, kv_heads, n = keys.k.shape[:3]
        # The probe feeds whole blocks from their start: the history is finished groups only
        # (no decoding prefix). Values: one indicator column per finished group (by depth
        # offset), then the identity over the block for the construction keys, whose diagonal
        # is the self slot and the rest the in-block keys.
        groups = sorted({offset for offset, _, _ in keys.finished})
        width = len(groups)
        finished = []
        for offset, k, v in keys.finished:
            indicator = v.new_zeros(batch, kv_heads, v.shape[2], width + n)
            indicator[..., groups.index(offset)] = 1
            finished.append((offset, k, indicator))
        own = keys.v.new_zeros(batch, kv_heads, n, width + n)
        own[..., width:] = torch.eye(n, dtype=own.dtype, device=own.device)
        indicators = KeySet(keys.k, own, finished=finished)
        mass = super().attend(q, indicators, bias, layer=layer, dropout_p=0.0)
        square = mass[..., width:]
        self_mass = square.diagonal(dim1=-2, dim2=-1).sum()
        shares = {f"finished_d{g}": mass[..., i].sum() for i, g in enumerate(groups)}
        shares["in_block"] = square.sum() - self_mass
        shares["self"] = self_mass
        for name, value in shares.items():
            key = (layer, name)
            self.mass[key] = self.mass.get(key, 0.0) + value.double()
        self.queries[layer] = self.queries.get(layer, 0) + q.numel() // q.shape[-1]
        return out

    def shares(self) -> dict[str, float]:
        """Mean share per layer and group over every query head and position of the probe."""
        return {f"layer{layer}/{name}": float(total) / self.queries[layer]
                for (layer, name), total in sorted(self.mass.items())}


@contextlib.contextmanager
def _held(model: nn.Module, backend: MassRecorder) -> Iterator[None]:
    """`backend` as the model's attention for the duration; its own back afterwards."""
    own = model.attention_backend
    model.attention_backend = backend
    try:
        yield
    finally:
        model.attention_backend = own


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
