"""Configuration of beta_1.2 (Beta12Transformer) for Hugging Face transformers.

Written by `megabeta export --format hf` beside `modeling_beta12.py`; it depends on transformers
only. The function the fields select is defined in megabeta's spec (shared/spec/beta12.md,
"spec §N" below): a decoder-only RoPE/SwiGLU Transformer in which, at layer l, the keys and values
of tokens in earlier blocks of `block_size` tokens are the finished outputs of layers
l .. l + depth_window. `arch` "standard" is the plain causal Transformer of the same shape (one
block of the whole sequence, spec §4.1), "looped" that stack applied `loops` times.
"""

from transformers import PretrainedConfig

ARCHS = ("beta12", "standard", "looped")


class Beta12Config(PretrainedConfig):
    """The fields of megabeta's ModelConfig under the Hugging Face names where it has them
    (hidden_size = d_model, intermediate_size = hidden_dim, num_attention_heads = num_heads,
    num_key_value_heads = num_kv_heads, num_hidden_layers = num_layers,
    max_position_embeddings = max_seq_len, rms_norm_eps = norm_eps,
    tie_word_embeddings = tie_embedding, initializer_range = init_std)."""

    model_type = "beta12"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, arch="beta12", vocab_size=32000, hidden_size=256, intermediate_size=1024,
                 num_attention_heads=4, num_key_value_heads=None, num_hidden_layers=4,
                 dropout=0.0, max_position_embeddings=2048, depth_window=2, depth_stride=1,
                 block_size=32, lambda_max=2.0, depth_bias=True, layer_enc=True, self_slot=True,
                 qk_norm=False, deep_token_window=0, tie_word_embeddings=True,
                 rope_theta=10000.0, rms_norm_eps=1e-6, loops=2, initializer_range=0.02,
                 init_embed_scale=1.0, init_branch_scale=1.0, use_cache=True, **kwargs):
        if arch not in ARCHS:
            raise ValueError(f"beta12 config: arch = {arch!r} is not one of {', '.join(ARCHS)}")
        if num_key_value_heads is None:
            num_key_value_heads = num_attention_heads
        if hidden_size % num_attention_heads or (hidden_size // num_attention_heads) % 2:
            raise ValueError(f"beta12 config: hidden_size = {hidden_size} must be an even "
                             f"multiple of num_attention_heads = {num_attention_heads} (RoPE)")
        if num_attention_heads % num_key_value_heads:
            raise ValueError(f"beta12 config: num_key_value_heads = {num_key_value_heads} must "
                             f"divide num_attention_heads = {num_attention_heads}")
        for name, value, low in (("block_size", block_size, 1), ("depth_window", depth_window, 0),
                                 ("depth_stride", depth_stride, 1), ("loops", loops, 1),
                                 ("deep_token_window", deep_token_window, 0)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"beta12 config: {name} = {value!r} must be an integer >= {low}")
        self.arch = arch
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.num_hidden_layers = num_hidden_layers
        self.dropout = dropout
        self.max_position_embeddings = max_position_embeddings
        self.depth_window = depth_window
        self.depth_stride = depth_stride
        self.block_size = block_size
        self.lambda_max = lambda_max
        self.depth_bias = depth_bias
        self.layer_enc = layer_enc
        self.self_slot = self_slot
        self.qk_norm = qk_norm
        self.deep_token_window = deep_token_window
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.loops = loops
        self.initializer_range = initializer_range
        self.init_embed_scale = init_embed_scale
        self.init_branch_scale = init_branch_scale
        self.tie_word_embeddings = tie_word_embeddings
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
