"""The self-attention + feed-forward block of decoder-only transformers (GPT-2, OPT).

Shapes: B batch, T tokens in this call, S cache length (static).
"""

from __future__ import annotations

from dataclasses import dataclass

import keras

from xlagen.layers.attention import Attention
from xlagen.layers.feedforward import FeedForward
from xlagen.layers.norms import layer_norm


@dataclass(frozen=True)
class BlockSpec:
    """Everything that shapes one block; a model derives it from its config.

    Attributes:
        hidden_size: Model width.
        num_heads: H.
        head_dim: D.
        intermediate_size: Feed-forward inner width.
        activation: HF activation name of the feed-forward.
        attention_scale: Multiplier of the query-key scores.
        layer_norm_eps: LayerNorm epsilon.
        norm_first: Pre-norm `x + f(norm(x))` (GPT-2, OPT) or post-norm `norm(x + f(x))` (OPT-350m).
        use_bias: Biases in the attention and feed-forward projections.
        norm_affine: LayerNorms with a learned scale and bias.
        attention_dropout: Dropout of the attention probabilities (training only).
        residual_dropout: Dropout of each sub-layer's output before the residual sum (training only).
    """

    hidden_size: int
    num_heads: int
    head_dim: int
    intermediate_size: int
    activation: str
    attention_scale: float
    layer_norm_eps: float
    norm_first: bool = True
    use_bias: bool = True
    norm_affine: bool = True
    attention_dropout: float = 0.0
    residual_dropout: float = 0.0


class DecoderBlock(keras.layers.Layer):
    """Causal self-attention then a feed-forward, each with a residual connection and a LayerNorm.

    Args:
        spec: The block's shape and options.
    """

    def __init__(self, spec: BlockSpec, **kwargs):
        super().__init__(**kwargs)
        self.spec = spec
        self.attention_norm = layer_norm(spec.layer_norm_eps, "attention_norm", self.dtype_policy, spec.norm_affine)
        self.attention = Attention(spec.hidden_size, spec.num_heads, spec.head_dim, spec.attention_scale,
                                   use_bias=spec.use_bias, dropout=spec.attention_dropout, name="attention",
                                   dtype=self.dtype_policy)
        self.mlp_norm = layer_norm(spec.layer_norm_eps, "mlp_norm", self.dtype_policy, spec.norm_affine)
        self.mlp = FeedForward(spec.hidden_size, spec.intermediate_size, spec.activation, use_bias=spec.use_bias,
                               name="mlp", dtype=self.dtype_policy)
        self.residual_dropout = keras.layers.Dropout(spec.residual_dropout)

    def build(self, input_shape):
        for layer in (self.attention_norm, self.attention, self.mlp_norm, self.mlp):
            layer.build((None, None, self.spec.hidden_size))
        self.built = True

    def call(self, x, mask, layer_cache=None, cache_index=None, training=False):
        """Runs the block.

        Args:
            x: `[B, T, hidden]`.
            mask: bool `[B, 1, T, S]`, see `attention.causal_mask`.
            layer_cache: Optional `LayerCache` `[B, H, S, D]`.
            cache_index: int32 scalar write offset, required with a cache.
            training: Applies dropout.

        Returns:
            `(output [B, T, hidden], layer_cache or None)`.
        """
        def attend(h):
            attended, cache = self.attention(h, mask, layer_cache, cache_index, training=training)
            return self.residual_dropout(attended, training=training), cache

        def feed_forward(h):
            return self.residual_dropout(self.mlp(h), training=training)

        if self.spec.norm_first:
            attended, layer_cache = attend(self.attention_norm(x))
            x = x + attended
            return x + feed_forward(self.mlp_norm(x)), layer_cache
        attended, layer_cache = attend(x)
        x = self.attention_norm(x + attended)
        return self.mlp_norm(x + feed_forward(x)), layer_cache
