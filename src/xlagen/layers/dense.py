"""The projection layer of the transformer blocks."""

from __future__ import annotations

import keras
from keras import ops


class Dense(keras.layers.Dense):
    """`keras.layers.Dense` with the bias subtracted negated: `x @ W - (-b)`, bit for bit `x @ W + b`.

    Why: XLA's CPU backend fuses an add that follows a one-row matrix product (a batch-1 decoding step)
    into the product, and emits the fused product as a single-threaded loop; a subtraction is not
    fused, so the product runs on the thread pool. GPT-2-small's 12 layers of decode-step products:
    13.6 -> 11.7 ms (`benchmarks/dot_forms.py`). Weights, names and serialization are Keras' Dense.
    """

    def call(self, inputs, training=None):
        x = ops.matmul(inputs, self.kernel)
        if self.bias is not None:
            x = ops.subtract(x, ops.negative(self.bias))
        if self.activation is not None:
            x = self.activation(x)
        return x
