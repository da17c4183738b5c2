"""The one static key/value cache layout used by every model.

A cache is a tuple of per-layer `LayerCache(key, value)` pairs, each `[B, H, S, D]` with a static cache
length `S` chosen before generation starts. Writes go through `update_layer` (a dynamic-update-slice at
`cache_index`); nothing is ever concatenated, so the shapes never change inside the decoding loop and
XLA can update the buffers in place. The batch axis is always 0, which lets any cache be reordered or
repeated with one generic gather over `tf.nest`.

Beam search uses a second layout, the beam layout (`expand_beams`): `[B, H, K, S, D]` for B prompts of
K beams, one slot per beam. Each step writes every beam's new key/value into its own slot at the step's
position; a position of a slot is written once and never moved. Which slot holds position s of beam b's
history is kept in a small table, the slots `[B, K, S]` (see `xlagen.models.base.DecoderState`): when a
beam continues another beam, beam search copies that row of the table instead of the cache rows of
every layer, and the attention reads a beam's history through the table (`attention.causal_mask`).
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


class FreshCache(LayerCache):
    """A layer's cache that holds only zeros: nothing has been written into it yet (a generation's prompt
    pass starts from one, `fresh`). Its first write may then build the cache from the new keys and values
    and zeros around them, without reading it (`xlagen.layers.attention.Attention`); any write returns a
    plain `LayerCache`."""


def fresh(cache):
    """`cache` (a tuple of `LayerCache` of zeros, as `init_cache` makes) with each layer marked a
    `FreshCache`; anything else in the tuple is kept as it is."""
    return tuple(FreshCache(*layer) if isinstance(layer, LayerCache) else layer for layer in cache)


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
        layer: The layer's cache, `[B, H, S, D]` each (or the beam layout `[B, H, K, S, D]`).
        key: New keys `[B, H, T, D]` (beam layout: `[B, H, K, T, D]`).
        value: New values, shaped as `key`.
        cache_index: int32 scalar tensor, the position of the first new token.

    Returns:
        The updated `LayerCache` (same shapes).
    """
    zero = ops.zeros((), "int32")
    start = [zero] * len(layer.key.shape)
    start[-2] = ops.cast(cache_index, "int32")
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


def expand_beams(cache, num_beams: int):
    """Turns a prompt's cache `[B, H, S, D]` per layer into the beam layout `[B, H, K, S, D]`: every
    beam's slot starts with a copy of the prompt."""
    def expand(tensor):
        _, heads, length, head_dim = tensor.shape
        return ops.broadcast_to(tensor[:, :, None], (ops.shape(tensor)[0], heads, num_beams, length, head_dim))

    return keras.tree.map_structure(expand, cache)
