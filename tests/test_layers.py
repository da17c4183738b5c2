"""Shared layers that re-write a Keras layer's arithmetic compute what the Keras layer computes."""

from __future__ import annotations

import keras
import numpy as np
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
