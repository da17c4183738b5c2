"""Building a model whose variables take their values from a checkpoint without holding any other values first.

A Keras model built as usual fills every variable from its initializer, and a random initializer leaves
about three times the variable's bytes resident (its temporaries stay in the allocator's free lists): for a
checkpoint's weights that is memory and time spent on values that are overwritten at once. `build` builds the
model inside a `keras.StatelessScope` that defers every variable (a variable then has a shape and no value,
as Keras does for the JAX backend), and `Deferred.initialize` gives each variable its checkpoint value as
its first and only one. A 64-byte-aligned numpy array (`xlagen.buffers`) becomes the variable's buffer
without a copy (through DLPack).

Keras has no public call for initializing one deferred variable; `Deferred` uses its variables' own
`_deferred_initialize`, the method `keras.StatelessScope` calls on exit.
"""

from __future__ import annotations

from collections.abc import Callable

import keras
import numpy as np
from keras.src.backend.common import global_state

from xlagen.buffers import adoptable, aligned_empty, as_tensor

_PENDING = "uninitialized_variables"  # Keras' list of the deferred variables the next scope exit initializes


def build(factory: Callable[[], keras.Model]) -> tuple[keras.Model, Deferred]:
    """Calls `factory` with every variable it creates deferred (no value, no memory).

    Returns:
        The model, and its `Deferred` variables: give each a value (`initialize`) or drop it (`drop`), then
        call `finish`.
    """
    before = list(global_state.get_global_attribute(_PENDING) or [])
    with keras.StatelessScope(initialize_variables=False):
        model = factory()
    created = (global_state.get_global_attribute(_PENDING) or [])[len(before):]
    # Ours to initialize: left in Keras' list, the next scope's exit would initialize them with random values.
    global_state.set_global_attribute(_PENDING, before)
    return model, Deferred(created)


class Deferred:
    """The deferred variables of a model made by `build`."""

    def __init__(self, variables):
        self._pending = {id(v): v for v in variables}

    def initialize(self, variable, value: np.ndarray) -> np.ndarray:
        """Gives `variable` its value: `value` cast to the variable's dtype, adopted as its buffer where it
        is a 64-byte-aligned C-contiguous array of that dtype (a copy is made otherwise). The caller must not
        change `value` afterwards.

        Returns:
            The array the variable holds: `value` or its copy (sharing the variable's memory where it was
            adopted). Read it only, and only until the variable is assigned.
        """
        del self._pending[id(variable)]
        dtype = np.dtype(variable.dtype)
        if not (value.dtype == dtype and adoptable(value)):
            aligned = aligned_empty(value.shape, dtype)
            np.copyto(aligned, value, casting="unsafe")
            value = aligned
        tensor = as_tensor(value)
        variable._initializer = lambda shape, dtype: tensor
        variable._deferred_initialize()
        return value

    def drop(self, variable) -> None:
        """Leaves `variable` without a value (its layer no longer uses it: `Dense.load_packed`)."""
        del self._pending[id(variable)]

    def finish(self) -> None:
        """Initializes the variables no checkpoint tensor makes (metrics, random seeds) from their initializers."""
        for variable in self._pending.values():
            variable._deferred_initialize()
        self._pending = {}
