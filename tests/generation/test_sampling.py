"""Sampling: reproducible for a seed, statistically right, and equal to greedy when it must be."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from conftest import random_ids

PAD = 1


def test_top_k_one_equals_greedy(gpt2_model):
    ids = random_ids((2, 5), 64, seed=40)
    greedy = gpt2_model.generate(ids, max_new_tokens=8, pad_token_id=PAD)
    sampled = gpt2_model.generate(ids, max_new_tokens=8, pad_token_id=PAD, do_sample=True, top_k=1, seed=[1, 2])
    np.testing.assert_array_equal(sampled.numpy(), greedy.numpy())


def test_seed_reproducible_eager_and_xla(gpt2_model):
    ids = tf.constant(random_ids((2, 5), 64, seed=41))
    options = dict(max_new_tokens=8, pad_token_id=PAD, do_sample=True, temperature=1.5, top_p=0.9)
    first = gpt2_model.generate(ids, seed=[3, 4], **options).numpy()
    second = gpt2_model.generate(ids, seed=[3, 4], **options).numpy()
    other = gpt2_model.generate(ids, seed=[5, 6], **options).numpy()
    np.testing.assert_array_equal(first, second)
    assert (first != other).any()
    compiled = tf.function(gpt2_model.generate, jit_compile=True)
    np.testing.assert_array_equal(compiled(ids, seed=tf.constant([3, 4]), **options).numpy(), first)


def _first_step_probs(model, ids, temperature=1.0):
    logits = model(ids).logits.numpy()[0, -1] / temperature
    probs = np.exp(logits - logits.max())
    return probs / probs.sum()


def _first_step_frequencies(model, ids, rows=4000, **options):
    batch = np.repeat(ids, rows, axis=0)
    out = model.generate(batch, max_new_tokens=1, do_sample=True, eos_token_id=None, seed=[7, 8], **options)
    tokens = out.numpy()[:, -1]
    return np.bincount(tokens, minlength=model.config.vocab_size) / rows


def _spread_temperature(model, ids):
    """A temperature at which several tokens are likely and a few dominate (the tiny model is flat)."""
    for value in (0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1):
        probs = _first_step_probs(model, ids, value)
        if (probs > 0.02).sum() >= 4 and probs.max() < 0.6:
            return value
    raise AssertionError("no temperature spreads the distribution")


def test_frequencies_match_softmax(gpt2_model):
    ids = random_ids((1, 4), 64, seed=42)
    temperature = _spread_temperature(gpt2_model, ids)
    expected = _first_step_probs(gpt2_model, ids, temperature)
    rows = 4000
    observed = _first_step_frequencies(gpt2_model, ids, rows=rows, temperature=temperature, top_k=0)
    # Each likely token, and all the others as one bucket, within 4 standard errors of softmax.
    likely = expected > 0.02
    buckets_expected = np.append(expected[likely], expected[~likely].sum())
    buckets_observed = np.append(observed[likely], observed[~likely].sum())
    tolerance = 4 * np.sqrt(buckets_expected * (1 - buckets_expected) / rows)
    assert (np.abs(buckets_observed - buckets_expected) <= tolerance).all(), (buckets_observed, buckets_expected)


@pytest.mark.parametrize("options", [dict(top_k=3), dict(top_p=0.5)], ids=["top_k", "top_p"])
def test_filtered_tokens_are_never_drawn(gpt2_model, options):
    ids = random_ids((1, 4), 64, seed=42)
    temperature = _spread_temperature(gpt2_model, ids)
    probs = _first_step_probs(gpt2_model, ids, temperature)
    order = np.argsort(-probs)
    if "top_k" in options:
        allowed = set(order[:options["top_k"]])
    else:  # the smallest prefix holding >= top_p of the mass
        mass_before = np.cumsum(probs[order]) - probs[order]
        allowed = set(order[mass_before < options["top_p"]])
    observed = _first_step_frequencies(gpt2_model, ids, rows=1000, temperature=temperature, **options)
    assert set(np.nonzero(observed)[0]) <= allowed
    assert len(set(np.nonzero(observed)[0])) >= min(2, len(allowed))


def test_num_return_sequences_with_sampling(gpt2_model):
    ids = random_ids((2, 4), 64, seed=43)
    out = gpt2_model.generate(ids, max_new_tokens=6, do_sample=True, num_return_sequences=3, seed=[1, 1],
                              pad_token_id=PAD).numpy()
    assert out.shape == (6, 10)
    np.testing.assert_array_equal(out[:3, :4], np.repeat(ids[:1], 3, axis=0))
