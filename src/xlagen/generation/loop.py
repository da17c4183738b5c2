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
        output_logprobs: Keep each chosen token's log-probability (`[B, N]`, not the `[B, N, V]` scores) and
            the log-probabilities after the prompt's first token (`first_logprobs`).
    """

    max_new_tokens: int
    processors: tuple
    select: Callable
    output_scores: bool
    output_logprobs: bool = False


class Decoded(NamedTuple):
    """What a decoding loop returns; None for what its plan does not keep.

    Attributes:
        sequences: int32 `[B * R, T_max]`, the prompt and the new tokens, pad after EOS.
        sequence_scores: Beam search: float32 `[B * R]`, the returned beams' scores.
        scores: With `output_scores`, float32 `[rows, N, V]` processed scores (beam search: a row per beam).
        logprobs: With `output_logprobs`, float32 `[B * R, N]`: the log-probability of each new token under the
            processed scores it was chosen from (beam search: their log-softmax); 0 after EOS.
        first_logprobs: With `output_logprobs`, float32 `[B * R, V]`: see `first_logprobs`.
    """

    sequences: tf.Tensor
    sequence_scores: tf.Tensor | None = None
    scores: tf.Tensor | None = None
    logprobs: tf.Tensor | None = None
    first_logprobs: tf.Tensor | None = None


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
    logprobs: tf.Tensor  # float32 [B, N] when output_logprobs, else [B, 0]


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


def first_logprobs(model, prompt: Prompt, decoder_state, runtime: Runtime) -> tf.Tensor:
    """float32 `[B, V]`: the log-softmax of the model's logits after the prompt's first column (its first token
    where rows are not left-padded: an encoder-decoder model's decoder start token), before any processor.

    A row whose first column is left padding gets what follows a pad, which means nothing.
    One decoding step at that column over the prefilled state; the state it returns is dropped, so the cache
    the loop continues from is the prompt pass's. Whisper's no-speech probability is read here (transformers'
    `WhisperNoSpeechDetection` takes the logits at the start token's position).
    """
    start = runtime.prompt_start
    token = model_ids(tf.gather(prompt.ids, [start], axis=1), tf.gather(prompt.mask, [start], axis=1))  # [B, 1]
    with native.decoding_step():
        logits, _ = model.decode_step(token, start, decoder_state)
    return tf.nn.log_softmax(tf.cast(logits, tf.float32), axis=-1)


def chosen_logprobs(scores: tf.Tensor, ids: tf.Tensor) -> tf.Tensor:
    """float32 `[B]`: the log-probability of `ids` `[B]` under the softmax of `scores` `[B, V]`."""
    scores = tf.cast(scores, tf.float32)
    return tf.gather(scores, ids, axis=1, batch_dims=1) - tf.reduce_logsumexp(scores, axis=-1)


def decode(model, prompt: Prompt, plan: Plan, runtime: Runtime) -> Decoded:
    """Greedy or sampled decoding of a left-padded batch.

    Args:
        model: Anything with `prefill(ids, mask, total_length, **extra)` and `decode_step(ids, index, state)`
            (see `xlagen.models.base.CausalDecoding`).
        prompt: The prompt and the model's other inputs.
        plan: Static options.
        runtime: Tensor options.

    Returns:
        `Decoded`: the tokens `[B, T_max]`, and the scores and log-probabilities the plan keeps.
    """
    batch, prompt_length = batch_size(prompt.ids), prompt.ids.shape[1]
    total = prompt_length + plan.max_new_tokens
    end = prompt_length + tf.minimum(runtime.max_new_tokens, plan.max_new_tokens)
    logits, decoder_state = prefill(model, prompt, total)
    vocab = logits.shape[-1]
    first = first_logprobs(model, prompt, decoder_state, runtime) if plan.output_logprobs else None
    score_steps = plan.max_new_tokens if plan.output_scores else 0
    state = LoopState(prompt_buffer(prompt.ids, plan.max_new_tokens, runtime.pad_id),
                      tf.constant(prompt_length, tf.int32), tf.zeros([batch], tf.bool), decoder_state,
                      tf.zeros([batch, score_steps, vocab], tf.float32),
                      tf.zeros([batch, plan.max_new_tokens if plan.output_logprobs else 0], tf.float32))

    def choose(state: LoopState, logits) -> LoopState:
        ctx = Context(state.tokens, state.index, prompt_length, runtime)
        scores = apply_processors(plan.processors, logits, ctx)
        ids = plan.select(scores, fold_seed(runtime.seed, state.index - prompt_length))  # per step, not column
        ids = tf.where(state.done, runtime.pad_id, ids)
        kept, logprobs = state.scores, state.logprobs
        if plan.output_scores:
            kept = write_column(kept, scores, state.index - prompt_length)
        if plan.output_logprobs:
            chosen = tf.where(state.done, 0.0, chosen_logprobs(scores, ids))
            logprobs = write_column(logprobs, chosen, state.index - prompt_length)
        return state._replace(tokens=write_column(state.tokens, ids, state.index), index=state.index + 1,
                              done=state.done | is_eos(ids, runtime.eos_ids), scores=kept, logprobs=logprobs)

    def running(state: LoopState):
        return (state.index < end) & tf.logical_not(tf.reduce_all(state.done))

    def body(state: LoopState):
        last = model_ids(tf.gather(state.tokens, [state.index - 1], axis=1), ~state.done[:, None])  # [B, 1]
        with native.decoding_step():
            logits, decoder_state = model.decode_step(last, state.index - 1, state.decoder_state)
        return (choose(state._replace(decoder_state=decoder_state), logits),)

    state = choose(state, logits)
    (state,) = tf.while_loop(running, body, (state,), maximum_iterations=plan.max_new_tokens - 1)
    return Decoded(state.tokens, scores=state.scores if plan.output_scores else None,
                   logprobs=state.logprobs if plan.output_logprobs else None, first_logprobs=first)
