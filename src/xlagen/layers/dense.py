"""The projection layer of the transformer blocks."""

from __future__ import annotations

import keras
from keras import ops

from xlagen import native


class Dense(keras.layers.Dense):
    """`keras.layers.Dense` with the bias subtracted negated: `x @ W - (-b)`, bit for bit `x @ W + b`.

    Why: XLA's CPU backend fuses an add that follows a one-row matrix product (a batch-1 decoding step)
    into the product, and emits the fused product as a single-threaded loop; a subtraction is not
    fused, so the product runs on the thread pool. GPT-2-small's 12 layers of decode-step products:
    13.6 -> 11.7 ms (`benchmarks/dot_forms.py`). Weights, names and serialization are Keras' Dense.

    Inside a compiled decoding loop, a float32 product of a few rows runs xlagen's native float32 kernel
    (`xlagen.native.use_float32_kernel`); elsewhere Keras' matmul. `pack_weights()` makes the layer
    multiply by its kernel rounded to bfloat16 or quantized to int8, read by xlagen's native kernel
    (`xlagen.native`): inference only, for float32 layers.
    """

    packed_kernel = None  # set by pack_weights: the kernel packed by xlagen.native.pack_tensor
    dropped_kernel_path = None  # set by load_packed: the path and shape the float32 kernel variable had
    dropped_kernel_shape = None

    def pack_weights(self, weight_dtype: str = "bfloat16"):
        """From now on multiply by the kernel rounded to bfloat16, or quantized to int8 with a scale per
        output column (`xlagen.native.matmul`).

        The float32 kernel stays as the layer's weight (saving writes it); the packed copy is a constant
        taken now, so later changes to the kernel are not seen. Not differentiable: inference only.
        """
        self.packed_kernel = packed_kernel_of(self, weight_dtype)

    def load_packed(self, kernel, weight_dtype: str) -> None:
        """Multiplies by `kernel` packed as `weight_dtype` (as `pack_weights`), and drops the layer's own float32
        kernel variable, which must never have been given a value (`xlagen.models.deferred`): a model loaded
        with `weight_dtype` holds only the packed kernels, a quarter (int8) or half (bfloat16) of float32's
        bytes.

        Args:
            kernel: float numpy `[in, units]`, e.g. a view of a checkpoint's transposed tensor.
            weight_dtype: "bfloat16" or "int8".
        """
        check_packable(self, weight_dtype)
        self.packed_kernel = native.pack_tensor(kernel, weight_dtype)
        dropped = self._kernel
        self.dropped_kernel_path, self.dropped_kernel_shape = dropped.path, tuple(dropped.shape)
        # As `del self._kernel` (Keras' own Dense.quantize drops its float kernel so), without the gc.collect()
        # Keras' Layer.__delattr__ runs for every variable deleted: seconds a layer in a process holding a model.
        self._untrack_variable(dropped)
        super(keras.layers.Layer, self).__delattr__("_kernel")

    def call(self, inputs, training=None, residual=None):
        """`activation(inputs @ kernel + bias)`, plus `residual` (`[..., units]`, a residual connection's input,
        or None) if given: the many-row products add it as they store their output, with a linear activation
        (`xlagen.native.matmul`), else it is added after; the same float32 add either way."""
        # The native products take the residual (and add it, by their epilogue or after) where nothing comes
        # between the product and the sum.
        native_residual = residual if self.activation in (None, keras.activations.linear) else None
        if self.packed_kernel is not None:  # the bias in the call: the many-row products add it themselves
            x = native.matmul(inputs, self.packed_kernel, self.units, bias=self.bias, residual=native_residual)
        elif native.use_float32_kernel(inputs, self.kernel):  # the many-row product adds the bias itself
            x = native.matmul_float32(inputs, self.kernel, bias=self.bias, residual=native_residual)
        else:
            native_residual = None
            x = ops.matmul(inputs, self.kernel)
            if self.bias is not None:
                x = ops.subtract(x, ops.negative(self.bias))
        if self.activation is not None:
            x = self.activation(x)
        return x if residual is None or native_residual is not None else ops.add(x, residual)


def packed_kernel_of(layer, weight_dtype: str, kernel=None):
    """A built float32 layer's `kernel` (or the float numpy `kernel` given for it) packed as `weight_dtype`
    ("bfloat16" or "int8") for `xlagen.native.matmul`."""
    check_packable(layer, weight_dtype)
    return native.pack_tensor(layer.kernel if kernel is None else kernel, weight_dtype)


def check_packable(layer, weight_dtype: str) -> None:
    """Refuses to pack the weights of a layer not built, or not float32.

    Raises:
        ValueError: naming the layer (and its dtype policy).
    """
    if not layer.built:
        raise ValueError(f"{layer.name}: build the layer (load the model) before packing its weights")
    if layer.compute_dtype != "float32" or layer.variable_dtype != "float32":
        raise ValueError(f"{layer.name}: {weight_dtype} weights need a float32 model (dtype policy "
                         f"{layer.dtype_policy.name!r})")
