"""Normalisation layers shared by the models."""

from __future__ import annotations

import keras


def layer_norm(epsilon: float, name: str, dtype=None) -> keras.layers.LayerNormalization:
    """A LayerNorm over the last axis with a scale and a bias, as in GPT-2 / OPT / Whisper."""
    return keras.layers.LayerNormalization(epsilon=epsilon, name=name, dtype=dtype)
