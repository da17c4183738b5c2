"""Position-wise feed-forward blocks and the activation functions checkpoints name."""

from __future__ import annotations

import math

import keras
from keras import ops

from xlagen import native
from xlagen.layers.dense import Dense


def _gelu_tanh(x):
    # GPT-2's "gelu_new": the tanh approximation of GELU.
    return 0.5 * x * (1.0 + ops.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * ops.power(x, 3.0))))


def _gelu_fast(x):
    return 0.5 * x * (1.0 + ops.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


ACTIVATIONS = {
    "gelu": lambda x: ops.gelu(x, approximate=False),
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_fast": _gelu_fast,
    "quick_gelu": lambda x: x * ops.sigmoid(1.702 * x),
    "relu": ops.relu,
    "silu": ops.silu,
    "swish": ops.silu,
    "tanh": ops.tanh,
    "sigmoid": ops.sigmoid,
    "linear": lambda x: x,
}


def get_activation(name: str):
    """Returns the activation function a checkpoint names (HF spelling).

    Raises:
        ValueError: for a name xlagen does not implement.
    """
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation function {name!r}; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class FeedForward(keras.layers.Layer):
    """`output(act(input(x)))` (GPT-2, OPT, T5 v1.0), or gated `output(act(gate(x)) * input(x))` (T5 v1.1).

    Args:
        hidden_size: Model width.
        intermediate_size: Inner width.
        activation: An HF activation name, e.g. "gelu_new".
        use_bias: Whether the projections have biases.
        gated: Multiply the activated `gate_projection` with the linear `input_projection`.
        dropout: Dropout of the inner activations (training only).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, use_bias: bool = True,
                 gated: bool = False, dropout: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.activation = get_activation(activation)
        self.activation_name = activation
        self.input_projection = Dense(intermediate_size, use_bias=use_bias, name="input_projection",
                                      dtype=self.dtype_policy)
        self.gate_projection = None
        if gated:
            self.gate_projection = Dense(intermediate_size, use_bias=use_bias, name="gate_projection",
                                         dtype=self.dtype_policy)
        self.output_projection = Dense(hidden_size, use_bias=use_bias, name="output_projection",
                                       dtype=self.dtype_policy)
        self.dropout = keras.layers.Dropout(dropout)
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size

    def build(self, input_shape):
        self.input_projection.build((None, self.hidden_size))
        if self.gate_projection is not None:
            self.gate_projection.build((None, self.hidden_size))
        self.output_projection.build((None, self.intermediate_size))
        self.built = True

    def call(self, x, training=False, residual=None):
        """x: `[B, T, hidden]` -> `[B, T, hidden]`, plus `residual` `[B, T, hidden]` if given (the block's
        residual connection, which the output projection may add as it stores its output: `Dense.call`). With
        packed weights, or float32 ones on the native many-row product, a prompt's or an encoder's input
        projection may apply the activation as it stores its output (`xlagen.native.projection`)."""
        projection = self.input_projection
        if self.gate_projection is not None:
            inner = projection(x)
            inner = self.activation(self.gate_projection(x)) * inner
        else:
            inner = None
            kernel = projection.packed_kernel
            if kernel is None and native.use_float32_kernel(x, projection.kernel):
                kernel = projection.kernel
            if kernel is not None:
                inner = native.projection(x, kernel, projection.units, projection.bias, self.activation_name)
            if inner is None:
                inner = self.activation(projection(x))
        return self.output_projection(self.dropout(inner, training=training), residual=residual)
