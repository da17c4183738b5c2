"""Token and position embeddings."""

from __future__ import annotations

import keras
from keras import ops

from xlagen import native
from xlagen.layers.dense import packed_kernel_of


class TokenEmbedding(keras.layers.Layer):
    """A token embedding that is also the tied output projection (`attend`), stored in the output
    projection's layout: `kernel` `[hidden, V]` (the checkpoint's `[V, hidden]` matrix transposed).

    Why not the checkpoint's layout: XLA's CPU dot reads a `[V, hidden]` matrix contracted on its
    minor axis through a slower path than a `[hidden, V]` one, and the head is the largest matrix a
    decoding step reads (GPT-2-small's head for 1 / 2 / 8 rows: 5.9 / 8.6 / 10.1 ms against
    4.7 / 3.7 / 5.7 ms, `benchmarks/dot_forms.py`). A lookup reads one column per token instead of one
    row, which costs nothing measurable.

    Args:
        input_dim: V, the vocabulary size.
        output_dim: The embedding width.
    """

    packed_kernel = None  # set by pack_weights: the kernel packed by xlagen.native.pack_tensor, for `attend`

    def __init__(self, input_dim: int, output_dim: int, **kwargs):
        super().__init__(**kwargs)
        self.input_dim = input_dim
        self.output_dim = output_dim

    def pack_weights(self, weight_dtype: str = "bfloat16", kernel=None):
        """From now on `attend` multiplies by the kernel rounded to bfloat16 or quantized to int8
        (`xlagen.native.matmul`). Lookups keep reading the float32 kernel. Inference only, as
        `Dense.pack_weights`.

        Args:
            weight_dtype: "bfloat16" or "int8".
            kernel: The kernel's value as a float numpy `[output_dim, V]`, when the caller holds it (a load):
                packed from there rather than from a copy of the variable.
        """
        self.packed_kernel = packed_kernel_of(self, weight_dtype, kernel)

    def build(self, input_shape=None):
        # keras.layers.Embedding's default initializer.
        self.kernel = self.add_weight(shape=(self.output_dim, self.input_dim), name="kernel",
                                      initializer=keras.initializers.RandomUniform(-0.05, 0.05))
        self.built = True

    def call(self, token_ids):
        """int token ids `[...]` -> embeddings `[..., output_dim]`. A generation's long prompt looks them up
        with the native lookup (`native.use_lookup`), which fetches the columns faster than XLA's gather."""
        ids, kernel = ops.cast(token_ids, "int32"), ops.convert_to_tensor(self.kernel)
        if native.use_lookup(kernel, ids):
            return ops.cast(native.lookup_columns(kernel, ids), self.compute_dtype)
        columns = ops.take(kernel, ids, axis=1)  # [output_dim, ...]
        return ops.cast(ops.moveaxis(columns, 0, -1), self.compute_dtype)

    def compute_output_shape(self, input_shape):
        return (*input_shape, self.output_dim)

    def attend(self, hidden):
        """hidden `[..., output_dim]` -> logits `[..., V]` (in a decoding loop, maybe the native float32 kernel:
        see `Dense`)."""
        if self.packed_kernel is not None:
            return native.matmul(hidden, self.packed_kernel, self.input_dim)
        if native.use_float32_kernel(hidden, self.kernel):
            return native.matmul_float32(hidden, self.kernel)
        return ops.matmul(hidden, ops.cast(self.kernel, hidden.dtype))

    def get_config(self):
        return {**super().get_config(), "input_dim": self.input_dim, "output_dim": self.output_dim}


class PositionEmbedding(keras.layers.Embedding):
    """Learned absolute positions, looked up by explicit position ids (left padding moves them)."""
