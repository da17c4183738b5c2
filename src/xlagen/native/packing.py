"""Packed weight layouts: bfloat16 and int8 weights in the panels the native products read, and back."""

from __future__ import annotations

import numpy as np

from xlagen.native.library import constant, load

WEIGHT_DTYPES = ("bfloat16", "int8")  # what `pack_tensor` packs


def pack_bfloat16(kernel: np.ndarray) -> np.ndarray:
    """A float `[K, N]` kernel -> the kernel's packed bfloat16 words, int32 `[ceil(N / 32), K, 16]`.

    Each weight is rounded to the nearest bfloat16 (ties to even). Word `[p, k, j]` holds column `32p + j`
    in its low half and column `32p + 16 + j` in its high half; columns past N are zero.
    """
    import ml_dtypes

    k, n = kernel.shape
    panel = constant("panel")
    panels = -(-n // panel)
    padded = np.zeros((k, panels * panel), np.float32)
    padded[:, :n] = kernel
    bits = padded.astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32).reshape(k, panels, panel)
    words = bits[:, :, :panel // 2] | (bits[:, :, panel // 2:] << 16)
    return np.ascontiguousarray(words.transpose(1, 0, 2)).view(np.int32)


def pack_int8(kernel: np.ndarray) -> np.ndarray:
    """A float `[K, N]` kernel -> int8 `[ceil(N / 64), K + 4, 64]`: each column quantized with its own scale.

    Column n's scale is s = max |W[:, n]| / 127 and its weights are round(W[k, n] / s) (ties to even), in
    -127..127, so the kernel multiplies by `Q * s` (`unpack`), whose error is at most s / 2 per weight.
    Panel p holds rows 0..K-1 of columns 64p..64p+63 (64 bytes per row), then those 64 columns' float32
    scales as 256 bytes (4 more rows); columns past N are zero, with scale zero.
    """
    k, n = kernel.shape
    kernel = np.asarray(kernel, np.float32)
    panel = constant("int8_panel")
    panels = -(-n // panel)
    peak = np.abs(kernel).max(axis=0) if k else np.zeros(n, np.float32)
    scales = np.zeros(panels * panel, np.float32)
    scales[:n] = peak / 127
    quantized = np.zeros((k, panels * panel), np.int8)
    safe = np.where(scales[:n] > 0, scales[:n], 1)
    quantized[:, :n] = np.clip(np.rint(kernel / safe), -127, 127).astype(np.int8)
    weights = quantized.reshape(k, panels, panel).transpose(1, 0, 2)
    scale_rows = scales.view(np.int8).reshape(panels, 4, panel)
    return np.ascontiguousarray(np.concatenate([weights, scale_rows], axis=1))


def pack_tensor(kernel, weight_dtype: str = "bfloat16"):
    """`pack_bfloat16` or `pack_int8` of a variable or tensor, as a TensorFlow constant (loads the kernel
    library first, so that a machine that cannot run it fails here, with the reason, rather than at compile
    time)."""
    import tensorflow as tf

    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"packed weights are one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
    load()
    pack = pack_bfloat16 if weight_dtype == "bfloat16" else pack_int8
    return tf.constant(pack(np.asarray(kernel.numpy() if hasattr(kernel, "numpy") else kernel, np.float32)))


def unpack(words, n: int):
    """Packed weights -> the float32 kernel `[K, n]` they multiply by (TensorFlow ops): bfloat16 words
    `[P, K, 16]` exactly; int8 panels `[P, K + 4, 64]` as `Q * s`."""
    import tensorflow as tf

    if words.dtype == tf.int8:
        k = words.shape[1] - 4
        quantized = tf.cast(words[:, :k, :], tf.float32)  # [P, K, 64]
        scales = tf.bitcast(tf.reshape(words[:, k:, :], (-1, constant("int8_panel"), 4)), tf.float32)  # [P, 64]
        kernel = tf.transpose(quantized * scales[:, None, :], (1, 0, 2))
        return tf.reshape(kernel, (k, -1))[:, :n]
    low = tf.bitcast(tf.bitwise.left_shift(words, 16), tf.float32)
    high = tf.bitcast(tf.bitwise.bitwise_and(words, tf.constant(-65536, tf.int32)), tf.float32)  # 0xFFFF0000
    panels = tf.concat([low, high], axis=-1)  # [P, K, 32]
    k = tf.shape(words)[1]
    return tf.reshape(tf.transpose(panels, (1, 0, 2)), (k, -1))[:, :n]
