"""Normalisation layers shared by the models."""

from __future__ import annotations

import keras
from keras import ops

from xlagen import native


class LayerNorm(keras.layers.LayerNormalization):
    """`keras.layers.LayerNormalization` over the last axis whose generation's long prompts run as xlagen's
    native kernel (`xlagen.native.use_layer_norm`). Weights, names and serialization are Keras'."""

    def call(self, inputs):
        if self.axis in (-1, [-1]) and not self.rms_scaling:
            x = ops.convert_to_tensor(inputs)
            given = [None if t is None else ops.convert_to_tensor(t) for t in (self.gamma, self.beta)]
            if native.use_layer_norm(x, *given):
                return ops.cast(native.layer_norm(x, *given, self.epsilon), self.compute_dtype)
        return super().call(inputs)


class RMSNorm(keras.layers.RMSNormalization):
    """`keras.layers.RMSNormalization` over the last axis whose generation's long prompts run as xlagen's
    native kernel (`xlagen.native.use_layer_norm`). Weights, names and serialization are Keras'."""

    def call(self, x):
        if self.axis in (-1, [-1]):
            x = ops.convert_to_tensor(x)
            scale = ops.convert_to_tensor(self.scale)
            if native.use_layer_norm(x, scale, None):
                return ops.cast(native.rms_norm(x, scale, self.epsilon), self.compute_dtype)
        return super().call(x)


def layer_norm(epsilon: float, name: str, dtype=None, affine: bool = True) -> keras.layers.LayerNormalization:
    """A LayerNorm over the last axis, as in GPT-2 / OPT / Whisper.

    Args:
        epsilon: Added to the variance.
        name: Layer name (the variable path prefix).
        dtype: Keras dtype policy.
        affine: With a learned scale (`gamma`) and bias (`beta`); False is PyTorch's
            `elementwise_affine=False` (OPT's `layer_norm_elementwise_affine`).
    """
    return LayerNorm(epsilon=epsilon, center=affine, scale=affine, name=name, dtype=dtype)


def rms_norm(epsilon: float, name: str, dtype=None) -> keras.layers.RMSNormalization:
    """T5's "LayerNorm": `x / sqrt(mean(x^2) + epsilon) * scale`, no mean, no bias (Zhang & Sennrich 2019).

    Keras computes it in float32 for half-precision inputs, as transformers' T5LayerNorm does; a generation's
    long prompts run it as xlagen's native kernel (`RMSNorm`).

    Args:
        epsilon: Added to the mean square.
        name: Layer name (the variable path prefix; the weight is `scale`).
        dtype: Keras dtype policy.
    """
    return RMSNorm(epsilon=epsilon, name=name, dtype=dtype)
