"""Logits processors and token-selection strategies as pure functions.

Every function here works unchanged eagerly and under XLA: fixed shapes, no Python branching on tensor
values. Shapes: B rows (batch x beams), V vocab, T_max the static token buffer.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import tensorflow as tf

from xlagen import native

NEG_INF = float("-inf")


class Runtime(NamedTuple):
    """Options that are numbers, as tensors: changing them never retraces or recompiles.

    Attributes:
        max_new_tokens: int32 scalar, tokens to generate (<= the static buffer's N).
        min_new_tokens: int32 scalar, EOS is banned until this many tokens were generated.
        eos_ids: int32 `[E]`.
        pad_id: int32 scalar, written after EOS.
        seed: int32 `[2]`.
        temperature, top_p, repetition_penalty, length_penalty: float32 scalars.
        top_k: int32 scalar (0 = off; at most the plan's top-k capacity).
        prompt_start: int32 scalar, the first buffer column of the caller's prompt (columns before
            it are bucket padding that processors must not see).
    """

    max_new_tokens: tf.Tensor
    min_new_tokens: tf.Tensor
    eos_ids: tf.Tensor
    pad_id: tf.Tensor
    seed: tf.Tensor
    temperature: tf.Tensor
    top_k: tf.Tensor
    top_p: tf.Tensor
    repetition_penalty: tf.Tensor
    length_penalty: tf.Tensor
    prompt_start: tf.Tensor


class Context(NamedTuple):
    """What processors may look at besides the logits.

    Attributes:
        tokens: int32 `[B, T_max]`, the token buffer (prompt, generated tokens, then filler).
        length: int32 scalar, how many leading positions of `tokens` are valid.
        prompt_length: int, the (padded) prompt's static length in the buffer.
        runtime: The `Runtime` tensors.
    """

    tokens: tf.Tensor
    length: tf.Tensor
    prompt_length: int
    runtime: Runtime


Processor = Callable[[tf.Tensor, Context], tf.Tensor]


def _valid_positions(ctx: Context) -> tf.Tensor:
    columns = tf.range(tf.shape(ctx.tokens)[1])
    return (columns >= ctx.runtime.prompt_start) & (columns < ctx.length)  # [T_max]


def _ban(logits: tf.Tensor, banned: tf.Tensor) -> tf.Tensor:
    return tf.where(banned, tf.constant(NEG_INF, logits.dtype), logits)


def _scatter_flags(ids: tf.Tensor, flags: tf.Tensor, vocab_size: int) -> tf.Tensor:
    """bool `[B, V]`: True at `ids[b, n]` wherever `flags[b, n]` (ids and flags `[B, N]`)."""
    rows, count = tf.shape(ids)[0], tf.shape(ids)[1]
    row_ids = tf.broadcast_to(tf.range(rows)[:, None], [rows, count])
    indices = tf.stack([row_ids, tf.clip_by_value(ids, 0, vocab_size - 1)], axis=-1)
    return tf.tensor_scatter_nd_max(tf.zeros([rows, vocab_size], tf.int32), indices, tf.cast(flags, tf.int32)) > 0


def presence(ctx: Context, vocab_size: int) -> tf.Tensor:
    """bool `[B, V]`: which ids occur among the valid tokens of each row."""
    flags = tf.broadcast_to(_valid_positions(ctx)[None, :], tf.shape(ctx.tokens))
    return _scatter_flags(ctx.tokens, flags, vocab_size)


def repetition_penalty(logits, ctx):
    """CTRL's penalty: present tokens' scores are divided (positive) or multiplied (negative) by it."""
    penalty = ctx.runtime.repetition_penalty
    penalized = tf.where(logits < 0, logits * penalty, logits / penalty)
    return tf.where(presence(ctx, logits.shape[-1]), penalized, logits)


def no_repeat_ngram(size: int) -> Processor:
    """Bans every token that would complete an n-gram already present in the row."""

    def apply(logits, ctx):
        tokens, length = ctx.tokens, ctx.length
        starts = tokens.shape[1] - size + 1  # candidate n-gram starts i: tokens[i : i + size]
        if starts <= 0:
            return logits
        # Windows inside the valid tokens, compared with the (size-1)-gram that ends the sequence.
        window = tf.range(starts)
        match = (window + size - 1 < length) & (window >= ctx.runtime.prompt_start)
        match = tf.broadcast_to(match[None, :], [tf.shape(tokens)[0], starts])
        for k in range(size - 1):
            tail = tf.gather(tokens, tf.maximum(length - size + 1 + k, 0), axis=1)  # [B]
            match = match & tf.equal(tokens[:, k:k + starts], tail[:, None])
        match = match & (length - ctx.runtime.prompt_start + 1 >= size)
        return _ban(logits, _scatter_flags(tokens[:, size - 1:size - 1 + starts], match, logits.shape[-1]))

    return apply


def suppress_eos_early(logits, ctx):
    """Bans the EOS ids until `min_new_tokens` tokens were generated (min_length / min_new_tokens)."""
    is_eos = tf.reduce_any(tf.equal(tf.range(logits.shape[-1])[:, None], ctx.runtime.eos_ids[None, :]), axis=-1)
    return _ban(logits, is_eos[None, :] & (ctx.length - ctx.prompt_length < ctx.runtime.min_new_tokens))


def temperature(logits, ctx):
    """Divides the logits by the temperature."""
    return logits / ctx.runtime.temperature


def top_k_capacity(top_k: int, vocab_size: int) -> int:
    """The static top-k width a runtime `top_k` fits in (powers of two from 64), so that changing
    `top_k` within it does not recompile."""
    capacity = 64
    while capacity < top_k:
        capacity *= 2
    return min(capacity, vocab_size)


def top_k(capacity: int) -> Processor:
    """Keeps the `runtime.top_k` highest logits (ties with the k-th kept), as transformers; 0 = off."""

    def apply(logits, ctx):
        best = tf.math.top_k(logits, k=min(capacity, logits.shape[-1])).values
        k = tf.clip_by_value(ctx.runtime.top_k, 1, best.shape[-1])
        kth = tf.gather(best, [k - 1], axis=-1)
        return tf.where(ctx.runtime.top_k > 0, _ban(logits, logits < kth), logits)

    return apply


def top_p(capacity: int | None) -> Processor:
    """Nucleus filtering: keeps the smallest set of top tokens whose probability reaches `runtime.top_p`.

    Args:
        capacity: With top-k before it, only its `capacity` best logits can be finite, so sorting
            those suffices; None sorts the whole vocabulary.
    """

    def apply(logits, ctx):
        p = ctx.runtime.top_p
        if capacity is None:
            ordered = tf.sort(logits, axis=-1, direction="DESCENDING")
        else:
            ordered = tf.math.top_k(logits, k=min(capacity, logits.shape[-1])).values
        probs = tf.nn.softmax(ordered, axis=-1)
        before = tf.cumsum(probs, axis=-1, exclusive=True)  # mass strictly above each token
        # A token is dropped when the tokens above it already hold >= p (the first is always kept).
        keep = tf.concat([tf.ones_like(before[:, :1], tf.bool), before[:, 1:] < p], axis=-1)
        threshold = tf.reduce_min(tf.where(keep, ordered, tf.constant(float("inf"), ordered.dtype)), axis=-1,
                                  keepdims=True)
        return tf.where(p < 1.0, _ban(logits, logits < threshold), logits)

    return apply


def token_mask(ids, vocab_size: int) -> tf.Tensor:
    """bool `[V]`, True at `ids`."""
    flags = [False] * vocab_size
    for i in ids:
        if 0 <= i < vocab_size:
            flags[i] = True
    return tf.constant(flags)


def suppress(ids, vocab_size: int) -> Processor:
    """Bans `ids` at every step (transformers' SuppressTokensLogitsProcessor)."""
    banned = token_mask(ids, vocab_size)

    def apply(logits, ctx: Context):
        return tf.where(banned[None, :], tf.constant(NEG_INF, logits.dtype), logits)

    return apply


def suppress_at_begin(ids, vocab_size: int) -> Processor:
    """Bans `ids` as the first new token (transformers' SuppressTokensAtBeginLogitsProcessor)."""
    banned = token_mask(ids, vocab_size)

    def apply(logits, ctx: Context):
        first = tf.equal(ctx.length, ctx.prompt_length)
        return tf.where(banned[None, :] & first, tf.constant(NEG_INF, logits.dtype), logits)

    return apply


def build_processors(config, vocab_size: int, always: bool = False, bans: tuple = ()) -> tuple[Processor, ...]:
    """The processors transformers applies for `config`, in its order.

    Args:
        config: A `GenerationConfig`.
        vocab_size: V (sizes the top-k capacity).
        always: Include every processor whose effect depends only on runtime values, even when the
            current values make it a no-op, so that a later call with other values reuses the
            program (the compiled generator). Results are identical either way.
        bans: Further processors of the model (`GenerationMixin.generation_processors`, e.g. Whisper's
            timestamp rules) that run after the token suppression and before the sampling warpers, where
            transformers puts them.
    """
    processors: list[Processor] = []
    if always or config.repetition_penalty != 1.0:
        processors.append(repetition_penalty)
    if config.no_repeat_ngram_size > 0:
        processors.append(no_repeat_ngram(config.no_repeat_ngram_size))
    if config.eos_token_ids and (always or config.min_length > 0 or config.min_new_tokens):
        processors.append(suppress_eos_early)
    if config.begin_suppress_tokens:
        processors.append(suppress_at_begin(config.begin_suppress_tokens, vocab_size))
    if config.suppress_tokens:
        processors.append(suppress(config.suppress_tokens, vocab_size))
    processors.extend(bans)
    if config.do_sample:
        if always or config.temperature != 1.0:
            processors.append(temperature)
        capacity = top_k_capacity(config.top_k, vocab_size) if config.top_k else None
        if capacity:
            processors.append(top_k(capacity))
        if always or config.top_p < 1.0:
            processors.append(top_p(capacity))
    return tuple(processors)


def apply_processors(processors, logits: tf.Tensor, ctx: Context) -> tf.Tensor:
    """Runs the processors in order."""
    for processor in processors:
        logits = processor(logits, ctx)
    return logits


def _argmax(scores: tf.Tensor) -> tf.Tensor:
    """The highest-scoring id (int32) of each row, the first on ties: under XLA the native kernel's
    (`xlagen.native.argmax`, several times faster than XLA's own over a vocabulary), else `tf.argmax`."""
    if native.use_argmax(scores):
        return native.argmax(scores)
    return tf.argmax(scores, axis=-1, output_type=tf.int32)


def select_greedy(scores: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
    """The highest-scoring id of each row (the first on ties)."""
    return _argmax(scores)


def _mix(h: tf.Tensor) -> tf.Tensor:
    """MurmurHash3's 32-bit finaliser: a bijective avalanche of uint32 values."""
    h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, 16)) * tf.constant(0x85EBCA6B, tf.uint32)
    h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, 13)) * tf.constant(0xC2B2AE35, tf.uint32)
    return tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, 16))


def fold_seed(seed: tf.Tensor, value) -> tf.Tensor:
    """A new int32 seed `[2]` derived from `seed` `[2]` and an int32 `value` (e.g. the step)."""
    words = tf.bitcast(tf.cast(seed, tf.int32), tf.uint32)
    folded = _mix(words[1] ^ _mix(tf.bitcast(tf.cast(value, tf.int32), tf.uint32) + words[0]))
    return tf.bitcast(tf.stack([_mix(words[0]), folded]), tf.int32)


def counter_uniform(shape, seed: tf.Tensor) -> tf.Tensor:
    """float32 uniforms in (0, 1) from a counter-based hash of `seed` `[2]`.

    TensorFlow's stateless random ops give different numbers under XLA than eagerly even with the same
    algorithm; integer hashing is exact in both, so a seed gives the same tokens eager and compiled.
    """
    words = tf.bitcast(tf.cast(seed, tf.int32), tf.uint32)
    counter = tf.cast(tf.range(tf.reduce_prod(shape)), tf.uint32)
    bits = _mix(counter * tf.constant(0x9E3779B1, tf.uint32) + _mix(words[0] + _mix(words[1])))
    uniform = (tf.cast(tf.bitwise.right_shift(bits, 8), tf.float32) + 0.5) * (1.0 / 2**24)
    return tf.reshape(uniform, shape)


def select_sample(scores: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
    """One id per row drawn from softmax(scores) (Gumbel-max), reproducible for a seed `[2]`."""
    gumbel = -tf.math.log(-tf.math.log(counter_uniform(tf.shape(scores), seed)))
    return _argmax(scores + gumbel)
