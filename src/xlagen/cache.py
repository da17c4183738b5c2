"""The one static key/value cache layout used by every model.

A cache is a tuple of per-layer `LayerCache(key, value)` pairs, each `[B, H, S, D]` with a static cache
length `S` chosen before generation starts. Writes go through `update_layer` (a dynamic-update-slice at
`cache_index`); nothing is ever concatenated, so the shapes never change inside the decoding loop and
XLA can update the buffers in place. The batch axis is always 0, which lets beam search reorder or
expand any cache with one generic gather over `tf.nest`.
"""

from __future__ import annotations

from typing import NamedTuple

import keras
from keras import ops


class LayerCache(NamedTuple):
    """Keys and values of one attention layer.

    Attributes:
        key: `[B, H, S, D]`.
        value: `[B, H, S, D]`.
    """

    key: object
    value: object


def init_cache(num_layers: int, batch_size: int, num_heads: int, max_length: int, head_dim: int,
               dtype: str = "float32") -> tuple[LayerCache, ...]:
    """Returns a zero cache of static shape.

    Args:
        num_layers: L, the number of attention layers with a cache.
        batch_size: B.
        num_heads: H.
        max_length: S, the static cache length (prompt + new tokens).
        head_dim: D.
        dtype: The cache dtype (the model's compute dtype).

    Returns:
        A tuple of L `LayerCache` of zeros `[B, H, S, D]`.
    """
    shape = (batch_size, num_heads, max_length, head_dim)
    return tuple(LayerCache(ops.zeros(shape, dtype), ops.zeros(shape, dtype)) for _ in range(num_layers))


def update_layer(layer: LayerCache, key, value, cache_index) -> LayerCache:
    """Writes `key`/`value` `[B, H, T, D]` at position `cache_index` of the static cache.

    Args:
        layer: The layer's cache, `[B, H, S, D]` each.
        key: New keys `[B, H, T, D]`.
        value: New values `[B, H, T, D]`.
        cache_index: int32 scalar tensor, the position of the first new token.

    Returns:
        The updated `LayerCache` (same shapes).
    """
    zero = ops.zeros((), "int32")
    start = [zero, zero, ops.cast(cache_index, "int32"), zero]
    return LayerCache(ops.slice_update(layer.key, start, ops.cast(key, layer.key.dtype)),
                      ops.slice_update(layer.value, start, ops.cast(value, layer.value.dtype)))


def batch_gather(cache, indices):
    """Reorders (or repeats) the batch axis of every tensor in a cache: `tensor[indices]`.

    Args:
        cache: Any nest of tensors whose axis 0 is the batch.
        indices: int32 `[B']` rows to take.

    Returns:
        The same nest with batch size B'.
    """
    return keras.tree.map_structure(lambda t: ops.take(t, indices, axis=0), cache)
