"""Packed weight layouts: bfloat16 and int8 weights in the panels the native products read, and back."""

from __future__ import annotations

import numpy as np

from xlagen.buffers import aligned_empty, as_tensor
from xlagen.native.library import constant, load

WEIGHT_DTYPES = ("bfloat16", "int8")  # what `pack_tensor` packs


# Columns packed per step: a step's float32 temporaries are about this many columns of the kernel, so packing
# a large kernel (a 128256-word head) never holds a second copy of it.
_COLUMNS_PER_STEP = 2048


def pack_bfloat16(kernel: np.ndarray) -> np.ndarray:
    """A float `[K, N]` kernel -> the kernel's packed bfloat16 words, int32 `[ceil(N / 32), K, 16]`.

    Each weight is rounded to the nearest bfloat16 (ties to even). Word `[p, k, j]` holds column `32p + j`
    in its low half and column `32p + 16 + j` in its high half; columns past N are zero. `kernel` may be
    any float array or view (e.g. the transpose of a checkpoint's `[N, K]` tensor); it is read a few
    panels at a time.
    """
    import ml_dtypes

    k, n = kernel.shape
    panel = constant("panel")
    panels = -(-n // panel)
    out = aligned_empty((panels, k, panel // 2), np.uint32)
    step = max(1, _COLUMNS_PER_STEP // panel)
    for first in range(0, panels, step):
        last = min(panels, first + step)
        padded = np.zeros((k, (last - first) * panel), np.float32)
        columns = kernel[:, first * panel:last * panel]
        padded[:, :columns.shape[1]] = columns
        bits = padded.astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32).reshape(k, last - first, panel)
        words = bits[:, :, :panel // 2] | (bits[:, :, panel // 2:] << 16)
        out[first:last] = words.transpose(1, 0, 2)
    return out.view(np.int32)


def pack_int8(kernel: np.ndarray) -> np.ndarray:
    """A float `[K, N]` kernel -> int8 `[ceil(N / 64), K + 4, 64]`: each column quantized with its own scale.

    Column n's scale is s = max |W[:, n]| / 127 and its weights are round(W[k, n] / s) (ties to even), in
    -127..127, so the kernel multiplies by `Q * s` (`unpack`), whose error is at most s / 2 per weight.
    Panel p holds rows 0..K-1 of columns 64p..64p+63 (64 bytes per row), then those 64 columns' float32
    scales as 256 bytes (4 more rows); columns past N are zero, with scale zero. `kernel` may be any float
    array or view; it is read a few panels at a time.
    """
    k, n = kernel.shape
    panel = constant("int8_panel")
    panels = -(-n // panel)
    out = aligned_empty((panels, k + 4, panel), np.int8)
    step = max(1, _COLUMNS_PER_STEP // panel)
    for first in range(0, panels, step):
        last = min(panels, first + step)
        columns = np.asarray(kernel[:, first * panel:last * panel], np.float32)
        width = columns.shape[1]
        peak = np.abs(columns).max(axis=0) if k else np.zeros(width, np.float32)
        scales = np.zeros((last - first) * panel, np.float32)
        scales[:width] = peak / 127
        quantized = np.zeros((k, (last - first) * panel), np.int8)
        safe = np.where(scales[:width] > 0, scales[:width], 1)
        quantized[:, :width] = np.clip(np.rint(columns / safe), -127, 127).astype(np.int8)
        out[first:last, :k] = quantized.reshape(k, last - first, panel).transpose(1, 0, 2)
        out[first:last, k:] = scales.view(np.int8).reshape(last - first, 4, panel)
    return out


def pack_tensor(kernel, weight_dtype: str = "bfloat16"):
    """`pack_bfloat16` or `pack_int8` of a variable or tensor, as a TensorFlow constant (loads the kernel
    library first, so that a machine that cannot run it fails here, with the reason, rather than at compile
    time)."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"packed weights are one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
    load()
    pack = pack_bfloat16 if weight_dtype == "bfloat16" else pack_int8
    return as_tensor(pack(kernel.numpy() if hasattr(kernel, "numpy") else kernel))  # adopted: no second copy


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
