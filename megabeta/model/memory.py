"""A memory model of one training micro-step: the bytes a GPU holds at the step's peak, per
sequence of a length and fixed, for an execution setting (counted, not measured).

    step = step_memory(config, execution, seq_len=16384, act_bytes=2)
    step.total(batch=8)                    # bytes at the peak
    step.largest_batch(80 * 2**30)         # the largest micro-batch that fits with headroom

What a beta12 pass holds for each sequence until its backward ends (model/passes.py):

- the history: finished K/V of every layer and position `[L, T, H_kv, d_h]` twice, in the
  activations' dtype, and its gradient buffers (the activations' dtype where the backend forms
  each row's gradient once, `KeyLayout.deferred`; float32 where readers add into them);
- the Triton backend's reader buffers (queries, output gradients `[L, H, T, d_h]` and float32
  lse, shifts and delta) from which the history's gradients are formed once per row;
- the weight-gradient rows: where the by-hand weight stacks form their gradients once per pass
  (`weight_gradients="pass"`, a GPU's form, layers.StackedWeight) they keep every call's input
  rows and output gradient rows until the pass ends, so T x L x sum(d_in + d_out) values, and at
  the end one stack's rows concatenated again (the largest stack counted); formed per call (a
  CPU's form) they keep none, and the stacks' float32 gradient sums are fixed;
- the embeddings, the final hidden states and their gradients in the parameters' dtype.

That is the peak at the backward's end, with recomputation plus the graph of the unit being
recomputed (a block's cells, or a wave's). At the forward's end the pass holds instead the
units' saved inputs (with recomputation: the blocks' embeddings, on the wavefront each wave's
carried state) or without it every cell's autograd graph (a layer's activations a token, as the
control arms', and the finished K/V projection's rows); the larger phase is the step's.

Fixed: parameters, gradients and AdamW's two moments (divided by `shards` where ZeRO or FSDP
shard them), the pass's weight stacks cast once to the matmuls' dtype and their gradients, and
the loss's logits for one chunk of LOSS_CHUNK rows. The control arms keep one residual stream per
layer with recomputation (`layer`), or every layer's activations without.

Not counted: allocator fragmentation and the CUDA context (the headroom of `largest_batch`),
communication buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megabeta.model.config import ModelConfig, count_parameters
from megabeta.model.execution import ExecutionConfig
from megabeta.model.geometry import blocks, matmul_shapes
from megabeta.model.plan import period

LOSS_CHUNK_ROWS = 512
"""model/transformer.py's LOSS_CHUNK (kept equal by tests/unit/model/test_memory.py)."""
HEADROOM = 0.85
"""The share of a GPU's memory `largest_batch` plans to fill: the rest for the CUDA context,
the allocator's fragmentation and what the model leaves out."""


@dataclass(frozen=True)
class StepMemory:
    """Bytes of one micro-step: `fixed` whatever the batch, `per_sequence` per sequence, each
    with its parts by name."""

    fixed: dict[str, float] = field(default_factory=dict)
    per_sequence: dict[str, float] = field(default_factory=dict)

    @property
    def fixed_bytes(self) -> float:
        return sum(self.fixed.values())

    @property
    def sequence_bytes(self) -> float:
        return sum(self.per_sequence.values())

    def total(self, batch: int) -> float:
        """Bytes at the peak of a micro-step of `batch` sequences."""
        return self.fixed_bytes + batch * self.sequence_bytes

    def largest_batch(self, capacity: float, headroom: float = HEADROOM) -> int:
        """The largest micro-batch whose peak fits `headroom` x `capacity` bytes (0: none)."""
        return max(0, int((headroom * capacity - self.fixed_bytes) // self.sequence_bytes))


def step_memory(config: ModelConfig, execution: ExecutionConfig, seq_len: int, *,
                act_bytes: int = 2, param_bytes: int = 4, shards: int = 1,
                deferred: bool = True, readers: bool = True, weight_gradients: str = "pass",
                vocab_size: int | None = None) -> StepMemory:
    """The memory of a micro-step (module doc) at `seq_len` tokens a sequence.

    `act_bytes`: the matmuls' and activations' dtype (2 under bf16 autocast, 4 in float32);
    `param_bytes`: the parameters' (4: float32, 2: FSDP's bf16 parameters); `shards`: ranks the
    parameters, gradients and optimizer state are sharded over; `deferred`, `readers`: the
    attention backend forms each history row's gradient once (triton, cpu) from reader buffers
    (triton); `weight_gradients`: how the pass forms its weight gradients ("pass" or "call",
    model/executor.py chooses by device)."""
    if weight_gradients not in ("pass", "call"):
        raise ValueError(f"step_memory: weight_gradients must be 'pass' or 'call', got "
                         f"{weight_gradients!r}")
    vocab = config.vocab_size if config.vocab_size > 0 else (vocab_size or 0)
    d, hd, L = config.d_model, config.head_dim, config.num_layers
    heads, kv, H = config.num_heads, config.num_kv_heads, config.hidden_dim
    layer_params = count_parameters(config.replace(vocab_size=-1)) - d
    params = layer_params + d + vocab * d * (1 if config.tie_embedding else 2)
    chunk = LOSS_CHUNK_ROWS * vocab
    fixed = {"parameters": params * param_bytes / shards,
             "gradients": params * param_bytes / shards,
             "optimizer": params * 8 / shards,
             "logits (one loss chunk)": chunk * (4 + act_bytes + 4)}
    streams = seq_len * d * param_bytes
    if config.arch != "beta12":
        return StepMemory(fixed, _control(config, execution, seq_len, act_bytes, streams))

    fixed["weight stacks and their gradients"] = 2 * layer_params * act_bytes
    T = seq_len
    history = 2 * L * T * kv * hd
    held = {"history K/V": history * act_bytes,
            "embeddings, hidden states, gradients": 4 * streams}
    stacks: dict[int, float] = {}
    last = blocks(config, T)[-1][0]
    for start, n in blocks(config, T):
        for layer in range(L):
            for i, (d_in, d_out) in enumerate(matmul_shapes(config, layer, start < last)):
                stacks[i] = stacks.get(i, 0) + n * (d_in + d_out) * act_bytes
    rows = sum(stacks.values())
    # What autograd keeps of one cell per token: a layer's activations (as the control arms'),
    # and the finished K/V projection's rows.
    cell = _layer_activations(config) * act_bytes + 2 * d * 4 + (d + 2 * kv * hd) * act_bytes
    # The forward's end: the units' saved inputs, or without recomputation every cell's graph.
    forward = dict(held)
    if execution.activation_checkpoint == "none":
        forward["cell graphs"] = T * L * cell
    else:
        forward["unit inputs"] = streams
        if execution.schedule == "wavefront":
            p = period(execution.schedule, L, config.depth_window)
            forward["waves' carried state"] = T * (p - 1) * (
                d * param_bytes + (heads + 2 * kv) * hd * act_bytes)
    # The backward's end: every unit has run backward (its saved inputs gone) and the weight
    # stacks' gradients are formed from their rows, one stack's concatenated at a time.
    backward = dict(held)
    if execution.activation_checkpoint != "none":
        # The unit being recomputed: a block's cells, or a wave's (about L / p of them).
        cells = (L if execution.schedule == "block"
                 else -(-L // period(execution.schedule, L, config.depth_window)))
        backward["one unit's graph"] = config.block_size * cells * cell
    backward["history gradients"] = history * (act_bytes if deferred else max(act_bytes, 4))
    if readers:
        groups = config.depth_window + 1
        backward["attention readers"] = L * T * heads * (2 * hd * act_bytes + 4 * (groups + 1))
    if weight_gradients == "pass":
        backward["weight-gradient rows"] = rows + max(stacks.values())
    else:
        fixed["weight-gradient sums"] = layer_params * 4
    per = max(forward, backward, key=lambda parts: sum(parts.values()))
    return StepMemory(fixed, per)


def _layer_activations(config: ModelConfig) -> int:
    """Values one token's layer keeps for autograd: norms' inputs and outputs, Q/K/V before and
    after RoPE, attention output, SwiGLU's gate, up and product."""
    d, hd = config.d_model, config.head_dim
    return 4 * d + 3 * (config.num_heads + config.num_kv_heads) * hd + 3 * config.hidden_dim


def _control(config: ModelConfig, execution: ExecutionConfig, seq_len: int, act_bytes: int,
             streams: float) -> dict[str, float]:
    """The control arms: one residual stream per layer with per-layer recomputation (and one
    layer's activations during its recomputation), every layer's activations without."""
    layer = seq_len * (_layer_activations(config) * act_bytes + 2 * config.d_model * 4)
    per = {"embeddings, hidden states, gradients": 4 * streams}
    if execution.activation_checkpoint == "none":
        per["layer activations"] = config.num_layers * layer
    else:
        per["layer inputs"] = config.num_layers * streams
        per["one layer's activations"] = layer
    return per


__all__ = ["HEADROOM", "StepMemory", "step_memory"]
