"""Greedy and sampling decoding as one `tf.while_loop` with fixed-shape state.

Shapes: B rows, P prompt length (static), N the static new-token capacity, T_max = P + N, V vocab.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import tensorflow as tf
from keras import ops

from xlagen import native
from xlagen.generation.sampling import Context, Runtime, apply_processors, fold_seed


class Plan(NamedTuple):
    """The static choices of one decoding run (a different plan means a new trace).

    Attributes:
        max_new_tokens: N, the capacity of the token buffer; `Runtime.max_new_tokens` <= N.
        processors: Logits processors, in order.
        select: `(scores [B, V], seed [2]) -> ids [B]`.
        output_scores: Keep the processed scores of every step.
    """

    max_new_tokens: int
    processors: tuple
    select: Callable
    output_scores: bool


class Prompt(NamedTuple):
    """What the decoder continues, and the model's other inputs.

    Attributes:
        ids: int32 `[B, P]`, the (decoder) prompt, left-padded; the output sequences start with it.
        mask: int32 `[B, P]`.
        extra: Dict of the model's other inputs for `prefill` (e.g. an encoder's ids and mask), each
            with the batch on axis 0; empty for decoder-only models.
    """

    ids: tf.Tensor
    mask: tf.Tensor
    extra: dict


def repeat_rows(prompt: Prompt, times: int) -> Prompt:
    """Each row of every tensor of `prompt` repeated `times` times (consecutively)."""
    return tf.nest.map_structure(lambda t: tf.repeat(t, times, axis=0), prompt)


def prefill(model, prompt: Prompt, total_length: int):
    """`model.prefill` on a prompt whose padding and finished positions hold id 0 (see `model_ids`), traced
    as a generation's prompt pass (`native.prefill`)."""
    with native.prefill():
        return model.prefill(model_ids(prompt.ids, prompt.mask), prompt.mask, total_length, **prompt.extra)


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


def is_eos(ids: tf.Tensor, eos_ids: tf.Tensor) -> tf.Tensor:
    """bool, same shape as `ids`: whether each id is one of `eos_ids` `[E]`."""
    return tf.reduce_any(tf.equal(ids[..., None], eos_ids), axis=-1)


def model_ids(ids: tf.Tensor, real: tf.Tensor) -> tf.Tensor:
    """Ids to feed the model: positions that are not `real` (padding, rows already finished) become 0.

    Their outputs are never used, and this keeps pad ids outside the vocabulary (e.g. a `</s>` pad
    token added to GPT-2's tokenizer) from indexing past the embedding.
    """
    return tf.where(tf.cast(real, tf.bool), ids, tf.zeros_like(ids))


def prompt_buffer(input_ids: tf.Tensor, capacity: int, pad_id: tf.Tensor) -> tf.Tensor:
    """The token buffer `[B, P + capacity]`: the prompt, then `pad_id`."""
    filler = tf.fill([batch_size(input_ids), capacity], tf.cast(pad_id, tf.int32))
    return tf.concat([input_ids, filler], axis=1)


def decode(model, prompt: Prompt, plan: Plan, runtime: Runtime):
    """Greedy or sampled decoding of a left-padded batch.

    Args:
        model: Anything with `prefill(ids, mask, total_length, **extra)` and `decode_step(ids, index, state)`
            (see `xlagen.models.base.CausalDecoding`).
        prompt: The prompt and the model's other inputs.
        plan: Static options.
        runtime: Tensor options.

    Returns:
        `(tokens int32 [B, T_max], scores float32 [B, N, V] or None)`.
    """
    batch, prompt_length = batch_size(prompt.ids), prompt.ids.shape[1]
    total = prompt_length + plan.max_new_tokens
    end = prompt_length + tf.minimum(runtime.max_new_tokens, plan.max_new_tokens)
    logits, decoder_state = prefill(model, prompt, total)
    vocab = logits.shape[-1]
    score_steps = plan.max_new_tokens if plan.output_scores else 0
    state = LoopState(prompt_buffer(prompt.ids, plan.max_new_tokens, runtime.pad_id),
                      tf.constant(prompt_length, tf.int32), tf.zeros([batch], tf.bool), decoder_state,
                      tf.zeros([batch, score_steps, vocab], tf.float32))

    def choose(state: LoopState, logits) -> LoopState:
        ctx = Context(state.tokens, state.index, prompt_length, runtime)
        scores = apply_processors(plan.processors, logits, ctx)
        ids = plan.select(scores, fold_seed(runtime.seed, state.index - prompt_length))  # per step, not column
        ids = tf.where(state.done, runtime.pad_id, ids)
        kept = state.scores
        if plan.output_scores:
            kept = write_column(kept, scores, state.index - prompt_length)
        return state._replace(tokens=write_column(state.tokens, ids, state.index), index=state.index + 1,
                              done=state.done | is_eos(ids, runtime.eos_ids), scores=kept)

    def running(state: LoopState):
        return (state.index < end) & tf.logical_not(tf.reduce_all(state.done))

    def body(state: LoopState):
        last = model_ids(tf.gather(state.tokens, [state.index - 1], axis=1), ~state.done[:, None])  # [B, 1]
        with native.decoding_step():
            logits, decoder_state = model.decode_step(last, state.index - 1, state.decoder_state)
        return (choose(state._replace(decoder_state=decoder_state), logits),)

    state = choose(state, logits)
    (state,) = tf.while_loop(running, body, (state,), maximum_iterations=plan.max_new_tokens - 1)
    return state.tokens, (state.scores if plan.output_scores else None)
