"""Greedy and sampling decoding as one `tf.while_loop` with fixed-shape state.

Shapes: B rows, P prompt length, N new tokens, T_max = P + N, V vocab.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import tensorflow as tf
from keras import ops

from xlagen.generation.sampling import Context, Processor, apply_processors, fold_seed


class Plan(NamedTuple):
    """The static choices of one decoding run (a new plan means a new trace).

    Attributes:
        max_new_tokens: N.
        processors: Logits processors, in order.
        select: `(scores [B, V], seed [2]) -> ids [B]`.
        eos_ids: Ids that finish a row.
        pad_id: Filler written after a row finished.
        output_scores: Keep the processed scores of every step.
    """

    max_new_tokens: int
    processors: list[Processor]
    select: Callable
    eos_ids: tuple[int, ...]
    pad_id: int
    output_scores: bool


class LoopState(NamedTuple):
    tokens: tf.Tensor  # int32 [B, T_max]
    index: tf.Tensor  # int32 scalar: where the next token is written
    done: tf.Tensor  # bool [B]
    decoder_state: object  # the model's nest (cache, masks, encoder outputs), batch on axis 0
    scores: tf.Tensor  # float32 [B, N, V] when output_scores, else [B, 0, V]


def batch_size(tensor: tf.Tensor):
    """The static batch size when known (so loop state keeps static shapes), else the dynamic one."""
    return tensor.shape[0] if tensor.shape[0] is not None else tf.shape(tensor)[0]


def write_column(buffer: tf.Tensor, column: tf.Tensor, index) -> tf.Tensor:
    """`buffer[:, index] = column` as a dynamic-update-slice (in place under XLA)."""
    start = [tf.zeros((), tf.int32), tf.cast(index, tf.int32)] + [tf.zeros((), tf.int32)] * (buffer.shape.rank - 2)
    return ops.slice_update(buffer, start, tf.expand_dims(column, 1))


def is_eos(ids: tf.Tensor, eos_ids: tuple[int, ...]) -> tf.Tensor:
    """bool, same shape as `ids`: whether each id is one of `eos_ids`."""
    if not eos_ids:
        return tf.zeros_like(ids, tf.bool)
    return tf.reduce_any(tf.equal(ids[..., None], tf.constant(eos_ids, ids.dtype)), axis=-1)


def model_ids(ids: tf.Tensor, real: tf.Tensor) -> tf.Tensor:
    """Ids to feed the model: positions that are not `real` (padding, rows already finished) become 0.

    Their outputs are never used, and this keeps pad ids outside the vocabulary (e.g. a `</s>` pad
    token added to GPT-2's tokenizer) from indexing past the embedding.
    """
    return tf.where(tf.cast(real, tf.bool), ids, tf.zeros_like(ids))


def decode(model, input_ids, attention_mask, plan: Plan, seed):
    """Greedy or sampled decoding of a left-padded batch.

    Args:
        model: Anything with `prefill(ids, mask, total_length)` and `decode_step(ids, index, state)`.
        input_ids: int32 `[B, P]`.
        attention_mask: int32 `[B, P]`.
        plan: Static options.
        seed: int32 `[2]` (used only by sampling strategies).

    Returns:
        `(tokens int32 [B, T_max], scores float32 [B, N, V] or None)`.
    """
    batch, prompt_length = batch_size(input_ids), input_ids.shape[1]
    total = prompt_length + plan.max_new_tokens
    logits, decoder_state = model.prefill(model_ids(input_ids, attention_mask), attention_mask, total)
    vocab = logits.shape[-1]
    tokens = tf.concat([input_ids, tf.fill([batch, plan.max_new_tokens], tf.constant(plan.pad_id, tf.int32))], 1)
    score_steps = plan.max_new_tokens if plan.output_scores else 0
    state = LoopState(tokens, tf.constant(prompt_length, tf.int32), tf.zeros([batch], tf.bool), decoder_state,
                      tf.zeros([batch, score_steps, vocab], tf.float32))

    def choose(state: LoopState, logits) -> LoopState:
        scores = apply_processors(plan.processors, logits, Context(state.tokens, state.index))
        ids = plan.select(scores, fold_seed(seed, state.index))
        ids = tf.where(state.done, tf.constant(plan.pad_id, tf.int32), ids)
        kept = state.scores
        if plan.output_scores:
            kept = write_column(kept, scores, state.index - prompt_length)
        return state._replace(tokens=write_column(state.tokens, ids, state.index), index=state.index + 1,
                              done=state.done | is_eos(ids, plan.eos_ids), scores=kept)

    def running(state: LoopState):
        return (state.index < total) & tf.logical_not(tf.reduce_all(state.done))

    def body(state: LoopState):
        last = model_ids(tf.gather(state.tokens, [state.index - 1], axis=1), ~state.done[:, None])  # [B, 1]
        logits, decoder_state = model.decode_step(last, state.index - 1, state.decoder_state)
        return (choose(state._replace(decoder_state=decoder_state), logits),)

    state = choose(state, logits)
    (state,) = tf.while_loop(running, body, (state,), maximum_iterations=plan.max_new_tokens - 1)
    return state.tokens, (state.scores if plan.output_scores else None)
