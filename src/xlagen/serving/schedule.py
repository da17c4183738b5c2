"""The slot engine's scheduling decisions as pure functions of its state (no TensorFlow, no model): how many
tokens the next step call advances, which step width runs, which requests move down to let a narrower step run,
where the chunks of a long prompt start, and how far the slots shift. `xlagen.serving.engine.Engine` carries
them out.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence


def steps_per_call(most: int, waiting: bool, free_slots: int, chunking: bool, tokens_left: Iterable[int]) -> int:
    """Tokens every active slot advances in the next step call.

    Args:
        most: The engine's `steps_per_call`.
        waiting: Whether a request waits in the queue.
        free_slots: Slots neither active nor reserved.
        chunking: Whether a long prompt is being prefilled in chunks (it waits for its slot).
        tokens_left: Each active request's new tokens still allowed.

    Returns:
        `most` while nothing waits for a slot that could take it and every active request has `most` tokens
        left; else 1.
    """
    if most == 1 or chunking or (waiting and free_slots > 0):
        return 1
    return most if all(left >= most for left in tokens_left) else 1


def step_width(widths: Sequence[int], active: Collection[int]) -> int:
    """The narrowest of `widths` (ascending) whose first slots hold every active slot."""
    return next(width for width in widths if width > max(active))


def compaction(widths: Sequence[int], active: Collection[int], reserved: int | None = None) -> list[tuple[int, int]]:
    """`(source, target)` moves that pack the active slots into the first slots of the narrowest width that holds
    them all (and the `reserved` slot, if any, which stays where it is): the highest slots move first, each to the
    lowest free slot. Empty when the active slots already fit that width."""
    taken = len(active) + (reserved is not None)
    narrowest = next(width for width in widths if width >= taken)
    if not active or max(active) < narrowest:
        return []
    free = [slot for slot in range(narrowest) if slot not in active and slot != reserved]
    return [(source, free.pop(0)) for source in sorted((s for s in active if s >= narrowest), reverse=True)]


def chunk_offsets(length: int, real_length: int, chunk: int) -> list[int]:
    """First columns of the chunks of a prompt left-padded to `length` columns with `real_length` real tokens:
    from the chunk holding its first real token to the end, the last one moved left to end at `length`
    (overlapping the one before).

    Raises:
        ValueError: unless 0 < chunk < length and 0 < real_length <= length.
    """
    if not (0 < chunk < length and 0 < real_length <= length):
        raise ValueError(f"chunks of {chunk} of a prompt of {real_length} tokens in {length} columns")
    first = (length - real_length) // chunk * chunk
    return [min(offset, length - chunk) for offset in range(first, length, chunk)]


def shift_amount(index: int, steps: int, length: int, starts: Iterable[int], start_column: int) -> int:
    """Columns to move every slot left before a step of `steps` tokens at write column `index` of `length`:
    0 while the step fits; else as far as the earliest active request's first column allows, never past
    `start_column` (the longest prompt must still fit left of the write column)."""
    if index + steps <= length:
        return 0
    return min(min(starts), index - start_column)
