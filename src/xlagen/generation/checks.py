"""Checks of `generate`'s inputs and sizes, made before anything is traced or allocated.

Values are checked whenever they are known: eager tensors, numpy arrays, Python lists, and constants
under a trace. Under a user's `tf.function(model.generate)` with tensor arguments only the dtypes and
static shapes are known, so there the token range, mask values and feature finiteness are not checked
(`CompiledGenerator` checks them: it sees the values before it calls its program).

Shapes: B batch, K beams, R returned sequences, P prompt, N new tokens, S = P + N, V vocab.
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf

INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
GB = 1024**3


def physical_memory_bytes() -> int | None:
    """The machine's physical memory (None where the OS does not tell)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def available_memory_bytes() -> int | None:
    """Memory this process could still take: the kernel's `MemAvailable`, or less under a cgroup limit (None where
    the OS does not tell)."""
    available = None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        return physical_memory_bytes()
    try:
        with open("/sys/fs/cgroup/memory.max") as limit_file, open("/sys/fs/cgroup/memory.current") as used_file:
            limit = limit_file.read().strip()
            if limit != "max":
                room = int(limit) - int(used_file.read())
                available = room if available is None else min(available, room)
    except (OSError, ValueError):
        pass
    return available


def _known(tensor: tf.Tensor) -> np.ndarray | None:
    """The tensor's value when it is known before running (eager, constant), else None."""
    return tf.get_static_value(tensor)


def as_int_tensor(name: str, value) -> tf.Tensor:
    """`value` (tensor, numpy array or nested lists) as an int32 `[B, T]` tensor, refusing what a cast would
    silently change.

    Raises:
        TypeError: for non-integer ids (floats, bools, strings).
        ValueError: for a shape that is not `[batch, length]` or ids outside int32.
    """
    if not tf.is_tensor(value):
        try:
            array = np.asarray(value)
        except ValueError as error:  # ragged nested lists
            raise ValueError(f"{name} must be a rectangular [batch, length] array of token ids: {error}") from error
        if array.size == 0 and array.dtype == np.float64:  # `[[]]` and `[]` come out as float64
            array = array.astype(np.int32)
        value = array
    tensor = tf.convert_to_tensor(value)
    if not tensor.dtype.is_integer:
        raise TypeError(f"{name} must hold integer token ids, got dtype {tensor.dtype.name}: convert the ids "
                        "with tokenizer(..., return_tensors='tf') or cast them to int32")
    if tensor.shape.rank != 2:
        raise ValueError(f"{name} must be [batch, length], got shape {tensor.shape}")
    values = _known(tensor)
    if values is not None and values.size and tensor.dtype != tf.int32:
        low, high = values.min(), values.max()
        if low < INT32_MIN or high > INT32_MAX:
            culprit = low if low < INT32_MIN else high
            raise ValueError(f"{name} holds {culprit}, outside the int32 range of token ids: pass real token ids")
    return tf.cast(tensor, tf.int32)


def as_mask_tensor(name: str, value) -> tf.Tensor:
    """An attention mask (int, bool or float) as int32, refusing values other than 0 and 1 when known.

    Raises:
        TypeError: for a mask that is not numeric.
        ValueError: for values other than 0 and 1.
    """
    tensor = tf.convert_to_tensor(np.asarray(value) if not tf.is_tensor(value) else value)
    if not (tensor.dtype.is_integer or tensor.dtype.is_floating or tensor.dtype.is_bool):
        raise TypeError(f"{name} must hold 0 and 1, got dtype {tensor.dtype.name}")
    values = _known(tensor)
    if values is not None:
        wrong = ~np.isin(values, (0, 1))
        if wrong.any():
            row, column = np.argwhere(wrong)[0][:2] if values.ndim >= 2 else (0, 0)
            raise ValueError(f"{name} must hold only 0 (padding) and 1 (real token), got "
                             f"{values[wrong].flat[0].item()!r} at row {row}, column {column}")
    return tf.cast(tensor, tf.int32)


def check_batch(name: str, tensor: tf.Tensor) -> None:
    """Refuses an empty batch (a static batch size of 0)."""
    if tensor.shape.rank and tensor.shape[0] == 0:
        raise ValueError(f"empty batch: {name} has 0 rows (shape {tensor.shape}); give at least one prompt")


def check_tokens(name: str, ids: tf.Tensor, mask_name: str, mask: tf.Tensor, vocab_size: int) -> None:
    """Refuses, when the values are known, a row of `mask` without a real token and real tokens (mask 1)
    outside `[0, vocab_size)`; padding positions may hold any id (they are never looked up).

    Raises:
        ValueError: naming the row (and the id).
    """
    mask_values = _known(mask)
    if mask_values is None:
        return
    empty = np.flatnonzero(~mask_values.any(axis=1))
    if empty.size:
        raise ValueError(f"{mask_name} row {empty[0]} is all zeros: every row of {name} needs at least one real "
                         "token (without an attention_mask, positions holding pad_token_id are masked)")
    id_values = _known(ids)
    if id_values is None:
        return
    wrong = mask_values.astype(bool) & ((id_values < 0) | (id_values >= vocab_size))
    if wrong.any():
        row, column = np.argwhere(wrong)[0]
        raise ValueError(f"{name} holds token id {id_values[row, column]} at row {row}, column {column}, outside "
                         f"the model's vocabulary [0, {vocab_size}): check the tokenizer matches the model")


def check_features(name: str, features: tf.Tensor) -> None:
    """Refuses NaN or infinite features when their values are known."""
    check_batch(name, features)
    values = _known(features)
    if values is not None and not np.isfinite(values).all():
        row = int(np.argwhere(~np.isfinite(values))[0][0])
        raise ValueError(f"{name} holds NaN or infinite values (first in row {row}): compute log-mel features "
                         "from finite audio (e.g. with the processor / xlagen.speech.audio)")


def check_seed(seed) -> None:
    """Refuses a seed that an int32 `[2]` tensor would silently change (None is fine: a fresh seed).

    Raises:
        TypeError: for a non-integer seed.
        ValueError: for more than 2 values, or values outside int32.
    """
    if seed is None:
        return
    tensor = seed if tf.is_tensor(seed) else tf.convert_to_tensor(np.asarray(seed))
    if not tensor.dtype.is_integer:
        raise TypeError(f"seed must be an int or [2] ints, got dtype {tensor.dtype.name}")
    if tensor.shape.rank is not None and (tensor.shape.rank > 1 or tensor.shape.num_elements() not in (None, 1, 2)):
        raise ValueError(f"seed must be an int or [2] ints, got shape {tensor.shape}")
    values = _known(tensor)
    if values is not None and ((values < INT32_MIN).any() or (values > INT32_MAX).any()):
        raise ValueError(f"seed {values.tolist()} is outside the int32 range [{INT32_MIN}, {INT32_MAX}] of "
                         "TensorFlow's stateless random seeds: use a smaller seed")


def estimate_bytes(model, batch: int, prompt_length: int, new_tokens: int, config, extra: dict) -> int:
    """A rough upper estimate of the memory one `generate` call needs.

    The model's decoding state and attention scores (`model.decoding_bytes`), the token buffers, the
    per-step scores `[B*K, V]` (a few float32 copies), `output_scores`' `[B*K, N, V]`, and an encoder's
    context, taken as a cache as long as the longest axis of its inputs.
    """
    beams = max(config.num_beams, 1)
    rows = batch * max(beams, config.num_return_sequences)
    total = prompt_length + new_tokens
    vocab = model.config.vocab_size
    # `CausalDecoding.decoding_bytes`; a model without it is estimated from generation's own buffers only.
    state_bytes = getattr(model, "decoding_bytes", lambda *sizes: 0)
    needed = state_bytes(batch if beams > 1 else rows, total, beams)
    needed += 4 * rows * total * 4  # tokens: running, finished and candidate buffers (beam search)
    needed += 8 * rows * vocab * 4  # logits, log-probs, processed scores, top-k / sort temporaries
    if config.output_scores:
        needed += rows * new_tokens * vocab * 4
    encoder_rows = batch if beams > 1 else rows  # beams share their prompt's encoder context
    for tensor in extra.values():
        sizes = [d for d in tensor.shape[1:] if d is not None]
        needed += state_bytes(encoder_rows, max(sizes, default=1)) + encoder_rows * 4 * int(np.prod(sizes))
    return needed


def check_sizes(model, batch: int, prompt_length: int, new_tokens: int, config, extra: dict) -> None:
    """Refuses a call whose buffers cannot be indexed or whose estimated memory exceeds the limit
    (`config.max_memory_gb`, by default the machine's physical memory).

    Raises:
        ValueError: naming the options, their values and the estimate in GB.
    """
    if prompt_length + new_tokens > INT32_MAX:
        raise ValueError(f"prompt length {prompt_length} + max_new_tokens {new_tokens} exceeds the int32 positions "
                         "of the token buffer: lower max_new_tokens")
    limit = config.max_memory_gb * GB if config.max_memory_gb is not None else physical_memory_bytes()
    if limit is None:
        return
    needed = estimate_bytes(model, batch, prompt_length, new_tokens, config, extra)
    if needed > limit:
        raise ValueError(
            f"this generate call needs about {needed / GB:.3g} GB (batch {batch}, prompt length {prompt_length}, "
            f"max_new_tokens {new_tokens}, num_beams {config.num_beams}, num_return_sequences "
            f"{config.num_return_sequences}, output_scores {config.output_scores}), more than the "
            f"{limit / GB:.3g} GB limit: lower these (or raise the limit with max_memory_gb=)")


def positive_ints(name: str, values) -> tuple[int, ...]:
    """An int or a sequence of ints as a tuple of positive ints.

    Raises:
        TypeError: for values that are not ints.
        ValueError: for an empty sequence or values < 1.
    """
    values = (values,) if isinstance(values, (int, np.integer)) else values
    try:
        items = tuple(values)
    except TypeError as error:
        raise TypeError(f"{name} must be an int or a sequence of ints, got {values!r}") from error
    if not items or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in items):
        raise TypeError(f"{name} must be an int or a non-empty sequence of ints, got {values!r}")
    if min(items) < 1:
        raise ValueError(f"{name} must be positive, got {items}")
    return tuple(int(v) for v in items)

