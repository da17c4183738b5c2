"""Shared layers that re-write a Keras layer's arithmetic compute what the Keras layer computes."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from xlagen.layers.dense import Dense


def test_dense_equals_keras_dense():
    # Eagerly both run the same matrix product, so `x @ W - (-b)` and `x @ W + b` are identical. (Under
    # XLA they need not be: Keras' form becomes a fused product, ours a plain one, and the two products
    # sum in different orders; keeping XLA from fusing is the point of xlagen's Dense.)
    x = np.random.RandomState(4).normal(size=(1, 1, 24)).astype(np.float32)
    ours, theirs = Dense(40), keras.layers.Dense(40)
    ours.build(x.shape)
    theirs.build(x.shape)
    for mine, other in zip(ours.weights, theirs.weights):
        value = np.random.RandomState(len(mine.shape)).normal(size=mine.shape).astype(np.float32)
        mine.assign(value)
        other.assign(value)
    np.testing.assert_array_equal(ours(x).numpy(), theirs(x).numpy())
    compiled = tf.function(ours, jit_compile=True)(x).numpy()
    np.testing.assert_allclose(compiled, theirs(x).numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", [None, "relu"])
def test_dense_adds_a_residual_after_its_activation(activation):
    # `Dense(x, residual=r)` is activation(x @ W + b) + r, the same float32 adds as the separate add after it,
    # eagerly and compiled (where the product is XLA's dot outside a generation's prompt pass).
    rng = np.random.RandomState(5)
    x = rng.normal(size=(2, 3, 24)).astype(np.float32)
    residual = rng.normal(size=(2, 3, 40)).astype(np.float32)
    dense = Dense(40, activation=activation)
    dense.build(x.shape)
    for call in (dense, tf.function(lambda x, residual: dense(x, residual=residual), jit_compile=True)):
        summed = call(x, residual=residual) if call is dense else call(x, residual)
        plain = dense(x) if call is dense else tf.function(dense, jit_compile=True)(x)
        np.testing.assert_array_equal(summed.numpy(), plain.numpy() + residual)


@pytest.mark.parametrize("training", [False, True])
def test_a_block_drops_out_its_sublayers_outputs_not_their_sums_with_the_residual(training):
    # The sub-layers add the residual themselves (their output projections' epilogue) except where residual
    # dropout runs, in training: then only their outputs are dropped, the residual input never is; and except
    # in a decoding step.
    from xlagen.layers.block import BlockSpec, TransformerBlock

    spec = BlockSpec(16, 2, 8, 32, "gelu_new", 8 ** -0.5, 1e-5, residual_dropout=0.5)
    block = TransformerBlock(spec)
    x = np.random.RandomState(6).normal(size=(1, 4, 16)).astype(np.float32) * 100
    block.build(x.shape)
    out = block(x, None, training=training)[0].numpy()
    assert block._fuses_residual(training) == (not training)
    from xlagen import native
    with native.decoding_step():  # a step's products of a few rows have no epilogue: the block adds
        assert not block._fuses_residual(training)
    # The updates are small beside x (weights ~0.02-0.05, x ~100): x passes through either way, undropped.
    np.testing.assert_allclose(out, x, rtol=0.05, atol=5)
    deterministic = block(x, None, training=training)[0].numpy()
    assert np.array_equal(out, deterministic) == (not training)


@pytest.mark.parametrize("family", ["gpt2", "opt-post-norm", "mistral"])
def test_a_prompts_last_block_on_the_last_row_only_gives_the_same_logits_and_cache(tmp_path, family):
    # `call_with_cache(..., last_only=True)` (a generation's prompt pass) runs the last block past its keys
    # and values on the last token's row only: the last row's logits and the whole cache are those of the
    # full pass; left padding, a post-norm stack (OPT-350m's), grouped queries with a sliding window
    # (Mistral's), compiled and eager.
    from conftest import random_ids, save_tiny_gpt2, tiny_family_model
    from xlagen import TFAutoModelForCausalLM

    if family == "gpt2":
        save_tiny_gpt2(tmp_path)
        model = TFAutoModelForCausalLM.from_pretrained(tmp_path)
    elif family == "mistral":
        model, _ = tiny_family_model(tmp_path, "mistral")
    else:
        from models.test_opt import VARIANTS, save_tiny_opt

        save_tiny_opt(tmp_path, **VARIANTS["post_norm"])
        model = TFAutoModelForCausalLM.from_pretrained(tmp_path)
    ids = tf.constant(random_ids((2, 9), 50, seed=3))
    mask = np.zeros((2, 16), np.int32)
    mask[0, :9], mask[1, 3:9] = 1, 1

    def prompt(last_only):
        cache = model.init_cache(2, 16)
        return model.call_with_cache(ids, cache, tf.constant(0), tf.constant(mask), last_only=last_only)

    for run in (prompt, tf.function(prompt, jit_compile=True)):
        (full, full_cache), (last, last_cache) = run(False), run(True)
        assert last.shape == (2, 1, full.shape[-1])
        np.testing.assert_allclose(last.numpy(), full.numpy()[:, -1:], rtol=1e-5, atol=1e-5)
        for a, b in zip(tf.nest.flatten(full_cache), tf.nest.flatten(last_cache)):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
