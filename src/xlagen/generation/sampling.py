"""Logits processors and token-selection strategies as pure functions.

Every function here works unchanged eagerly and under XLA: fixed shapes, no Python branching on tensor
values. Shapes: B rows (batch x beams), V vocab, T_max the static token buffer.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import tensorflow as tf

NEG_INF = float("-inf")


class Context(NamedTuple):
    """What processors may look at besides the logits.

    Attributes:
        tokens: int32 `[B, T_max]`, the token buffer (prompt, generated tokens, then filler).
        length: int32 scalar, how many leading positions of `tokens` are valid.
    """

    tokens: tf.Tensor
    length: tf.Tensor


Processor = Callable[[tf.Tensor, Context], tf.Tensor]


def _valid_positions(ctx: Context) -> tf.Tensor:
    return tf.range(tf.shape(ctx.tokens)[1]) < ctx.length  # [T_max]


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


def repetition_penalty(penalty: float) -> Processor:
    """CTRL's penalty: present tokens' scores are divided (positive) or multiplied (negative) by it."""

    def apply(logits, ctx):
        seen = presence(ctx, logits.shape[-1])
        penalized = tf.where(logits < 0, logits * penalty, logits / penalty)
        return tf.where(seen, penalized, logits)

    return apply


def no_repeat_ngram(size: int) -> Processor:
    """Bans every token that would complete an n-gram already present in the row."""

    def apply(logits, ctx):
        tokens, length = ctx.tokens, ctx.length
        total = tokens.shape[1]
        starts = total - size + 1  # candidate n-gram starts i: tokens[i : i + size]
        if starts <= 0:
            return logits
        # The (size-1)-gram that ends the sequence, compared against every earlier window.
        match = tf.range(starts) + size - 1 < length  # the n-gram lies inside the valid tokens
        match = tf.broadcast_to(match[None, :], [tf.shape(tokens)[0], starts])
        for k in range(size - 1):
            tail = tf.gather(tokens, tf.maximum(length - size + 1 + k, 0), axis=1)  # [B]
            match = match & tf.equal(tokens[:, k:k + starts], tail[:, None])
        match = match & (length + 1 >= size)
        banned_ids = tokens[:, size - 1:size - 1 + starts]  # [B, starts]
        return _ban(logits, _scatter_flags(banned_ids, match, logits.shape[-1]))

    return apply


def suppress_eos_until(min_length: int, eos_ids: tuple[int, ...], offset: int = 0) -> Processor:
    """Bans the EOS ids while `length - offset < min_length` (min_length / min_new_tokens)."""
    def apply(logits, ctx):
        is_eos = tf.reduce_any(tf.equal(tf.range(logits.shape[-1])[:, None], list(eos_ids)), axis=-1)
        return _ban(logits, is_eos[None, :] & (ctx.length - offset < min_length))

    return apply


def temperature(value: float) -> Processor:
    """Divides the logits by the temperature."""
    return lambda logits, ctx: logits / value


def top_k(k: int) -> Processor:
    """Keeps the k highest logits (ties with the k-th kept), as transformers' TopKLogitsWarper."""

    def apply(logits, ctx):
        kth = tf.math.top_k(logits, k=min(k, logits.shape[-1])).values[:, -1:]
        return _ban(logits, logits < kth)

    return apply


def top_p(p: float) -> Processor:
    """Nucleus filtering: keeps the smallest set of top tokens whose probability reaches `p`."""

    def apply(logits, ctx):
        ordered = tf.sort(logits, axis=-1, direction="DESCENDING")
        probs = tf.nn.softmax(ordered, axis=-1)
        before = tf.cumsum(probs, axis=-1, exclusive=True)  # mass strictly above each token
        # A token is dropped when the tokens above it already hold >= p (the first is always kept).
        keep = tf.concat([tf.ones_like(before[:, :1], tf.bool), before[:, 1:] < p], axis=-1)
        threshold = tf.reduce_min(tf.where(keep, ordered, tf.constant(float("inf"), ordered.dtype)), axis=-1,
                                  keepdims=True)
        return _ban(logits, logits < threshold)

    return apply


def build_processors(config, prompt_length: int) -> list[Processor]:
    """The processor list transformers builds for `config`, in the same order.

    Args:
        config: A `GenerationConfig`.
        prompt_length: The (padded) prompt length, for `min_new_tokens`.
    """
    processors = []
    if config.repetition_penalty != 1.0:
        processors.append(repetition_penalty(config.repetition_penalty))
    if config.no_repeat_ngram_size > 0:
        processors.append(no_repeat_ngram(config.no_repeat_ngram_size))
    if config.eos_token_ids and config.min_length > 0:
        processors.append(suppress_eos_until(config.min_length, config.eos_token_ids))
    if config.eos_token_ids and config.min_new_tokens:
        processors.append(suppress_eos_until(config.min_new_tokens, config.eos_token_ids, prompt_length))
    if config.do_sample:
        if config.temperature != 1.0:
            processors.append(temperature(config.temperature))
        if config.top_k:
            processors.append(top_k(config.top_k))
        if config.top_p < 1.0:
            processors.append(top_p(config.top_p))
    return processors


def apply_processors(processors: list[Processor], logits: tf.Tensor, ctx: Context) -> tf.Tensor:
    """Runs the processors in order."""
    for processor in processors:
        logits = processor(logits, ctx)
    return logits


def select_greedy(scores: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
    """The highest-scoring id of each row (the first on ties)."""
    return tf.argmax(scores, axis=-1, output_type=tf.int32)


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
    return tf.argmax(scores + gumbel, axis=-1, output_type=tf.int32)
