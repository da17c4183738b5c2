"""Token selection where every row has its own options (the serving engine's slots).

`sampling` applies one request's options (scalars) to all its rows; here each row is a different request,
so temperature, top-k, top-p, the repetition penalty, greedy-or-sample and the random stream are `[B]`
tensors. The math is `sampling`'s: the same CTRL penalty, the same filters (ties with the k-th kept), and
Gumbel-max over the same counter-based hash, each row seeded by its own request's seed and step, so a
request's tokens do not depend on which slot it runs in or on what runs beside it.

Shapes: B rows, V vocab, S history columns.
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

from xlagen.generation.sampling import NEG_INF, _argmax, _mix, _scatter_flags


class RowOptions(NamedTuple):
    """Per-row decoding options, as tensors (new values never retrace).

    Attributes:
        do_sample: bool `[B]`, sample (else greedy).
        temperature: float32 `[B]` (> 0 where sampling).
        top_k: int32 `[B]` (0 = off).
        top_p: float32 `[B]` in (0, 1].
        repetition_penalty: float32 `[B]` (1 = off).
        seed: int32 `[B, 2]`, each row's request seed.
        step: int32 `[B]`, how many tokens the row's request generated so far (folded into its seed).
    """

    do_sample: tf.Tensor
    temperature: tf.Tensor
    top_k: tf.Tensor
    top_p: tf.Tensor
    repetition_penalty: tf.Tensor
    seed: tf.Tensor
    step: tf.Tensor


def presence(history: tf.Tensor, valid: tf.Tensor, vocab_size: int) -> tf.Tensor:
    """bool `[B, V]`: which ids occur in each row's `history` `[B, S]` where `valid` `[B, S]`."""
    return _scatter_flags(history, valid, vocab_size)


def penalize(logits: tf.Tensor, present: tf.Tensor, penalty: tf.Tensor) -> tf.Tensor:
    """CTRL's repetition penalty with one penalty `[B]` per row (`sampling.repetition_penalty`)."""
    penalty = penalty[:, None]
    return tf.where(present, tf.where(logits < 0, logits * penalty, logits / penalty), logits)


def filter_top_k_top_p(scores: tf.Tensor, top_k: tf.Tensor, top_p: tf.Tensor) -> tf.Tensor:
    """Bans (-inf) what each row's top-k `[B]` (0 = off) and then top-p `[B]` leave out, as `sampling.top_k`
    and `sampling.top_p` do for one row; one sort of the vocabulary serves both."""
    vocab = scores.shape[-1]
    ordered = tf.sort(scores, axis=-1, direction="DESCENDING")
    k = tf.where(top_k > 0, tf.minimum(top_k, vocab), vocab)
    kth = tf.gather(ordered, k[:, None] - 1, batch_dims=1)  # [B, 1]
    ordered = tf.where(tf.range(vocab)[None, :] < k[:, None], ordered, NEG_INF)
    before = tf.cumsum(tf.nn.softmax(ordered, axis=-1), axis=-1, exclusive=True)
    keep = tf.concat([tf.ones_like(before[:, :1], tf.bool), before[:, 1:] < top_p[:, None]], axis=-1)
    threshold = tf.reduce_min(tf.where(keep, ordered, float("inf")), axis=-1, keepdims=True)  # [B, 1]
    threshold = tf.where(top_p[:, None] < 1.0, threshold, NEG_INF)
    return tf.where(scores < tf.maximum(kth, threshold), NEG_INF, scores)


def row_uniform(seed: tf.Tensor, step: tf.Tensor, vocab_size: int) -> tf.Tensor:
    """float32 uniforms in (0, 1) `[B, V]`: row b from its seed `[2]` folded with its step (the hash of
    `sampling.fold_seed` and `sampling.counter_uniform`, one row at a time)."""
    words = tf.bitcast(tf.cast(seed, tf.int32), tf.uint32)  # [B, 2]
    steps = tf.bitcast(tf.cast(step, tf.int32), tf.uint32)
    first, second = _mix(words[:, 0]), _mix(words[:, 1] ^ _mix(steps + words[:, 0]))
    counter = tf.cast(tf.range(vocab_size), tf.uint32)[None, :]
    bits = _mix(counter * tf.constant(0x9E3779B1, tf.uint32) + _mix(first + _mix(second))[:, None])
    return (tf.cast(tf.bitwise.right_shift(bits, 8), tf.float32) + 0.5) * (1.0 / 2**24)


def choose(logits: tf.Tensor, present, options: RowOptions, alternatives: int = 0):
    """Each row's next token and its log-probability.

    Args:
        logits: float32 `[B, V]`.
        present: `() -> bool [B, V]`, the ids already in each row's prompt and output (`presence`); only
            called when a row has a repetition penalty (the scatter costs about a quarter of a GPT-2-small
            step of 16 rows on a 2-core CPU).
        options: The rows' options.
        alternatives: A: how many of the most likely tokens of each row's distribution to report too
            (static; 0: none).

    Returns:
        `(ids int32 [B], logprobs float32 [B], top_ids int32 [B, A], top_logprobs float32 [B, A])`: greedy rows
        take the argmax of the penalised logits (their log-softmax gives the logprob); sampling rows draw from
        the penalised logits divided by the temperature and filtered by top-k and top-p (the logprob is of that
        distribution); the top tokens are of the same distribution, most likely first.
    """
    scores = tf.cond(tf.reduce_any(options.repetition_penalty != 1.0),
                     lambda: penalize(logits, present(), options.repetition_penalty), lambda: logits)

    def sampled():
        temperature = tf.where(options.do_sample, options.temperature, 1.0)[:, None]
        warped = scores / temperature
        filtering = options.do_sample & ((options.top_k > 0) | (options.top_p < 1.0))
        warped = tf.cond(tf.reduce_any(filtering),
                         lambda: filter_top_k_top_p(warped, options.top_k, options.top_p), lambda: warped)
        gumbel = -tf.math.log(-tf.math.log(row_uniform(options.seed, options.step, logits.shape[-1])))
        ids = tf.where(options.do_sample, _argmax(warped + gumbel), _argmax(scores))
        return ids, tf.where(options.do_sample[:, None], warped, scores)

    ids, final = tf.cond(tf.reduce_any(options.do_sample), sampled, lambda: (_argmax(scores), scores))
    distribution = tf.nn.log_softmax(final, axis=-1)
    logprobs = tf.gather(distribution, ids[:, None], batch_dims=1)[:, 0]
    if alternatives:
        top_logprobs, top_ids = tf.math.top_k(distribution, k=alternatives)
    else:
        top_logprobs, top_ids = tf.zeros([logits.shape[0], 0]), tf.zeros([logits.shape[0], 0], tf.int32)
    return ids, logprobs, top_ids, top_logprobs
