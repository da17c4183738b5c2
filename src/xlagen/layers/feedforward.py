"""Position-wise feed-forward blocks and the activation functions checkpoints name."""

from __future__ import annotations

import math

import keras
from keras import ops


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
    """`output(act(input(x)))`: the two-matrix MLP of GPT-2 and OPT.

    Args:
        hidden_size: Model width.
        intermediate_size: Inner width.
        activation: An HF activation name, e.g. "gelu_new".
        use_bias: Whether both projections have biases.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, use_bias: bool = True,
                 **kwargs):
        super().__init__(**kwargs)
        self.activation = get_activation(activation)
        self.input_projection = keras.layers.Dense(intermediate_size, use_bias=use_bias, name="input_projection",
                                                   dtype=self.dtype_policy)
        self.output_projection = keras.layers.Dense(hidden_size, use_bias=use_bias, name="output_projection",
                                                    dtype=self.dtype_policy)
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size

    def build(self, input_shape):
        self.input_projection.build((None, self.hidden_size))
        self.output_projection.build((None, self.intermediate_size))
        self.built = True

    def call(self, x):
        """x: `[B, T, hidden]` -> `[B, T, hidden]`."""
        return self.output_projection(self.activation(self.input_projection(x)))
