"""beta_1.2's own dials, read from outside the model (spec §2-§3): does it use its depth window,
and do the earlier blocks still hold anything to read?

Per layer l and head h: the depth-bias slope λ_{l,h} = lambda_max·sigmoid(θ_{l,h}) (the model's
`depth_slope()`) beside its raw θ_{l,h}, the self-slot bias b_σ^l, the norms of e_K^l, e_V^l and
f^l; and, on a fixed probe batch:

- `mass/`: the share of attention mass each group of keys receives: each finished source layer
  m = l + d (d = 0 … k), the in-block keys, and the self slot;
- `entropy/`: each group's part of the softmax's entropy, -Σ_{j in group} p_j·ln p_j, in nats
  (the parts of a query sum to its entropy, `entropy/layerL/total`), and `top_key/`: the mass
  of the largest key (1: one key takes it all, 1/|keys|: uniform);
- `diversity/`: the finished values and keys of layer l (the group m = l) over the earlier
  blocks of the probe's last block, at most `DIVERSITY_POSITIONS` positions evenly spaced: the
  mean cosine between two positions (`value_cosine`, `key_cosine`; 1 = every position holds
  the same vector) and the share of their mean square that varies across positions
  (`value_varying`, `key_varying`: 1 - |mean|²/mean |x|², 0 = one shared vector). Keys are as
  stored, RoPE applied.

Collapse (`collapse_warning`): when every earlier position's finished value is the same vector,
attention has nothing to select on and nothing to copy; a layer whose `value_cosine` exceeds
`monitor.collapse_cosine` is named in a warning. At initialisation the cosine is the share of
the token identity's common direction, 0.3-0.5 on the runs measured (docs/research.md); a run
that reads nothing from earlier blocks sat at 0.97-1.00.

The probe dials come from the `reference` backend (spec §3's softmax written out): `MassRecorder`
is that backend, also summing each query's probabilities per group of its key set
(`reference.key_set`) and keeping the finished group m = l of each layer's latest cell; the
model is run through its decoding path (`prefill`, block by block) with this backend held for
the call, under no_grad, outside the training step. Nothing in the model knows it is measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megabeta.model.attention.backend import Biases, Reads
from megabeta.model.attention.reference import ReferenceAttention, key_set, scores


DIVERSITY_POSITIONS = 64
"""Earlier positions the diversity dials compare (evenly spaced): enough for a mean cosine to two
decimals, few enough that the probe stays cheap at any context length."""


def diversity(x: Tensor) -> tuple[float, float]:
    """(mean cosine between distinct positions, share of the mean square varying across
    positions) of `x [B, H_kv, S, d_h]`, each position one vector of its heads together."""
    rows = x.transpose(1, 2).flatten(2).double()  # [B, S, H_kv·d_h]
    if rows.shape[1] > DIVERSITY_POSITIONS:
        pick = torch.linspace(0, rows.shape[1] - 1, DIVERSITY_POSITIONS, device=x.device)
        rows = rows[:, pick.round().long()]
    n = rows.shape[1]
    if n < 2:
        return math.nan, math.nan
    unit = F.normalize(rows, dim=-1)
    gram = unit @ unit.transpose(1, 2)
    cosine = (gram.sum((1, 2)) - gram.diagonal(dim1=1, dim2=2).sum(-1)) / (n * (n - 1))
    square = rows.pow(2).sum(-1).mean(1)
    shared = rows.mean(1).pow(2).sum(-1)
    varying = torch.where(square > 0, 1 - shared / square.clamp_min(1e-300),
                          torch.zeros_like(square))
    return float(cosine.mean()), float(varying.mean())


class MassRecorder(ReferenceAttention):
    """The reference backend, also summing each query's attention mass, entropy and top key per
    group and layer, and keeping each layer's newest finished group m = l (module doc)."""

    def __init__(self, head_dim: int) -> None:
        super().__init__(head_dim)
        self.mass: dict[tuple[int, str], Tensor] = {}
        self.entropy: dict[tuple[int, str], Tensor] = {}
        self.top: dict[int, Tensor] = {}
        self.queries: dict[int, int] = {}
        self.finished: dict[int, tuple[Tensor, Tensor]] = {}

    def attend(self, q: Tensor, k: Tensor, v: Tensor, reads: Reads, biases: Biases, *,
               dropout_p: float) -> Tensor:
        out = super().attend(q, k, v, reads, biases, dropout_p=dropout_p)
        c, nk = q.shape[3], k.shape[3]
        starts = reads.starts(c) if reads.history is not None else [0] * len(reads.layers)
        for i, (layer, start) in enumerate(zip(reads.layers, starts)):
            keys = key_set(q[i], k[i], v[i], reads, biases, i, start)
            p = torch.softmax(scores(q[i], keys, None if reads.lower is None
                                     else reads.lower[i]), dim=-1)
            plogp = torch.special.xlogy(p, p).neg()
            mass: dict[str, Tensor] = {}
            entropy: dict[str, Tensor] = {}
            column = 0
            for kind, offset, width in keys.groups:
                part = slice(column, column + width)
                if kind == "finished":
                    name = f"finished_d{offset}"
                    mass[name] = mass.get(name, 0.0) + p[..., part].sum()
                    entropy["finished"] = entropy.get("finished", 0.0) + plogp[..., part].sum()
                    if offset == 0:
                        self.finished[layer] = (keys.keys[:, :, part], keys.values[:, :, part])
                else:
                    # Query r is own key nk - c + r: its self slot.
                    for store, x in ((mass, p[..., part]), (entropy, plogp[..., part])):
                        diagonal = x.diagonal(offset=nk - c, dim1=-2, dim2=-1).sum()
                        store["self"] = diagonal
                        store["in_block"] = x.sum() - diagonal
                column += width
            entropy["total"] = plogp.sum()
            for store, values in ((self.mass, mass), (self.entropy, entropy)):
                for name, value in values.items():
                    store[layer, name] = store.get((layer, name), 0.0) + value.double()
            self.top[layer] = self.top.get(layer, 0.0) + p.amax(-1).sum().double()
            self.queries[layer] = self.queries.get(layer, 0) + q[i].numel() // q.shape[-1]
        return out

    def shares(self) -> dict[str, float]:
        """Mean share per layer and group over every query head and position of the probe."""
        return {f"layer{layer}/{name}": float(total) / self.queries[layer]
                for (layer, name), total in sorted(self.mass.items())}

    def dials(self) -> dict[str, float]:
        """Every probe dial, named as logged (module doc), means over the probe's queries."""
        out = {f"mass/{k}": v for k, v in self.shares().items()}
        out.update({f"entropy/layer{layer}/{name}": float(total) / self.queries[layer]
                    for (layer, name), total in sorted(self.entropy.items())})
        out.update({f"top_key/layer{layer}": float(total) / self.queries[layer]
                    for layer, total in sorted(self.top.items())})
        for layer, (k, v) in sorted(self.finished.items()):
            for name, x in (("value", v), ("key", k)):
                cosine, varying = diversity(x)
                out[f"diversity/layer{layer}/{name}_cosine"] = cosine
                out[f"diversity/layer{layer}/{name}_varying"] = varying
        return out


def collapse_warning(dials: dict[str, float], threshold: float) -> str | None:
    """A sentence naming the layers whose finished values have collapsed (mean cosine between
    earlier positions above `threshold`, `monitor.collapse_cosine`), or None."""
    collapsed = {key.split("/")[1]: value for key, value in dials.items()
                 if key.startswith("diversity/") and key.endswith("/value_cosine")
                 and value > threshold}
    if not collapsed:
        return None
    named = ", ".join(f"{layer} {value:.3f}" for layer, value in collapsed.items())
    return (f"finished values collapsed: the earlier blocks' values of {named} are nearly one "
            f"vector (mean cosine between positions > monitor.collapse_cosine = {threshold}), so "
            "attention has nothing to read from earlier blocks; see docs/research.md for the "
            "levers (train.block_size_schedule, model.init_embed_scale, model.init_branch_scale)")


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
    """(scalars, histograms) of the extras: λ and θ per layer and head, b_σ, |e_K|, |e_V|, |f|."""
    scalars: dict[str, float] = {}
    histograms: dict[str, Tensor] = {}
    slopes = []
    for l, layer in enumerate(model.layers):
        attention = layer.attention
        if attention.depth_bias is not None:
            slope = attention.depth_slope().detach().float()
            slopes.append(slope)
            for h, (value, theta) in enumerate(zip(slope.tolist(),
                                                   attention.depth_bias.detach().tolist())):
                scalars[f"lambda/layer{l}/head{h}"] = value
                scalars[f"theta/layer{l}/head{h}"] = theta
        if attention.self_bias is not None:
            scalars[f"b_sigma/layer{l}"] = float(attention.self_bias.detach().float().sum())
        for name, p in (("e_K", attention.e_k), ("e_V", attention.e_v), ("f", attention.f_q)):
            if p is not None:
                scalars[f"{name}_norm/layer{l}"] = float(p.detach().float().norm())
    if slopes:
        histograms["lambda"] = torch.cat(slopes)
    return scalars, histograms


@torch.no_grad()
def probe_dials(model: nn.Module, probe: Tensor) -> MassRecorder:
    """The recorder after a run of `probe [B, T]` through the model (eval mode, no dropout)."""
    recorder = MassRecorder(model.config.head_dim)
    was_training = model.training
    model.eval()
    try:
        with _held(model, recorder):
            model.prefill(probe)
    finally:
        model.train(was_training)
    return recorder


def attention_shares(model: nn.Module, probe: Tensor) -> dict[str, float]:
    """Attention-mass share per layer and group on `probe [B, T]`."""
    return probe_dials(model, probe).shares()


def beta_dials(model: nn.Module, probe: Tensor | None) -> tuple[dict[str, float],
                                                                dict[str, Tensor]]:
    """Every dial: the parameters' and, with a probe batch, the probe's (a collective under
    FSDP2 and ZeRO-3: every rank calls it, each on its own probe)."""
    with _whole_parameters(model):
        scalars, histograms = parameter_dials(model)
        if probe is not None:
            scalars.update(probe_dials(model, probe).dials())
    return scalars, histograms


def has_dials(model: nn.Module) -> bool:
    """Whether `model` is a beta_1.2 arm (the controls have no extras to read)."""
    return bool(getattr(model, "beta_extras", False))


__all__ = ["DIVERSITY_POSITIONS", "MassRecorder", "attention_shares", "beta_dials",
           "collapse_warning", "diversity", "has_dials", "parameter_dials", "probe_dials"]
