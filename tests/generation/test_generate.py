"""generate(): tokens identical to transformers' PyTorch generate, eager and under XLA."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from conftest import random_ids
from generation.helpers import assert_same_tokens, eos_that_occurs, hf_generate, left_pad

PAD = 1  # a pad id different from EOS and from 0 (transformers treats pad id 0 as "no pad" in beam search)


@pytest.fixture(scope="module")
def prompts():
    return random_ids((3, 5), 64, seed=10)


@pytest.fixture(scope="module")
def eos(gpt2_model, prompts):
    return eos_that_occurs(gpt2_model, prompts)


def test_greedy_matches_transformers(gpt2_checkpoint, gpt2_model, prompts, eos):
    _, reference = gpt2_checkpoint
    options = dict(max_new_tokens=12, eos_token_id=eos, pad_token_id=PAD)
    ours = gpt2_model.generate(prompts, **options)
    theirs = hf_generate(reference, prompts, do_sample=False, **options)
    assert (theirs[:, 5:] == eos).any(), "the test should exercise EOS"
    assert_same_tokens(ours, theirs, PAD)


BEAM_CASES = [
    dict(num_beams=2),
    dict(num_beams=3, length_penalty=0.5),
    dict(num_beams=3, length_penalty=2.0, early_stopping=True),
    dict(num_beams=4, early_stopping="never", num_return_sequences=2),
    dict(num_beams=4, length_penalty=0.0, early_stopping="never", num_return_sequences=4),
    dict(num_beams=2, early_stopping=True, num_return_sequences=2),
]


@pytest.mark.parametrize("case", BEAM_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_beam_search_matches_transformers(gpt2_checkpoint, gpt2_model, prompts, eos, case):
    _, reference = gpt2_checkpoint
    options = dict(max_new_tokens=10, eos_token_id=eos, pad_token_id=PAD, **case)
    ours = gpt2_model.generate(prompts, **options)
    theirs = hf_generate(reference, prompts, do_sample=False, **options)
    assert_same_tokens(ours, theirs, PAD)


PROCESSOR_CASES = [
    dict(repetition_penalty=1.5),
    dict(repetition_penalty=0.7),
    dict(no_repeat_ngram_size=2),
    dict(no_repeat_ngram_size=3, repetition_penalty=1.2),
    dict(min_new_tokens=6),
    dict(min_length=12),
]


@pytest.mark.parametrize("num_beams", [1, 3])
@pytest.mark.parametrize("case", PROCESSOR_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_processors_match_transformers(gpt2_checkpoint, gpt2_model, prompts, eos, case, num_beams):
    _, reference = gpt2_checkpoint
    options = dict(max_new_tokens=10, eos_token_id=eos, pad_token_id=PAD, num_beams=num_beams, **case)
    ours = gpt2_model.generate(prompts, **options)
    theirs = hf_generate(reference, prompts, do_sample=False, **options)
    assert_same_tokens(ours, theirs, PAD)


def test_max_length_default_counts_the_prompt(gpt2_checkpoint, gpt2_model, prompts):
    _, reference = gpt2_checkpoint
    ours = np.asarray(gpt2_model.generate(prompts, eos_token_id=None))
    # transformers 4.x TF: the default max_length=20 includes the 5 prompt tokens.
    # (transformers' PyTorch generate adds 20 to the prompt when max_length is left at its default, so
    # the reference is asked for max_length=20 explicitly.)
    assert ours.shape == (3, 20)
    assert_same_tokens(ours, hf_generate(reference, prompts, do_sample=False, pad_token_id=PAD,
                                         eos_token_id=None, max_length=20), PAD)


@pytest.mark.parametrize("num_beams", [1, 2])
def test_left_padded_rows_equal_rows_alone_and_transformers(gpt2_checkpoint, gpt2_model, num_beams):
    _, reference = gpt2_checkpoint
    rows = [random_ids((1, n), 64, seed=20 + n)[0] for n in (3, 7, 5)]
    ids, mask = left_pad(rows, PAD)
    options = dict(max_new_tokens=8, pad_token_id=PAD, eos_token_id=None, num_beams=num_beams)
    batch = np.asarray(gpt2_model.generate(ids, attention_mask=mask, **options))
    assert_same_tokens(batch, hf_generate(reference, ids, mask, do_sample=False, **options), PAD)
    for i, row in enumerate(rows):
        alone = np.asarray(gpt2_model.generate(row[None, :], **options))
        np.testing.assert_array_equal(batch[i, ids.shape[1]:], alone[0, len(row):])


@pytest.mark.parametrize("options", [dict(), dict(num_beams=3, num_return_sequences=2, length_penalty=0.5),
                                     dict(repetition_penalty=1.3, no_repeat_ngram_size=2, min_new_tokens=4)],
                         ids=["greedy", "beam", "processors"])
def test_xla_equals_eager(gpt2_model, eos, options):
    ids, mask = left_pad([random_ids((1, n), 64, seed=30 + n)[0] for n in (4, 8)], PAD)
    options = dict(max_new_tokens=9, eos_token_id=eos, pad_token_id=PAD, **options)
    eager = gpt2_model.generate(ids, attention_mask=mask, **options)
    xla_generate = tf.function(gpt2_model.generate, jit_compile=True)
    compiled = xla_generate(input_ids=tf.constant(ids), attention_mask=tf.constant(mask), **options)
    np.testing.assert_array_equal(compiled.numpy(), eager.numpy())


def test_scores_under_xla_match_eager_and_transformers(gpt2_checkpoint, gpt2_model, prompts):
    _, reference = gpt2_checkpoint
    options = dict(max_new_tokens=6, eos_token_id=None, pad_token_id=PAD, output_scores=True,
                   return_dict_in_generate=True, repetition_penalty=1.2)
    compiled = tf.function(gpt2_model.generate, jit_compile=True)(tf.constant(prompts), **options)
    eager = gpt2_model.generate(prompts, **options)
    theirs = hf_generate(reference, prompts, do_sample=False, **options)
    assert compiled.scores is not None and len(compiled.scores) == 6
    for ours_xla, ours_eager, reference_step in zip(compiled.scores, eager.scores, theirs.scores):
        np.testing.assert_allclose(ours_xla.numpy(), ours_eager.numpy(), atol=1e-5)
        np.testing.assert_allclose(ours_eager.numpy(), reference_step.numpy(), atol=1e-4)
    assert_same_tokens(compiled.sequences, theirs.sequences.numpy(), PAD)


@pytest.mark.parametrize("options", [{}, dict(do_sample=True, temperature=0.7, top_k=8, seed=[1, 2])],
                         ids=["greedy", "sample"])
def test_logprobs_are_the_chosen_tokens_share_of_the_scores(gpt2_model, prompts, eos, options):
    """`output_logprobs` keeps what `output_scores` would give of the chosen tokens (0 after EOS), eagerly and
    under XLA, and the log-softmax of the full forward's logits after the first prompt token."""
    options = {**dict(max_new_tokens=10, eos_token_id=eos, pad_token_id=PAD, output_scores=True, output_logprobs=True,
                      return_dict_in_generate=True, do_sample=False), **options}
    eager = gpt2_model.generate(prompts, **options)
    compiled = tf.function(gpt2_model.generate, jit_compile=True)(tf.constant(prompts), **options)
    new = eager.sequences.numpy()[:, prompts.shape[1]:]
    scores = tf.nn.log_softmax(tf.stack(eager.scores, axis=1)).numpy()  # [B, N, V]
    chosen = np.take_along_axis(scores, new[..., None], axis=2)[..., 0]
    ended = np.cumsum(new == eos, axis=1) - (new == eos) > 0
    assert options["do_sample"] or ended.any(), "the greedy case should exercise EOS"
    np.testing.assert_allclose(eager.logprobs.numpy(), np.where(ended, 0.0, chosen), atol=1e-5)
    np.testing.assert_allclose(compiled.logprobs.numpy(), eager.logprobs.numpy(), atol=1e-5)
    full = tf.nn.log_softmax(gpt2_model(prompts).logits[:, 0]).numpy()
    np.testing.assert_allclose(eager.first_logprobs.numpy(), full, atol=1e-5)
    np.testing.assert_allclose(compiled.first_logprobs.numpy(), full, atol=1e-5)
    np.testing.assert_array_equal(compiled.sequences.numpy(), eager.sequences.numpy())
    without = gpt2_model.generate(prompts, **{**options, "output_logprobs": False})
    np.testing.assert_array_equal(without.sequences.numpy(), eager.sequences.numpy())
    assert without.logprobs is None and without.first_logprobs is None


def test_beam_logprobs_follow_the_returned_beams(gpt2_model, prompts):
    """Without processors that mask tokens, the processed scores are log-probabilities: a returned beam's token
    log-probabilities sum to its score times its length (length_penalty 1), eagerly and under XLA."""
    options = dict(max_new_tokens=8, pad_token_id=PAD, num_beams=3, num_return_sequences=2,
                   return_dict_in_generate=True, output_scores=True, output_logprobs=True)
    eos = int(gpt2_model.generate(prompts, eos_token_id=None, **options).sequences[2, prompts.shape[1] + 1])
    ours = gpt2_model.generate(prompts, eos_token_id=eos, **options)
    compiled = tf.function(gpt2_model.generate, jit_compile=True)(tf.constant(prompts), eos_token_id=eos, **options)
    new = ours.sequences.numpy()[:, prompts.shape[1]:]
    ended = np.cumsum(new == eos, axis=1) - (new == eos) > 0
    assert ended.any() and (~ended).all(axis=1).any(), "the test should exercise EOS and the length limit"
    lengths = (~ended).sum(axis=1)
    logprobs = ours.logprobs.numpy()
    assert (logprobs[ended] == 0).all() and (logprobs[~ended] < 0).all()
    np.testing.assert_allclose(logprobs.sum(axis=1) / lengths, ours.sequences_scores.numpy(), atol=1e-5)
    np.testing.assert_allclose(compiled.logprobs.numpy(), logprobs, atol=1e-5)
    full = tf.nn.log_softmax(gpt2_model(prompts).logits[:, 0]).numpy()
    np.testing.assert_allclose(ours.first_logprobs.numpy(), np.repeat(full, 2, axis=0), atol=1e-5)


def test_beam_sequence_scores_match_transformers(gpt2_checkpoint, gpt2_model, prompts, eos):
    _, reference = gpt2_checkpoint
    options = dict(max_new_tokens=8, eos_token_id=eos, pad_token_id=PAD, num_beams=3, num_return_sequences=2,
                   output_scores=True, return_dict_in_generate=True)
    ours = gpt2_model.generate(prompts, **options)
    theirs = hf_generate(reference, prompts, do_sample=False, **options)
    assert_same_tokens(ours.sequences, theirs.sequences.numpy(), PAD)
    np.testing.assert_allclose(ours.sequences_scores.numpy(), theirs.sequences_scores.numpy(), atol=1e-4)
    np.testing.assert_allclose(ours.scores[0].numpy(), theirs.scores[0].numpy(), atol=1e-4)
