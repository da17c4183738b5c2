"""Normalisation layers shared by the models."""

from __future__ import annotations

import keras


def layer_norm(epsilon: float, name: str, dtype=None, affine: bool = True) -> keras.layers.LayerNormalization:
    """A LayerNorm over the last axis, as in GPT-2 / OPT / Whisper.

    Args:
        epsilon: Added to the variance.
        name: Layer name (the variable path prefix).
        dtype: Keras dtype policy.
        affine: With a learned scale (`gamma`) and bias (`beta`); False is PyTorch's
            `elementwise_affine=False` (OPT's `layer_norm_elementwise_affine`).
    """
    return keras.layers.LayerNormalization(epsilon=epsilon, center=affine, scale=affine, name=name, dtype=dtype)


def rms_norm(epsilon: float, name: str, dtype=None) -> keras.layers.RMSNormalization:
    """T5's "LayerNorm": `x / sqrt(mean(x^2) + epsilon) * scale`, no mean, no bias (Zhang & Sennrich 2019).

    Keras computes it in float32 for half-precision inputs, as transformers' T5LayerNorm does.

    Args:
        epsilon: Added to the mean square.
        name: Layer name (the variable path prefix; the weight is `scale`).
        dtype: Keras dtype policy.
    """
    return keras.layers.RMSNormalization(epsilon=epsilon, name=name, dtype=dtype)
