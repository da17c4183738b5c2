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
