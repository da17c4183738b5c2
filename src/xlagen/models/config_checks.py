"""Checks of the values a model config takes from config.json: type and range, naming the key.

A config.json is untrusted input: a string, a list, `null`, `true` or `1e10` where a size belongs must be a
`ValueError` that names the key and the expected type, not a `TypeError` or `ZeroDivisionError` deep in the
model. Each family declares the kind of each field once (`KINDS`) and calls `from_hf` in `from_hf_config`
(messages name the config.json keys) and `check_fields` in `__post_init__` (messages name the fields).
"""

from __future__ import annotations

import math
import re
import reprlib
from collections.abc import Callable, Mapping
from typing import Any

Kind = Callable[[str, Any], None]


def _short(value: Any) -> str:
    """A bounded repr: a deeply nested or long value shows as its start."""
    short = reprlib.Repr()
    short.maxlevel, short.maxlist, short.maxdict, short.maxstring, short.maxother = 2, 4, 4, 40, 40
    return short.repr(value)


def _fail(name: str, expected: str, value: Any) -> ValueError:
    return ValueError(f"{name} must be {expected}, got {_short(value)} ({type(value).__name__})")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def size(name: str, value: Any) -> None:
    """A positive integer (a width, a count of layers or heads)."""
    if not _is_int(value) or value < 1:
        raise _fail(name, "a positive integer", value)


def optional_size(name: str, value: Any) -> None:
    """A positive integer, or null."""
    if value is not None:
        size(name, value)


def positive(name: str, value: Any) -> None:
    """A finite number > 0 (a scale, a base)."""
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise _fail(name, "a finite number > 0", value)


def optional_positive(name: str, value: Any) -> None:
    """A finite number > 0, or null."""
    if value is not None:
        positive(name, value)


def epsilon(name: str, value: Any) -> None:
    """A finite number > 0 (a norm's epsilon)."""
    positive(name, value)


def rate(name: str, value: Any) -> None:
    """A probability in [0, 1] (a dropout rate)."""
    if not _is_number(value) or not 0 <= value <= 1:
        raise _fail(name, "a number in [0, 1]", value)


def boolean(name: str, value: Any) -> None:
    """true or false."""
    if not isinstance(value, bool):
        raise _fail(name, "true or false", value)


def string(name: str, value: Any) -> None:
    """A string."""
    if not isinstance(value, str):
        raise _fail(name, "a string", value)


def token_id(name: str, value: Any) -> None:
    """A non-negative integer id, or null."""
    if value is not None and (not _is_int(value) or value < 0):
        raise _fail(name, "a non-negative integer token id or null", value)


def token_ids(name: str, value: Any) -> None:
    """A token id, a list of token ids, or null (`eos_token_id`)."""
    if isinstance(value, list):
        if not value or not all(_is_int(v) and v >= 0 for v in value):
            raise _fail(name, "a non-negative integer token id, a non-empty list of them, or null", value)
    else:
        token_id(name, value)


def _unchecked(name: str, value: Any) -> None:
    """A field checked only by its config's `__post_init__`."""


def check_fields(config: Any, kinds: Mapping[str, Kind]) -> None:
    """Checks the fields of a config dataclass (in `__post_init__`).

    Raises:
        ValueError: naming the first field of the wrong type or out of range.
    """
    for name, kind in kinds.items():
        kind(name, getattr(config, name))


def from_hf(cls: type, hf: Mapping[str, Any], names: Mapping[str, str], kinds: Mapping[str, Kind],
            **extra: Any) -> Any:
    """Builds a config dataclass from config.json values, checked with config.json's key names.

    Args:
        cls: The config dataclass; its `__post_init__` checks how fields combine.
        hf: The config.json dict.
        names: config.json key -> field name.
        kinds: Field name -> kind of value.
        **extra: Further fields, already checked by the caller.

    Returns:
        The config.

    Raises:
        ValueError: "config.json: KEY must be EXPECTED, got VALUE (TYPE)", or a combination of values
            `__post_init__` refuses, with the fields spelled as config.json keys.
    """
    values = {}
    for theirs, ours in names.items():
        if theirs in hf:
            try:
                kinds.get(ours, _unchecked)(theirs, hf[theirs])
            except ValueError as e:
                raise ValueError(f"config.json: {e}") from None
            values[ours] = hf[theirs]
    try:
        return cls(**values, **extra)
    except ValueError as e:
        spelled = {ours: theirs for theirs, ours in names.items() if theirs in hf}
        text = re.sub(r"\b\w+\b", lambda m: spelled.get(m.group(), m.group()), str(e))
        raise ValueError(f"config.json: {text}") from e
