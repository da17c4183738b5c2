"""Token and position embeddings."""

from __future__ import annotations

import keras
from keras import ops


class TokenEmbedding(keras.layers.Embedding):
    """A token embedding that can also act as the tied output projection (`attend`)."""

    def attend(self, hidden):
        """hidden `[B, T, hidden]` -> logits `[B, T, V]` using the embedding matrix transposed."""
        return ops.matmul(hidden, ops.transpose(ops.cast(self.embeddings, hidden.dtype)))


class PositionEmbedding(keras.layers.Embedding):
    """Learned absolute positions, looked up by explicit position ids (left padding moves them)."""
