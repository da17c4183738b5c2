"""Generic, checked conversion of Hugging Face tensors to our variables (numpy only).

A model's weights module (`weights/gpt2.py`, ...) is a pure table of `Rule`s: which HF tensors make
which of our variables, through which named transform. `convert` applies the table and refuses a
checkpoint that does not match the model exactly: every missing, unused or misshaped tensor is
reported together in one `CheckpointMismatchError`, instead of failing on the first one (or,
worse, leaving a variable at its random initial value).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

Transform = Callable[[list[np.ndarray]], np.ndarray]

_MAX_NAMES_SHOWN = 20


def identity(xs: list[np.ndarray]) -> np.ndarray:
    """Returns the single source unchanged."""
    (x,) = xs
    return x


def transpose(xs: list[np.ndarray]) -> np.ndarray:
    """Returns the transpose of the single 2-D source (PyTorch Linear [out, in] -> Keras [in, out])."""
    (x,) = xs
    if x.ndim != 2:
        raise ValueError(f"transpose expects a 2-D tensor, got shape {x.shape}")
    return x.T


def concat_last(xs: list[np.ndarray]) -> np.ndarray:
    """Concatenates the sources on their last axis (e.g. separate q, k, v kernels -> fused)."""
    return np.concatenate(xs, axis=-1)


def concat_first(xs: list[np.ndarray]) -> np.ndarray:
    """Concatenates the sources on their first axis."""
    return np.concatenate(xs, axis=0)


def concat_first_sized(*sizes: int) -> Transform:
    """Makes a transform concatenating sources of first-axis sizes `sizes` on their first axis, e.g. the
    query, key and value projections of grouped-query attention (`[H * D, in]`, `[Hkv * D, in]` twice).
    Unlike `concat_first`, its inverse (for saving) splits at those sizes rather than into equal parts.

    Raises:
        ValueError: (when applied) a source whose first axis is not its size.
    """

    def transform(xs: list[np.ndarray]) -> np.ndarray:
        got = tuple(x.shape[0] for x in xs)
        if got != sizes:
            raise ValueError(f"concat_first_sized: the sources' first axes are {got}, expected {sizes}")
        return np.concatenate(xs, axis=0)

    transform.__name__ = f"concat_first_sized{sizes}"
    transform.split_sizes = sizes
    return transform


def split_last(index: int, parts: int) -> Transform:
    """Makes a transform taking piece `index` of the single source split in `parts` on its last axis.

    GPT-2 fuses q, k, v in one `c_attn` of shape [in, 3 * out]: `split_last(1, 3)` is the key.

    Args:
        index: Which piece to return, in `[0, parts)`.
        parts: Number of equal pieces; must divide the last dimension.

    Returns:
        A named transform.

    Raises:
        ValueError: If `index` is out of range.
    """
    if not 0 <= index < parts:
        raise ValueError(f"split_last: index {index} is not in [0, {parts})")

    def transform(xs: list[np.ndarray]) -> np.ndarray:
        (x,) = xs
        return np.split(x, parts, axis=-1)[index]

    transform.__name__ = f"split_last({index}, {parts})"
    return transform


def conv_kernel(xs: list[np.ndarray]) -> np.ndarray:
    """PyTorch Conv1d weight `[out, in, width]` -> Keras Conv1D kernel `[width, in, out]`."""
    (x,) = xs
    if x.ndim != 3:
        raise ValueError(f"conv_kernel expects a 3-D tensor, got shape {x.shape}")
    return x.transpose(2, 1, 0)


def insert_zeros(position: int) -> Transform:
    """Makes a transform concatenating the sources on their last axis with a block of zeros (the size of
    the first source) inserted at `position`.

    Whisper's key projections have no bias: `insert_zeros(1)` on (q bias, v bias) makes our fused qkv bias.
    """

    def transform(xs: list[np.ndarray]) -> np.ndarray:
        pieces = list(xs)
        pieces.insert(position, np.zeros_like(xs[0]))
        return np.concatenate(pieces, axis=-1)

    transform.__name__ = f"insert_zeros({position})"
    transform.zeros_at = position
    return transform


def chain(*transforms: Transform) -> Transform:
    """Makes a transform applying `transforms` in order; the later ones get one source each."""
    if not transforms:
        raise ValueError("chain needs at least one transform")

    def transform(xs: list[np.ndarray]) -> np.ndarray:
        out = transforms[0](xs)
        for t in transforms[1:]:
            out = t([out])
        return out

    transform.__name__ = " -> ".join(_name(t) for t in transforms)
    transform.parts = transforms  # for `export`, which inverts each part in reverse order
    return transform


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one of our variables is made from HF tensors.

    Attributes:
        target: Variable path in our model, e.g. "blocks.0.attention.query.kernel".
        sources: One or more HF tensor names, passed to `transform` in this order.
        transform: Function from the list of source arrays to the target array.
    """

    target: str
    sources: tuple[str, ...]
    transform: Transform = identity

    def __post_init__(self):
        if isinstance(self.sources, str):  # Rule("x", "y") would otherwise mean sources 'y'.
            object.__setattr__(self, "sources", (self.sources,))
        if not self.sources:
            raise ValueError(f"Rule for '{self.target}' has no sources")


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match the model's variables.

    Attributes:
        missing: HF tensor names required by a rule but absent from the checkpoint.
        unexpected: HF tensor names present but used by no rule and not ignored.
        mismatched: (target, expected shape, got shape, sources) for each wrong shape.
        failed: (target, sources, error text) for each transform that raised.
        unassigned: Expected targets that no rule produces.
        unknown_targets: Rule targets that are not in `expected`.
        duplicate_targets: Targets produced by more than one rule.
    """

    def __init__(self, **problems: list):
        self.missing = problems.get("missing", [])
        self.unexpected = problems.get("unexpected", [])
        self.mismatched = problems.get("mismatched", [])
        self.failed = problems.get("failed", [])
        self.unassigned = problems.get("unassigned", [])
        self.unknown_targets = problems.get("unknown_targets", [])
        self.duplicate_targets = problems.get("duplicate_targets", [])
        super().__init__(self._format())

    def _format(self) -> str:
        """Builds the grouped, truncated message."""
        groups = [
            ("HF tensors missing from the checkpoint", self.missing),
            ("unexpected HF tensors (used by no rule; pass ignore= regexes if intended)", self.unexpected),
            (
                "shape mismatches",
                [f"{t}: expected {e}, got {g} from {', '.join(s)}" for t, e, g, s in self.mismatched],
            ),
            ("transforms that failed", [f"{t} from {', '.join(s)}: {err}" for t, s, err in self.failed]),
            ("model variables that no rule produces", self.unassigned),
            ("rules whose target is not a model variable", self.unknown_targets),
            ("targets produced by more than one rule", self.duplicate_targets),
        ]
        total = sum(len(items) for _, items in groups)
        lines = [f"checkpoint does not match the model ({total} problems):"]
        for title, items in groups:
            if not items:
                continue
            items = sorted(items)
            lines.append(f"  {title} ({len(items)}):")
            lines.extend(f"    {item}" for item in items[:_MAX_NAMES_SHOWN])
            if len(items) > _MAX_NAMES_SHOWN:
                lines.append(f"    ... and {len(items) - _MAX_NAMES_SHOWN} more")
        return "\n".join(lines)


def convert(
    rules: Iterable[Rule],
    tensors: Mapping[str, np.ndarray],
    expected: Mapping[str, Sequence[int]],
    *,
    ignore: Sequence[str] = (),
    dtype: np.dtype | type | None = np.float32,
) -> dict[str, np.ndarray]:
    """Builds our variables from HF tensors, checking that the two match exactly.

    Args:
        rules: The model's conversion table.
        tensors: HF tensor name -> array, as read by `read_checkpoint`.
        expected: Our variable path -> shape; every one must be produced by exactly one rule.
        ignore: Regexes (full match) of HF tensor names that may be present and unused, e.g.
            `r"h\\.\\d+\\.attn\\.bias"` for GPT-2's saved causal-mask buffers.
        dtype: Floating-point results are cast to it; None keeps the checkpoint's dtype.
            Integer and boolean tensors are never cast.

    Returns:
        Target path -> C-contiguous array of the expected shape.

    Raises:
        CheckpointMismatchError: (a ValueError) listing every problem at once: missing,
            unexpected and misshaped tensors, failed transforms, variables with no rule, rules
            with unknown or duplicate targets.
        re.error: If an `ignore` pattern is not a valid regex.
    """
    out: dict[str, np.ndarray] = {}

    def store(target: str, value: np.ndarray) -> None:
        out[target] = np.ascontiguousarray(value)

    convert_each(rules, tensors, expected, store, ignore=ignore, dtype=dtype)
    return out


def convert_each(
    rules: Iterable[Rule],
    tensors: Mapping[str, np.ndarray],
    expected: Mapping[str, Sequence[int]],
    store: Callable[[str, np.ndarray], None],
    *,
    ignore: Sequence[str] = (),
    dtype: np.dtype | type | None = np.float32,
) -> None:
    """`convert`, handing each variable to `store` as soon as it is made, in the order of `rules`.

    Nothing is kept between rules, so a lazy `tensors` (`checkpoint.open_checkpoint`) is read a rule at a
    time: a load holds one rule's tensors beside the model rather than the whole checkpoint.
    Every rule is tried before a mismatch is raised (so that all problems are reported together), so
    `store` may have been called for some targets when it is.

    Args:
        rules: The model's conversion table, in the order to apply it.
        tensors: HF tensor name -> array; each source is looked up once, when its rule runs.
        expected: As `convert`.
        store: Called with (target path, array of the expected shape): the transform's result, which may be
            a view of a source (e.g. its transpose) rather than a C-contiguous array.
        ignore: As `convert`.
        dtype: As `convert`.

    Raises:
        CheckpointMismatchError: As `convert`.
        re.error: If an `ignore` pattern is not a valid regex.
    """
    rules = list(rules)
    ignore_res = [re.compile(p) for p in ignore]
    expected_shapes = {k: tuple(int(d) for d in v) for k, v in expected.items()}
    targets = [r.target for r in rules]
    used = {s for r in rules for s in r.sources}
    problems: dict[str, list] = {
        "missing": [],
        "unexpected": [n for n in tensors if n not in used and not any(p.fullmatch(n) for p in ignore_res)],
        "mismatched": [],
        "failed": [],
        "unassigned": sorted(set(expected_shapes) - set(targets)),
        "unknown_targets": [],
        "duplicate_targets": sorted(t for t, n in collections.Counter(targets).items() if n > 1),
    }

    for rule in rules:
        absent = [s for s in rule.sources if s not in tensors]
        problems["missing"].extend(absent)
        if rule.target not in expected_shapes:
            problems["unknown_targets"].append(rule.target)
            continue
        if absent:
            continue
        sources = [tensors[s] for s in rule.sources]
        try:
            value = np.asarray(rule.transform(sources))
        except Exception as e:  # Reported with all other problems rather than stopping at the first.
            shapes = ", ".join(f"{s}{tuple(x.shape)}" for s, x in zip(rule.sources, sources))
            text = f"{_name(rule.transform)} on {shapes}: {e}"
            problems["failed"].append((rule.target, rule.sources, text))
            continue
        del sources  # a transform's result that is a new array leaves the sources to be freed now
        want = expected_shapes[rule.target]
        if value.shape != want:
            problems["mismatched"].append((rule.target, want, value.shape, rule.sources))
            continue
        store(rule.target, _cast(value, dtype))
        del value

    problems["missing"] = sorted(set(problems["missing"]))
    if any(problems.values()):
        raise CheckpointMismatchError(**problems)


def normalize_prefix(tensors: Mapping[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """Removes `prefix` from the names that carry it and keeps the other names unchanged.

    transformers saves a `GPT2LMHeadModel` as "transformer.h.0...." but a `GPT2Model` as
    "h.0....": normalizing with prefix "transformer." lets one rule table read both.

    Args:
        tensors: HF tensor name -> array.
        prefix: Prefix to remove, including its trailing dot.

    Returns:
        A new dict; the arrays are not copied.

    Raises:
        ValueError: If removing the prefix makes two names collide.
    """
    out: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        short = name[len(prefix):] if name.startswith(prefix) else name
        if short in out:
            raise ValueError(f"both '{short}' and '{prefix}{short}' are in the checkpoint")
        out[short] = value
    return out


def _cast(value: np.ndarray, dtype: np.dtype | type | None) -> np.ndarray:
    """Casts floating-point arrays to `dtype` (not copying one already of it); leaves integer and boolean arrays
    alone."""
    if dtype is not None and np.issubdtype(value.dtype, np.floating):
        value = value.astype(dtype, copy=False)
    return value


def _name(transform: Transform) -> str:
    """The readable name of a transform."""
    return getattr(transform, "__name__", repr(transform))


def _split_into_sources(rule: Rule, value: np.ndarray, axis: int) -> list[np.ndarray]:
    return np.split(value, len(rule.sources), axis=axis)


# Inverse of each invertible transform: our array -> the list of HF source arrays.
_INVERSES: dict[Callable, Callable[[Rule, np.ndarray], list[np.ndarray]]] = {
    identity: lambda rule, value: [value],
    transpose: lambda rule, value: [value.T],
    concat_last: lambda rule, value: _split_into_sources(rule, value, -1),
    concat_first: lambda rule, value: _split_into_sources(rule, value, 0),
    conv_kernel: lambda rule, value: [value.transpose(2, 1, 0)],
}


def _inverse(transform: Callable) -> Callable[[Rule, np.ndarray], list[np.ndarray]] | None:
    if transform in _INVERSES:
        return _INVERSES[transform]
    sizes = getattr(transform, "split_sizes", None)
    if sizes is not None:
        return lambda rule, value: np.split(value, np.cumsum(sizes)[:-1], axis=0)
    position = getattr(transform, "zeros_at", None)
    if position is None:
        return None

    def without_zeros(rule: Rule, value: np.ndarray) -> list[np.ndarray]:
        pieces = np.split(value, len(rule.sources) + 1, axis=-1)
        return pieces[:position] + pieces[position + 1:]

    return without_zeros


def export(rules: Iterable[Rule], values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Turns our variables back into HF tensors (the inverse of `convert`), for `save_pretrained`.

    Args:
        rules: The model's conversion table.
        values: Our variable path -> array; every rule's target must be present.

    Returns:
        HF tensor name -> C-contiguous array.

    Raises:
        ValueError: If a rule's transform has no inverse or its target is missing.
    """
    out: dict[str, np.ndarray] = {}
    for rule in rules:
        parts = getattr(rule.transform, "parts", (rule.transform,))
        if any(_inverse(part) is None for part in parts):
            raise ValueError(f"cannot save '{rule.target}': transform {_name(rule.transform)} has no inverse")
        if rule.target not in values:
            raise ValueError(f"cannot save: no value for '{rule.target}'")
        value = np.asarray(values[rule.target])
        for part in reversed(parts[1:]):  # the later parts of a chain map one array to one array
            (value,) = _inverse(part)(rule, value)
        pieces = _inverse(parts[0])(rule, value)
        out.update({name: np.ascontiguousarray(piece) for name, piece in zip(rule.sources, pieces)})
    return out


@dataclasses.dataclass(frozen=True)
class Size:
    """A config value that the shape of a checkpoint tensor must agree with.

    Attributes:
        key: The config.json key (or a short expression of keys) the value comes from.
        value: The config's value.
        tensor: HF tensor name (after `normalize_prefix`); for a layer count (`axis` None), a regex
            whose group 1 is the layer index, e.g. `r"h\\.(\\d+)\\."`.
        axis: The axis of `tensor` whose length is `value`; None: `value` is the number of layers.
    """

    key: str
    value: int
    tensor: str
    axis: int | None = 0


def check_sizes(sizes: Iterable[Size], shapes: Mapping[str, Sequence[int]], where: str) -> None:
    """Checks a model config against the tensor shapes of its checkpoint (from the headers alone).

    Run before the model is built, so a config whose sizes the checkpoint contradicts (a corrupted or
    mismatched config.json) fails at once instead of allocating (or hanging on) a huge model. Tensors
    absent from the checkpoint are skipped here; `convert` reports them later.

    Args:
        sizes: The family's `Size` checks for the config.
        shapes: HF tensor name -> shape.
        where: The checkpoint, for the message.

    Raises:
        ValueError: naming each config key whose value the checkpoint contradicts, the value, and the
            tensor shape (or layer count) that contradicts it.
    """
    problems = []
    for size in sizes:
        if size.axis is None:
            pattern = re.compile(size.tensor)
            layers = {int(m.group(1)) for name in shapes if (m := pattern.match(name))}
            if layers and len(layers) != size.value:
                problems.append(f"{size.key}={size.value}, but the checkpoint has {len(layers)} layers "
                                f"(tensors matching {size.tensor!r})")
            continue
        shape = shapes.get(size.tensor)
        if shape is None or size.axis >= len(shape) or shape[size.axis] == size.value:
            continue
        problems.append(f"{size.key}={size.value}, but the checkpoint's '{size.tensor}' has shape {tuple(shape)} "
                        f"(axis {size.axis} is {shape[size.axis]})")
    if problems:
        raise ValueError(f"config.json does not match the weights of '{where}': " + "; ".join(problems)
                         + ". Fix config.json (or use the config saved with these weights).")


def check_parameter_count(parameters: int, sizes: Iterable[Size], shapes: Mapping[str, Sequence[int]],
                          where: str) -> None:
    """Refuses a config describing a model much larger than its checkpoint (which could not fill it anyway).

    This catches sizes `check_sizes` cannot see, e.g. when the checkpoint's tensor names are not the
    family's, before a huge model is allocated.

    Args:
        parameters: The family's estimate of the model's parameter count.
        sizes: The config's sizes, named in the message.
        shapes: HF tensor name -> shape, from the safetensors headers.
        where: The checkpoint, for the message.

    Raises:
        ValueError: naming the config's sizes, the estimate and the checkpoint's count.
    """
    stored = sum(math.prod(shape) for shape in shapes.values())
    if parameters <= 1.5 * stored + 1024:  # the estimate is within 2%; the checkpoint may hold tied copies too
        return
    values = ", ".join(dict.fromkeys(f"{s.key}={s.value}" for s in sizes))
    raise ValueError(f"config.json describes a model of about {parameters:.3g} parameters ({values}), but the "
                     f"weights of '{where}' hold only {stored:.3g} values. Fix config.json (or use the config saved "
                     "with these weights).")


def check_memory(parameters: int, sizes: Iterable[Size], bytes_per_parameter: int, memory: int | None) -> None:
    """Refuses a model whose parameters alone would not fit in the machine's memory, before allocating it.

    Args:
        parameters: The family's estimate of the model's parameter count.
        sizes: The config's sizes, named in the message.
        bytes_per_parameter: Bytes of one parameter in the model's dtype.
        memory: Bytes of memory of the machine; None skips the check.

    Raises:
        ValueError: naming the config's sizes, the estimate and the memory.
    """
    need = parameters * bytes_per_parameter
    if memory is None or need <= memory:
        return
    values = ", ".join(dict.fromkeys(f"{s.key}={s.value}" for s in sizes))
    raise ValueError(f"config.json describes a model of about {parameters:.3g} parameters ({need / 2**30:.3g} GiB; "
                     f"{values}), more than this machine's {memory / 2**30:.3g} GiB of memory. Check these "
                     "values in config.json.")


def physical_memory() -> int | None:
    """Bytes of physical memory of this machine, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
