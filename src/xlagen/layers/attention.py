"""Multi-head attention over the static cache (self-attention) or over an encoder's output
(cross-attention), shared by every model.

Shapes: B batch, T tokens in this call, S cache length (static), L encoder length, H heads, D head dim.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import keras
from keras import ops

from xlagen import cache as cache_lib
from xlagen import native
from xlagen.layers.dense import Dense
from xlagen.layers.norms import rms_norm
from xlagen.layers.rotary import apply_rotary

# Added to the scores of masked keys; finite so that a fully masked row (a left-padding query) stays
# finite instead of turning into NaN.
MASK_VALUE = -1e9


def causal_mask(attention_mask, cache_index, num_tokens: int, slots=None, window: int | None = None):
    """Which keys each new query may attend to.

    Args:
        attention_mask: `[B, S]` 1 for real tokens, 0 for padding, over the whole cache length.
        cache_index: int32 scalar, position of the first query in the cache.
        num_tokens: T, the number of queries in this call.
        slots: Optional int32 `[G, K, S]` for a decoding step (T = 1) over a cache in the beam layout
            (`xlagen.cache.expand_beams`): G prompts of K beams (B = G * K), and which slot holds each
            position of each beam's history, already including this step's own slot at `cache_index`.
        window: Optional sliding window W: a query also sees no key W or more positions before it
            (transformers' `sliding_window_overlay`). Left padding is contiguous, so distances between
            cache columns are distances between positions.

    Returns:
        bool `[B, 1, T, S]`: key j is visible to query t iff j <= cache_index + t and j is not padding.
        With `slots`: bool `[G, 1, K, K * S]`, the K beams of a prompt as K queries over the prompt's
        K slots laid end to end; beam b sees position s of slot k iff its history keeps s in slot k.
    """
    length = ops.shape(attention_mask)[1]
    query_positions = ops.cast(cache_index, "int32") + ops.arange(num_tokens, dtype="int32")
    key_positions = ops.arange(length, dtype="int32")
    causal = key_positions[None, :] <= query_positions[:, None]  # [T, S]
    if window is not None:
        causal = ops.logical_and(causal, key_positions[None, :] > query_positions[:, None] - window)
    if slots is not None:
        beams = slots.shape[1]
        real = ops.reshape(ops.cast(attention_mask, "bool"), (-1, beams, length))
        seen = ops.logical_and(real, causal[0])[:, :, None, :]  # [G, K, 1, S]
        kept = slots[:, :, None, :] == ops.arange(beams, dtype="int32")[None, None, :, None]  # [G, K, K, S]
        return ops.reshape(ops.logical_and(kept, seen), (-1, 1, beams, beams * length))
    real = ops.cast(attention_mask, "bool")[:, None, None, :]  # [B, 1, 1, S]
    return ops.logical_and(causal[None, None, :, :], real)


def padding_mask(attention_mask):
    """Which keys every query may attend to without a causal constraint (encoders, cross-attention).

    Args:
        attention_mask: `[B, L]` 1 for real tokens, 0 for padding.

    Returns:
        bool `[B, 1, 1, L]`.
    """
    return ops.cast(attention_mask, "bool")[:, None, None, :]


class RelativeBias(NamedTuple):
    """The score bias of a self-attention over positions 0..T-1 (an encoder's) that depends only on where a
    key is relative to its query: `table[..., j - i + T - 1]` for query i and key j (T5's encoder). The
    attention kernel reads the table itself, 2 T - 1 values per head, rather than the `[T, T]` matrix each
    head would have (8 MB for T5-small's 512-token prompt).

    Attributes:
        table: `[1 or B, H, 2 T - 1]`: the bias of keys from T - 1 positions before their query to T - 1
            after it.
    """

    table: Any

    def dense(self):
        """The bias as a matrix per head, `[1 or B, H, T, T]`."""
        length = (ops.shape(self.table)[-1] + 1) // 2
        return native.relative_to_dense(self.table, length, length)


def dense_bias(bias):
    """`bias` as the tensor `[1 or B, H, T, S]` (a `RelativeBias` expanded), or None."""
    return bias.dense() if isinstance(bias, RelativeBias) else bias


def split_heads(x, num_heads: int, head_dim: int):
    """`[B, T, H * D]` -> `[B, H, T, D]`."""
    batch, length = ops.shape(x)[0], ops.shape(x)[1]
    return ops.transpose(ops.reshape(x, (batch, length, num_heads, head_dim)), (0, 2, 1, 3))


def merge_heads(x):
    """`[B, H, T, D]` -> `[B, T, H * D]`."""
    batch, heads, length, head_dim = ops.shape(x)
    return ops.reshape(ops.transpose(x, (0, 2, 1, 3)), (batch, length, heads * head_dim))


def attend(query, key, value, mask, scale: float, bias=None, key_transposed: bool = False):
    """Softmax attention weights of `query` over `key`, before dropout.

    Args:
        query: `[B, H, T, D]`.
        key: `[B, H, S, D]`, or `[B, H, D, S]` with `key_transposed` (no transpose per call: XLA's CPU
            dot wants the contracted axis first on the right-hand side, and would copy it every step).
        value: `[B, H, S, D]`, only for the output dtype.
        mask: bool, broadcastable to `[B, H, T, S]`, or None (every key visible).
        scale: Multiplier of the query-key scores.
        bias: Optional additive bias of the scores, broadcastable to `[B, H, T, S]` (T5's relative
            positions), or a `RelativeBias`.

    Returns:
        Weights `[B, H, T, S]` in the dtype of `value` (the softmax runs in float32).
    """
    keys = key if key_transposed else ops.transpose(key, (0, 1, 3, 2))
    scores = ops.cast(ops.matmul(query, keys) * scale, "float32")
    if bias is not None:
        scores = scores + ops.cast(dense_bias(bias), "float32")
    if mask is not None:
        scores = ops.where(mask, scores, MASK_VALUE)
    return ops.cast(ops.softmax(scores, axis=-1), value.dtype)


def group_queries(query, groups: int):
    """`[B, Hkv * g, T, D]` -> `[B, Hkv, g * T, D]`: the g query heads of each key/value head as g * T rows
    of that head (a reshape: query head h belongs to key/value head h // g, as transformers' `repeat_kv`)."""
    batch, heads, length, head_dim = ops.shape(query)
    return ops.reshape(query, (batch, heads // groups, groups * length, head_dim))


def ungroup_queries(attended, groups: int):
    """The inverse of `group_queries`: `[B, Hkv, g * T, D]` -> `[B, Hkv * g, T, D]`."""
    batch, heads, rows, head_dim = ops.shape(attended)
    return ops.reshape(attended, (batch, heads * groups, rows // groups, head_dim))


def _per_query(product, queries, axis: int):
    """`product` of each query `[G, H, 1, ...]` of `queries` `[G, H, K, ...]`, concatenated on `axis`.

    XLA's CPU backend runs a batched product with one query row as a fast matrix-vector loop, but with
    two or more rows as a generic loop that is 10-20x slower (beam search, K = 2, GPT-2-small: about
    200 us instead of 17 us per layer); K products of one row each stay on the fast path.
    """
    if queries.shape[2] == 1:
        return product(queries)
    return ops.concatenate([product(queries[:, :, k:k + 1]) for k in range(queries.shape[2])], axis=axis)


class _MultiHead(keras.layers.Layer):
    """What self- and cross-attention share: sizes, projections and the attention itself.

    Args:
        hidden_size: Model width (of the queries, and of the encoder output for cross-attention).
        num_heads: H, the query heads.
        head_dim: D.
        scale: Multiplier of the query-key scores (e.g. 1/sqrt(D); T5: 1).
        use_bias: Whether the projections have biases.
        dropout: Dropout rate of the attention probabilities (training only).
        num_key_value_heads: Hkv, the key/value heads (grouped-query attention, Ainslie et al. 2023): query
            head h reads key/value head h // (H / Hkv); None: H.
        output_bias: Whether the output projection has a bias (None: `use_bias`).
    """

    # The input projections: (name, how many groups of H * D queries, how many of Hkv * D keys or values),
    # e.g. ("qkv", 1, 2).
    PROJECTIONS: tuple[tuple[str, int, int], ...] = ()

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, scale: float, use_bias: bool = True,
                 dropout: float = 0.0, *, num_key_value_heads: int | None = None, output_bias: bool | None = None,
                 **kwargs):
        super().__init__(**kwargs)
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_key_value_heads = num_heads if num_key_value_heads is None else num_key_value_heads
        if num_heads % self.num_key_value_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_key_value_heads "
                             f"{self.num_key_value_heads}")
        self.scale = scale
        for name, queries, keys in self.PROJECTIONS:
            width = (queries * num_heads + keys * self.num_key_value_heads) * head_dim
            setattr(self, name, Dense(width, use_bias=use_bias, name=name, dtype=self.dtype_policy))
        self.output_projection = Dense(hidden_size, use_bias=use_bias if output_bias is None else output_bias,
                                       name="output_projection", dtype=self.dtype_policy)
        self.dropout = keras.layers.Dropout(dropout)

    @property
    def groups(self) -> int:
        """How many query heads share each key/value head (1 without grouped-query attention)."""
        return self.num_heads // self.num_key_value_heads

    def build(self, input_shape):
        for name, _, _ in self.PROJECTIONS:
            getattr(self, name).build((None, self.hidden_size))
        self.output_projection.build((None, self.num_heads * self.head_dim))
        self.built = True

    def _heads(self, x, parts: int):
        """`[B, T, parts * H * D]` -> `parts` tensors `[B, H, T, D]`."""
        return [split_heads(p, self.num_heads, self.head_dim) for p in ops.split(x, parts, axis=-1)]

    def _attend(self, query, key, value, mask, bias, training, key_transposed=False, in_place=None, residual=None):
        """Attention of `[B, H, T, D]` queries over `[B, Hkv, S, D]` keys -> `[B, T, hidden]`. Long unmasked
        attention under XLA (an encoder's, or a decoder's over it) is the fused native kernel
        (`xlagen.native.attention`), and so is a generation's prompt over the cache
        (`xlagen.native.masked_attention`). `in_place`: the same query, key and value (each, or None) as
        `native.Heads` of the fused projection, which the kernels read where they are; the kernels then also
        write their output as the output projection's input `[B, T, H * D]` (without grouped queries).
        `residual` (`[B, T, hidden]` or None): added to the output (`Dense.call`)."""
        dropout = self.dropout.rate > 0 and training is not None and training is not False
        groups = self.groups
        if groups > 1:  # each key/value head's queries as one group of rows: the keys are never repeated
            query = group_queries(query, groups)
        if in_place is not None and groups > 1:
            raise ValueError("_attend: grouped queries are never read in place")
        # The kernels write the output projection's input, except over keys given transposed (as they come).
        merged = groups == 1 and not key_transposed
        placed = (query, key, value) if in_place is None else [
            given if heads is None else heads for given, heads in zip((query, key, value), in_place)]
        relative = isinstance(bias, RelativeBias)
        given = bias.table if relative else bias
        if not key_transposed and native.use_prompt_attention(query, key, mask, given, dropout, relative=relative):
            # A prompt over the cache, or an encoder; its mask [B, 1, T or 1, S] is shared by the g groups of
            # rows, never tiled.
            attended = native.masked_attention(*placed, mask, self.scale, MASK_VALUE, given, merged=merged,
                                               relative=relative)
        else:
            bias = dense_bias(bias)
            if groups > 1 and mask is not None and mask.shape[2] != 1:  # [B, 1, T, S] -> [B, 1, g * T, S]
                mask = ops.tile(mask, (1, 1, groups, 1))
            if native.use_attention_kernel(query, key, mask, bias, dropout, key_transposed=key_transposed):
                attended = native.attention(*placed, self.scale, key_transposed, merged=merged)
            else:
                merged = False
                weights = self.dropout(attend(query, key, value, mask, self.scale, bias, key_transposed),
                                       training=training)
                attended = ops.matmul(weights, value)
        if merged:
            return self.output_projection(attended, residual=residual)
        if groups > 1:
            attended = ungroup_queries(attended, groups)
        return self.output_projection(merge_heads(attended), residual=residual)


class Attention(_MultiHead):
    """Self-attention with a fused query/key/value projection (arguments: see `_MultiHead`), and optionally
    rotary positions (`call`'s `rotary`) and per-head query/key norms.

    Args:
        head_norm_eps: With it, an RMS norm (this epsilon) of each query and key head before the rotation.
    """

    PROJECTIONS = (("qkv", 1, 2),)

    def __init__(self, *args, head_norm_eps: float | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        # Qwen3: an RMS norm of each query and key head (over D) before the rotation.
        self.query_norm = self.key_norm = None
        if head_norm_eps is not None:
            self.query_norm = rms_norm(head_norm_eps, "query_norm", self.dtype_policy)
            self.key_norm = rms_norm(head_norm_eps, "key_norm", self.dtype_policy)

    def build(self, input_shape):
        super().build(input_shape)
        for norm in (self.query_norm, self.key_norm):
            if norm is not None:
                norm.build((None, self.head_dim))

    def call(self, x, key_mask, layer_cache=None, cache_index=None, training=False, bias=None, rotary=None,
             last_only=False, residual=None):
        """Attends from `x` over the cache (or over `x` itself when there is no cache).

        Args:
            x: `[B, T, hidden]`.
            key_mask: bool `[B, 1, T, S]` (S = T without a cache), see `causal_mask` (a decoding step over
                the beam layout: `[G, 1, K, K * S]`); or None, every key visible. (Not named `mask`: Keras
                fills an argument of that name left None from the input's Keras mask.)
            layer_cache: Optional `LayerCache` `[B, H, S, D]` (or `[G, H, K, S, D]`, the beam layout of
                `xlagen.cache`, for decoding steps); the new keys/values are written into it.
            cache_index: int32 scalar write offset, required with a cache.
            training: Applies dropout to the attention probabilities.
            bias: Optional additive score bias `[1 or B, H, T, S]`, or a `RelativeBias`.
            rotary: Optional `(cos, sin)` `[B, T, D]` of the tokens' positions (`rotary.rotary_tables`): the
                queries and keys are rotated before the keys are cached.
            last_only: Attend from the last token only (the output is `[B, 1, hidden]`), over every token's
                key and value, all of which are cached: a prompt's last block, whose other rows nothing reads.
                Not with a `bias`.
            residual: Optional `[B, T, hidden]` (`[B, 1, hidden]` with `last_only`) added to the output: the
                block's residual connection, which the output projection may add as it stores its output
                (`Dense.call`).

        Returns:
            `(output [B, T, hidden], layer_cache or None)`.

        Raises:
            ValueError: `last_only` with a `bias`.
        """
        if last_only and bias is not None:
            raise ValueError("Attention: last_only attends without a score bias")
        projection = self.qkv(x)
        query, key, value = self._project(projection)
        # The heads as the projection left them, for the attention kernels to read in place (unless rotated,
        # normed or grouped first); where a kernel reads them so, XLA drops the transposes into heads it then
        # does not use (a prompt's keys and values are still transposed, into the cache).
        in_place = None
        if rotary is not None:
            query, key = apply_rotary(query, *rotary), apply_rotary(key, *rotary)
        elif self.query_norm is None and self.groups == 1:
            width = self.num_heads * self.head_dim
            in_place = [native.Heads(projection, i * width, self.num_heads, self.head_dim) for i in range(3)]
        cached_heads = None if in_place is None else in_place[1:]  # the keys and values, for a fresh cache
        if last_only and query.shape[2] != 1:  # the last query row (and its row of the mask), every key
            query, in_place = query[:, :, -1:], None
            key_mask = None if key_mask is None else key_mask[:, :, -1:]
        if layer_cache is None:
            return self._attend(query, key, value, key_mask, bias, training, in_place=in_place,
                                residual=residual), None
        if key.shape[2] == 1:  # a decoding step: one new token
            return self._step(query, key, value, key_mask, layer_cache, cache_index, dense_bias(bias), training,
                              residual)
        if (isinstance(layer_cache, cache_lib.FreshCache) and cached_heads is not None
                and all(native.use_fresh_cache(heads, layer_cache.key) for heads in cached_heads)):
            # The prompt's keys and values at cache_index of a cache of zeros: written by the pool from the
            # projection, with the zeros around them, rather than transposed and padded by XLA on one thread.
            length = layer_cache.key.shape[2]
            layer_cache = cache_lib.LayerCache(*(
                native.split_heads(projection, heads.heads, heads.head_dim, heads.column, False, length, cache_index)
                for heads in cached_heads))
        else:
            layer_cache = cache_lib.update_layer(layer_cache, key, value, cache_index)
        return self._attend(query, layer_cache.key, layer_cache.value, key_mask, bias, training,
                            in_place=in_place and [in_place[0], None, None], residual=residual), layer_cache

    def _project(self, projection):
        """The fused projection `[B, T, (H + 2 * Hkv) * D]` -> query `[B, H, T, D]`, key and value `[B, Hkv,
        T, D]` (heads normed if so)."""
        queries = self.num_heads * self.head_dim
        query, key, value = ops.split(projection, [queries, queries + self.num_key_value_heads * self.head_dim],
                                      axis=-1)
        query = split_heads(query, self.num_heads, self.head_dim)
        key, value = (split_heads(t, self.num_key_value_heads, self.head_dim) for t in (key, value))
        if self.query_norm is not None:
            query, key = self.query_norm(query), self.key_norm(key)
        return query, key, value

    def _step(self, query, key, value, mask, layer_cache, cache_index, bias, training, residual=None):
        """A decoding step (T = 1): attends over the cache as it was before this step plus the new
        key/value, and only then writes them into the cache.

        Why not write first and attend over the updated cache (as the prompt does): XLA's CPU backend
        then fuses a copy of the dynamic-update-slice into each attention dot's operand and copies the
        loop's cache buffers (twice) so the in-place update cannot clobber what the dot reads: several
        cache-sized reads and writes per layer and step, growing with the cache length (GPT-2-small at
        512 new tokens: 24.1 -> 17.9 ms/token). Here both dots read the loop's
        buffers directly, the keys are the left operand (`K @ q`, so the key cache is never
        transposed), and the write is made to depend on the attention output so that XLA orders it
        after the reads and updates the buffers in place without any copy.

        A cache in the beam layout (`[G, H, K, S, D]`, see `xlagen.cache`) is read as one sequence of
        K * S keys per prompt, with the prompt's K beams as K queries and `mask` (from `causal_mask`
        with slots) choosing each beam's own history; the cache rows never move.

        With grouped-query attention the cache holds the Hkv key/value heads; the g = H / Hkv queries that
        share one are g query rows of that head (`group_queries`), for XLA's dots and for the native step
        attention alike, so the cache is read in place and never repeated (only the step's own new key and
        value, one row each, are repeated for the g rows).

        The cache may hold more rows than the step has queries (a slot decoder's step over its first W
        slots): the first rows are the step's, and the others are left as they are.
        """
        _, heads, _, head_dim = query.shape
        beams = layer_cache.key.shape[2] if len(layer_cache.key.shape) == 5 else 1
        length = layer_cache.key.shape[-2]
        if beams > 1:  # [G * K, H, 1, D] -> [G, H, K, D]; the cache [G, H, K, S, D] -> [G, H, K * S, D]
            query, key, value = (ops.transpose(ops.reshape(t, (-1, beams, t.shape[1], head_dim)), (0, 2, 1, 3))
                                 for t in (query, key, value))
            keys, values = (ops.reshape(t, (-1, t.shape[1], beams * length, head_dim)) for t in layer_cache)
        else:
            keys, values = layer_cache
        index = ops.cast(cache_index, "int32")
        positions = ops.arange(length, dtype="int32")  # [S]
        slot_positions = ops.tile(positions, (beams,)) if beams > 1 else positions  # [K * S]
        at_index = slot_positions == index
        visible_new = ops.any(ops.logical_and(mask, at_index), axis=-1, keepdims=True)
        visible = ops.concatenate([ops.logical_and(mask, slot_positions < index), visible_new], axis=-1)
        if bias is not None:  # [1, H, 1, S] (T5's relative positions do not depend on the row)
            bias = ops.cast(bias, "float32")
            bias_new = ops.sum(ops.where(positions == index, bias, 0.0), axis=-1, keepdims=True)
            bias_old = ops.tile(bias, (1, 1, 1, beams)) if beams > 1 else bias
            bias = ops.concatenate([bias_old, bias_new], axis=-1)  # [1, H, 1, K * S + 1]
        dropout = self.dropout.rate > 0 and training is not None and training is not False
        # The policy's question is about G x K query rows (batch x beams), whatever the grouping.
        native_step = not dropout and native.use_step_attention(query, keys)
        if keys.shape[0] != query.shape[0] and not native_step:
            # A cache with more rows than this step's queries (`SlotDecoder`'s narrow steps): the first rows
            # are the step's. The native call reads them in place; XLA's dots need them taken out.
            keys, values = keys[:query.shape[0]], values[:query.shape[0]]
        groups = self.groups
        new_key, new_value = key, value
        if groups > 1:  # [G, H, K, D] -> [G, Hkv, g * K, D]; the new key/value repeated for the g rows
            if bias is not None:
                raise ValueError("a score bias per head cannot be combined with grouped-query attention")
            query = group_queries(query, groups)
            new_key, new_value = (ops.tile(t, (1, 1, groups, 1)) for t in (key, value))
            visible = ops.tile(visible, (1, 1, groups, 1))
        if native_step:
            # One native call: the cache read in place, the new key last, -inf where a query may not see.
            masked = ops.where(visible, 0.0 if bias is None else bias, float("-inf"))
            attended = native.step_attention(query, keys, values, new_key, new_value, masked, self.scale,
                                             MASK_VALUE)
        else:
            old = _per_query(lambda q: ops.matmul(keys, ops.transpose(q, (0, 1, 3, 2))), query, -1)  # [G, H, K * S, K]
            old = ops.transpose(old, (0, 1, 3, 2))  # [G, H, K, K * S]
            new = ops.sum(query * new_key, axis=-1, keepdims=True)  # [G, H, K, 1]
            scores = ops.cast(ops.concatenate([old, new], axis=-1) * self.scale, "float32")
            if bias is not None:
                scores = scores + bias
            scores = ops.where(visible, scores, MASK_VALUE)
            weights = ops.cast(ops.softmax(scores, axis=-1), value.dtype)
            weights = self.dropout(weights, training=training)
            attended = _per_query(lambda w: ops.matmul(w, values), weights[..., :beams * length], 2)
            attended = attended + weights[..., beams * length:] * new_value
        if groups > 1:
            attended = ungroup_queries(attended, groups)
        # Exactly 0, but computed from `attended`: a data dependency that orders the cache write after
        # the dots (or the native call) read the cache. (XLA keeps `0.0 * x` for floats; the 0/1 flag keeps
        # it NaN-free.)
        order = 0.0 * ops.cast(ops.isnan(ops.sum(attended)), "float32")
        key, value = key + ops.cast(order, key.dtype), value + ops.cast(order, value.dtype)
        if beams > 1:  # [G, H, K, D] -> [G, H, K, 1, D]
            key, value = key[:, :, :, None], value[:, :, :, None]
        layer_cache = cache_lib.update_layer(layer_cache, key, value, cache_index)
        attended = ops.reshape(ops.transpose(attended, (0, 2, 1, 3)), (-1, 1, heads * head_dim))
        return self.output_projection(attended, residual=residual), layer_cache


class FoldedMemory(NamedTuple):
    """A cross-attention's memory as the encoder output itself, for `native.memory_attention` (see
    `CrossAttention.folded_key_kernel`).

    Attributes:
        states: The encoder output `[G, L, hidden]`, the same tensor for every layer.
        key_kernel_t: This layer's key projection kernel transposed, `[H * D, hidden]` (made once per
            generation rather than at every decoding step).
    """

    states: object
    key_kernel_t: object


class CrossAttention(_MultiHead):
    """Attention from the decoder over an encoder's output, whose keys/values are projected once
    (arguments: see `_MultiHead`)."""

    PROJECTIONS = (("query", 1, 0), ("key_value", 0, 2))

    def project_memory(self, encoder_output) -> cache_lib.LayerCache:
        """The keys `[B, H, D, L]` (transposed once here rather than at every decoding step) and values
        `[B, H, L, D]` of the encoder output `[B, L, hidden]`."""
        projected = self.key_value(encoder_output)
        if native.use_split_heads(projected):  # a generation's: laid out once, where XLA copied it twice more
            width = self.num_heads * self.head_dim
            return cache_lib.LayerCache(native.split_heads(projected, self.num_heads, self.head_dim, 0, True),
                                        native.split_heads(projected, self.num_heads, self.head_dim, width, False))
        key, value = self._heads(projected, 2)
        return cache_lib.LayerCache(ops.transpose(key, (0, 1, 3, 2)), value)

    def can_fold(self, states, mask) -> bool:
        """Whether this layer's attention over the encoder output `states` `[G, L, hidden]` being traced now
        may read `states` itself (a `FoldedMemory`): float32 weights not packed to a lower precision, and
        `native.use_memory_attention`."""
        projection = self.key_value
        return (projection.packed_kernel is None and projection.kernel.dtype == "float32"
                and native.use_memory_attention(states, mask, self.head_dim))

    def folded_key_kernel(self):
        """The key projection's kernel transposed, `[H * D, hidden]`: with the encoder output, this layer's
        `FoldedMemory`. Attending over it folds the key and value projections into the query and the output
        (`native.memory_attention`), so each layer reads the encoder output once per step instead of its own
        keys and values (twice the bytes), and nothing is projected before the loop. Check `can_fold` first."""
        return ops.transpose(self.key_value.kernel[:, :self.num_heads * self.head_dim])

    def call(self, x, memory: cache_lib.LayerCache | FoldedMemory, key_mask, training=False):
        """Attends from `x` `[B, T, hidden]` over `memory` (`project_memory`'s, or a `FoldedMemory`) with `key_mask`
        `[G, 1, 1, L]`, or None when every position of the memory is real (Whisper's 30 s windows). (Not
        named `mask`: Keras fills an argument of that name left None from the input's Keras mask.)

        `memory` has G = B rows, or one row per K consecutive rows of `x` (G = B / K: beam search's K
        beams of each prompt share their prompt's memory, see `CausalDecoding.expand_beams`). Each
        memory row is attended by its rows of `x` as one group of K * T queries, so it is read once per
        step rather than once per beam.

        Returns:
            `[B, T, hidden]`.
        """
        rows, length = ops.shape(x)[0], ops.shape(x)[1]
        if isinstance(memory, FoldedMemory):
            grouped = ops.reshape(x, (ops.shape(memory.states)[0], -1, self.hidden_size))  # [G, K * T, hidden]
            kernel = ops.convert_to_tensor(self.key_value.kernel)
            bias = self.key_value.bias
            bias = ops.zeros((kernel.shape[1],), kernel.dtype) if bias is None else ops.convert_to_tensor(bias)
            query = self.query(grouped)
            native_call = query.shape.is_fully_defined() and native.use_memory_attention(memory.states, None,
                                                                                        self.head_dim)
            attend_folded = native.memory_attention if native_call else native.reference_memory_attention
            attended = attend_folded(query, memory.states, memory.key_kernel_t, kernel, bias, self.num_heads,
                                     self.scale)
            return ops.reshape(self.output_projection(attended), (rows, length, self.hidden_size))
        grouped = ops.reshape(x, (ops.shape(memory.value)[0], -1, self.hidden_size))  # [G, K * T, hidden]
        (query,) = self._heads(self.query(grouped), 1)
        attended = self._attend(query, memory.key, memory.value, key_mask, None, training, key_transposed=True)
        return ops.reshape(attended, (rows, length, self.hidden_size))
