"""Beam search as one `tf.while_loop`, with transformers 4.x's vectorised algorithm and scoring.

Shapes: B prompts, K beams, C = candidates kept per step (max(2, 1 + #EOS) * K), P prompt length,
T_max = P + N, V vocab. Model rows are `B * K`, beam-major within each prompt.
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

from xlagen import native
from xlagen.generation.loop import (Decoded, Plan, Prompt, batch_size, first_logprobs, is_eos, prefill, prompt_buffer,
                                    write_column)
from xlagen.generation.sampling import Context, Runtime, apply_processors

BIG_NEGATIVE = -1.0e9


class BeamOptions(NamedTuple):
    """Beam-search-only static options (the length penalty is a runtime tensor)."""

    num_beams: int
    early_stopping: bool | str
    num_return_sequences: int
    num_eos: int


class BeamState(NamedTuple):
    running: tf.Tensor  # int32 [B, K, T_max]
    running_scores: tf.Tensor  # float32 [B, K]
    finished: tf.Tensor  # int32 [B, K, T_max], best finished hypotheses
    finished_scores: tf.Tensor  # float32 [B, K]
    is_finished: tf.Tensor  # bool [B, K]
    improvable: tf.Tensor  # bool [B, 1], the early-stop heuristic is not yet satisfied
    all_hit_stop: tf.Tensor  # bool scalar: every candidate of the last step hit a stopping criterion
    parents: tf.Tensor  # int32 [B * K], model rows the running beams continue (cache reorder)
    index: tf.Tensor  # int32 scalar: where the next token is written
    decoder_state: object
    scores: tf.Tensor  # float32 [B * K, N, V] or [B * K, 0, V]
    running_logprobs: tf.Tensor  # float32 [B, K, N] (output_logprobs) or [B, K, 0]: each token's log-probability
    finished_logprobs: tf.Tensor  # float32 [B, K, N] or [B, K, 0], those of the finished hypotheses


def _gather_beams(tensor: tf.Tensor, indices: tf.Tensor) -> tf.Tensor:
    return tf.gather(tensor, indices, axis=1, batch_dims=1)


def beam_search(model, prompt: Prompt, plan: Plan, options: BeamOptions, runtime: Runtime) -> Decoded:
    """Beam search over a left-padded batch.

    Args:
        model: Anything with `prefill` / `expand_beams` / `decode_step` / `reorder_state` (see
            `xlagen.models.base.CausalDecoding`).
        prompt: The prompt and the model's other inputs.
        plan: Static options shared with greedy decoding (`select` is unused).
        options: Beam options.
        runtime: Tensor options.

    Returns:
        `Decoded`: sequences int32 `[B * R, T_max]` and their scores float32 `[B * R]` (R = num_return_sequences),
        the step scores `[B * K, N, V]` with `output_scores`, and with `output_logprobs` each returned token's
        log-probability `[B * R, N]` (the log-softmax of the step's processed scores, as transformers' Whisper
        takes them along the beam; a beam's score sums the processed scores without renormalising them) and
        the log-probabilities after the prompt's first token (`first_logprobs`).
    """
    num_beams, prompt_length = options.num_beams, prompt.ids.shape[1]
    batch = batch_size(prompt.ids)
    total = prompt_length + plan.max_new_tokens
    end = prompt_length + tf.minimum(runtime.max_new_tokens, plan.max_new_tokens)
    keep = max(2, 1 + options.num_eos) * num_beams
    logits, decoder_state = prefill(model, prompt, total)
    vocab = logits.shape[-1]
    first = None
    if plan.output_logprobs:
        first = tf.repeat(first_logprobs(model, prompt, decoder_state, runtime), options.num_return_sequences, axis=0)
    # Every beam starts from the same prompt (and encoder output): run it once, then repeat rows K times.
    logits = tf.repeat(logits, num_beams, axis=0)
    decoder_state = model.expand_beams(decoder_state, num_beams)
    running = tf.repeat(prompt_buffer(prompt.ids, plan.max_new_tokens, runtime.pad_id)[:, None, :], num_beams, axis=1)
    first_only = tf.concat([tf.zeros([batch, 1]), tf.fill([batch, num_beams - 1], BIG_NEGATIVE)], axis=1)
    score_steps = plan.max_new_tokens if plan.output_scores else 0
    no_logprobs = tf.zeros([batch, num_beams, plan.max_new_tokens if plan.output_logprobs else 0])
    state = BeamState(running, first_only, running, tf.fill([batch, num_beams], BIG_NEGATIVE),
                      tf.zeros([batch, num_beams], tf.bool), tf.ones([batch, 1], tf.bool), tf.constant(False),
                      tf.range(batch * num_beams), tf.constant(prompt_length, tf.int32), decoder_state,
                      tf.zeros([batch * num_beams, score_steps, vocab]), no_logprobs, no_logprobs)
    is_top_beam = tf.range(keep) < num_beams  # only the first K candidates may become finished hypotheses
    early_stopping, length_penalty = options.early_stopping, runtime.length_penalty

    def choose(state: BeamState, logits) -> BeamState:
        cur = state.index
        flat_running = tf.reshape(state.running, [batch * num_beams, total])
        log_probs = apply_processors(plan.processors, tf.nn.log_softmax(logits, axis=-1),
                                     Context(flat_running, cur, prompt_length, runtime))
        kept_scores = write_column(state.scores, log_probs, cur - prompt_length) if plan.output_scores else state.scores
        totals = tf.reshape(log_probs, [batch, num_beams, vocab]) + state.running_scores[:, :, None]
        top_scores, top_indices = tf.math.top_k(tf.reshape(totals, [batch, num_beams * vocab]), k=keep)
        source_beams, ids = top_indices // vocab, top_indices % vocab  # [B, C]
        candidates = _gather_beams(state.running, source_beams)
        candidates = tf.transpose(write_column(tf.transpose(candidates, [0, 2, 1]), ids, cur), [0, 2, 1])
        histories = _gather_beams(state.running_logprobs, source_beams)  # [B, C, N]
        if plan.output_logprobs:
            renormalised = log_probs - tf.reduce_logsumexp(log_probs, axis=-1, keepdims=True)
            chosen_logprobs = tf.gather(tf.reshape(renormalised, [batch, num_beams * vocab]), top_indices,
                                        batch_dims=1)  # [B, C]
            histories = tf.transpose(write_column(tf.transpose(histories, [0, 2, 1]), chosen_logprobs,
                                                  cur - prompt_length), [0, 2, 1])
        hit_stop = is_eos(ids, runtime.eos_ids) | (cur + 1 >= end)  # [B, C]

        # Continue with the best K candidates that did not stop.
        continuing = top_scores + tf.cast(hit_stop, tf.float32) * BIG_NEGATIVE
        next_running_scores, chosen = tf.math.top_k(continuing, k=num_beams)
        parents = tf.reshape(_gather_beams(source_beams, chosen) + tf.range(batch)[:, None] * num_beams,
                             [batch * num_beams])

        # Candidates that stopped among the top K become finished hypotheses if they beat the kept ones.
        just_finished = hit_stop & is_top_beam[None, :]
        length = tf.cast(cur + 1 - prompt_length, tf.float32)
        finished_scores = top_scores / length ** length_penalty
        full = tf.reduce_all(state.is_finished, axis=-1, keepdims=True) & (early_stopping is True)
        finished_scores += tf.cast(full, tf.float32) * BIG_NEGATIVE
        finished_scores += tf.cast(~state.improvable, tf.float32) * BIG_NEGATIVE
        finished_scores += tf.cast(~just_finished, tf.float32) * BIG_NEGATIVE
        merged_scores = tf.concat([state.finished_scores, finished_scores], axis=1)
        best_scores, best = tf.math.top_k(merged_scores, k=num_beams)
        finished = _gather_beams(tf.concat([state.finished, candidates], axis=1), best)
        finished_logprobs = _gather_beams(tf.concat([state.finished_logprobs, histories], axis=1), best)
        is_finished = _gather_beams(tf.concat([state.is_finished, just_finished], axis=1), best)

        # transformers' early-stop heuristic: can a running beam still beat the worst finished one?
        cur = cur + 1
        best_length = tf.cast(cur - prompt_length, tf.float32)
        if early_stopping == "never":  # a positive length penalty favours the longest possible hypothesis
            best_length = tf.where(length_penalty > 0.0, tf.cast(end - prompt_length, tf.float32), best_length)
        best_running = next_running_scores[:, :1] / best_length ** length_penalty
        worst_finished = tf.where(is_finished, tf.reduce_min(best_scores, axis=1, keepdims=True), BIG_NEGATIVE)
        improvable = state.improvable & tf.reduce_any(best_running > worst_finished, axis=-1, keepdims=True)
        return state._replace(running=_gather_beams(candidates, chosen), running_scores=next_running_scores,
                              finished=finished, finished_scores=best_scores, is_finished=is_finished,
                              improvable=improvable, all_hit_stop=tf.reduce_all(hit_stop), parents=parents,
                              index=cur, scores=kept_scores, running_logprobs=_gather_beams(histories, chosen),
                              finished_logprobs=finished_logprobs)

    def running_cond(state: BeamState):
        open_beams = tf.logical_not(tf.reduce_all(state.is_finished) & (early_stopping is True))
        return tf.reduce_any(state.improvable) & open_beams & tf.logical_not(state.all_hit_stop)

    def body(state: BeamState):
        decoder_state = model.reorder_state(state.decoder_state, state.parents)
        last = tf.reshape(tf.gather(state.running, state.index - 1, axis=2), [batch * num_beams, 1])
        with native.decoding_step():
            logits, decoder_state = model.decode_step(last, state.index - 1, decoder_state)
        return (choose(state._replace(decoder_state=decoder_state), logits),)

    state = choose(state, logits)
    (state,) = tf.while_loop(running_cond, body, (state,), maximum_iterations=plan.max_new_tokens - 1)
    returned = options.num_return_sequences
    sequences = tf.reshape(state.finished[:, :returned], [batch * returned, total])
    sequence_scores = tf.reshape(state.finished_scores[:, :returned], [-1])
    logprobs = None
    if plan.output_logprobs:
        logprobs = tf.reshape(state.finished_logprobs[:, :returned], [batch * returned, plan.max_new_tokens])
    return Decoded(sequences, sequence_scores, state.scores if plan.output_scores else None, logprobs, first)
