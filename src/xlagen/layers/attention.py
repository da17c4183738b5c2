"""Multi-head attention over the static cache, shared by every model.

Shapes: B batch, T tokens in this call, S cache length (static), H heads, D head dim.
"""

from __future__ import annotations

import keras
from keras import ops

from xlagen import cache as cache_lib

# Added to the scores of masked keys; finite so that a fully masked row (a left-padding query) stays
# finite instead of turning into NaN.
MASK_VALUE = -1e9


def causal_mask(attention_mask, cache_index, num_tokens: int):
    """Which keys each new query may attend to.

    Args:
        attention_mask: `[B, S]` 1 for real tokens, 0 for padding, over the whole cache length.
        cache_index: int32 scalar, position of the first query in the cache.
        num_tokens: T, the number of queries in this call.

    Returns:
        bool `[B, 1, T, S]`: key j is visible to query t iff j <= cache_index + t and j is not padding.
    """
    length = ops.shape(attention_mask)[1]
    query_positions = ops.cast(cache_index, "int32") + ops.arange(num_tokens, dtype="int32")
    key_positions = ops.arange(length, dtype="int32")
    causal = key_positions[None, :] <= query_positions[:, None]  # [T, S]
    real = ops.cast(attention_mask, "bool")[:, None, None, :]  # [B, 1, 1, S]
    return ops.logical_and(causal[None, None, :, :], real)


class Attention(keras.layers.Layer):
    """Self-attention with a fused query/key/value projection.

    Args:
        hidden_size: Model width.
        num_heads: H.
        head_dim: D.
        scale: Multiplier of the query-key scores (e.g. 1/sqrt(D)).
        use_bias: Whether the projections have biases.
        dropout: Dropout rate of the attention probabilities (training only).
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, scale: float, use_bias: bool = True,
                 dropout: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        inner = num_heads * head_dim
        self.qkv = keras.layers.Dense(3 * inner, use_bias=use_bias, name="qkv", dtype=self.dtype_policy)
        self.output_projection = keras.layers.Dense(hidden_size, use_bias=use_bias, name="output_projection",
                                                    dtype=self.dtype_policy)
        self.dropout = keras.layers.Dropout(dropout)

    def build(self, input_shape):
        self.qkv.build((None, self.hidden_size))
        self.output_projection.build((None, self.num_heads * self.head_dim))
        self.built = True

    def _split_heads(self, x):
        batch, length = ops.shape(x)[0], ops.shape(x)[1]
        x = ops.reshape(x, (batch, length, self.num_heads, self.head_dim))
        return ops.transpose(x, (0, 2, 1, 3))  # [B, H, T, D]

    def call(self, x, mask, layer_cache=None, cache_index=None, training=False):
        """Attends from `x` over the cache (or over `x` itself when there is no cache).

        Args:
            x: `[B, T, hidden]`.
            mask: bool `[B, 1, T, S]` (S = T without a cache), see `causal_mask`.
            layer_cache: Optional `LayerCache` `[B, H, S, D]`; the new keys/values are written into it.
            cache_index: int32 scalar write offset, required with a cache.
            training: Applies dropout to the attention probabilities.

        Returns:
            `(output [B, T, hidden], layer_cache or None)`.
        """
        query, key, value = ops.split(self.qkv(x), 3, axis=-1)
        query, key, value = self._split_heads(query), self._split_heads(key), self._split_heads(value)
        if layer_cache is not None:
            layer_cache = cache_lib.update_layer(layer_cache, key, value, cache_index)
            key, value = layer_cache.key, layer_cache.value
        scores = ops.matmul(query, ops.transpose(key, (0, 1, 3, 2))) * self.scale  # [B, H, T, S]
        scores = ops.where(mask, ops.cast(scores, "float32"), MASK_VALUE)
        weights = self.dropout(ops.cast(ops.softmax(scores, axis=-1), value.dtype), training=training)
        context = ops.transpose(ops.matmul(weights, value), (0, 2, 1, 3))  # [B, T, H, D]
        batch, length = ops.shape(context)[0], ops.shape(context)[1]
        context = ops.reshape(context, (batch, length, self.num_heads * self.head_dim))
        return self.output_projection(context), layer_cache
