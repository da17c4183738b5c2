"""Numpy arrays that TensorFlow takes as tensors without copying them (numpy only; TensorFlow on demand).

TensorFlow copies a numpy array it is given (`tf.constant`, `tf.convert_to_tensor`), so a tensor made from
a freshly computed array briefly needs twice its bytes. Through DLPack it adopts the array's memory instead,
if that memory starts on a 64-byte boundary (its alignment on x86-64).
"""

from __future__ import annotations

import math

import numpy as np

ALIGNMENT = 64


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on a 64-byte boundary."""
    dtype = np.dtype(dtype)
    size = math.prod(shape) * dtype.itemsize
    buffer = np.empty(size + ALIGNMENT, np.uint8)
    start = -buffer.ctypes.data % ALIGNMENT
    return buffer[start:start + size].view(dtype).reshape(shape)


def adoptable(array: np.ndarray) -> bool:
    """Whether `as_tensor` can take `array`'s memory as it is: C-contiguous and 64-byte aligned."""
    return array.flags.c_contiguous and array.ctypes.data % ALIGNMENT == 0


def as_tensor(array: np.ndarray):
    """A TensorFlow tensor of `array`'s value: over `array`'s own memory where it is `adoptable` and of a
    dtype DLPack carries, a copy otherwise. Nothing may write to `array` afterwards."""
    import tensorflow as tf

    if array.size and adoptable(array):
        try:
            return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
        except (BufferError, TypeError, ValueError):  # a dtype DLPack does not carry (ml_dtypes' bfloat16)
            pass
    return tf.convert_to_tensor(array)
