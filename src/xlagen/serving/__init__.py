"""Serving: a continuous-batching decode engine with slots, usable from Python (`Engine`).

Names are imported lazily (PEP 562), so `from xlagen.serving import RequestOptions` does not load TensorFlow.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "RequestOptions": "xlagen.serving.options",
    "Engine": "xlagen.serving.engine",
    "TokenEvent": "xlagen.serving.streams",
    "Completion": "xlagen.serving.streams",
    "QueueFull": "xlagen.serving.streams",
    "EngineClosed": "xlagen.serving.streams",
    "ContextTooLong": "xlagen.serving.streams",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'xlagen.serving' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
