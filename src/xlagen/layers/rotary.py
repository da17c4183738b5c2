"""Rotary position embeddings (Su et al. 2021, "RoFormer"): the query and key of each head are rotated by
angles `position * inverse_frequency`, so that their dot product depends on the distance between positions.

The frequencies follow transformers' `modeling_rope_utils` (5.x), type by type: "default", "linear"
(positions divided by a factor), "dynamic" (NTK-aware base grown with the sequence length, recomputed
in the graph from the positions of each call), "llama3" (Llama 3.1's banded scaling) and "yarn"
(interpolation ramp and an attention factor that scales cos and sin). The rotation is transformers'
"rotate half" layout (the two halves of a head, not interleaved pairs), over the whole head.

Shapes: B batch, T tokens, H heads, D head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from keras import ops

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeSpec:
    """The rotary embedding of a model: its type and parameters (transformers' `rope_parameters`).

    Attributes:
        theta: The base wavelength (`rope_theta`).
        rope_type: One of `ROPE_TYPES`.
        factor: The scaling factor (every type but "default"; yarn: None derives it from the positions).
        max_positions: The config's `max_position_embeddings` (dynamic: where scaling starts; yarn: the
            default factor).
        original_max_positions: llama3 and yarn: the pretraining length (`original_max_position_embeddings`).
        low_freq_factor: llama3.
        high_freq_factor: llama3.
        attention_factor: yarn: the multiplier of cos and sin (None: derived from the factor and mscales).
        beta_fast: yarn (None: 32).
        beta_slow: yarn (None: 1).
        mscale: yarn.
        mscale_all_dim: yarn.
        truncate: yarn: round the correction range to whole dimensions.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float | None = None
    max_positions: int = 2048
    original_max_positions: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self):
        """Raises:
            ValueError: an unknown type, or a parameter the type needs that is missing.
        """
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} is not implemented by xlagen; implemented: "
                             f"{', '.join(ROPE_TYPES)}")
        needed = {"linear": ("factor",), "dynamic": ("factor",),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_positions"),
                  "yarn": ("original_max_positions",)}.get(self.rope_type, ())
        missing = [name for name in needed if getattr(self, name) is None]
        if missing:
            raise ValueError(f"rope_type {self.rope_type!r} needs {', '.join(missing)}")

    def inverse_frequencies(self, dim: int) -> tuple[np.ndarray, float]:
        """`(inverse frequencies float32 [D / 2], attention scaling)` of heads of size D = `dim`, as
        transformers computes them at init (for "dynamic", those of sequences up to `max_positions`;
        `rotary_tables` grows them)."""
        exponents = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)
        inverse = (1.0 / np.power(np.float32(self.theta), exponents)).astype(np.float32)
        if self.rope_type == "linear":
            return inverse / np.float32(self.factor), 1.0
        if self.rope_type == "llama3":
            return self._llama3(inverse), 1.0
        if self.rope_type == "yarn":
            return self._yarn(dim)
        return inverse, 1.0

    def _llama3(self, inverse: np.ndarray) -> np.ndarray:
        """Llama 3.1: long wavelengths divided by the factor, short ones kept, a smooth blend between."""
        factor, low, high = self.factor, self.low_freq_factor, self.high_freq_factor
        context = self.original_max_positions
        wavelength = 2 * math.pi / inverse
        scaled = np.where(wavelength > context / low, inverse / factor, inverse)
        smooth = (context / wavelength - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelength < context / high) & ~(wavelength > context / low)
        return np.where(medium, smoothed, scaled).astype(np.float32)

    def _yarn(self, dim: int) -> tuple[np.ndarray, float]:
        """YaRN (Peng et al. 2023): interpolated and extrapolated frequencies blended by a linear ramp over
        the dimensions, and an attention factor."""
        base = self.theta
        original = self.original_max_positions
        factor = self.max_positions / original if self.factor is None else self.factor

        def mscale_of(scale, mscale=1):
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        attention_factor = self.attention_factor
        if attention_factor is None:
            if self.mscale and self.mscale_all_dim:
                attention_factor = float(mscale_of(factor, self.mscale) / mscale_of(factor, self.mscale_all_dim))
            else:
                attention_factor = mscale_of(factor)
        beta_fast, beta_slow = self.beta_fast or 32, self.beta_slow or 1

        def correction_dim(rotations):
            return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as transformers: no division by zero
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
        position_frequencies = np.power(np.float32(base), np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
        extrapolation = 1.0 / position_frequencies
        interpolation = 1.0 / (np.float32(factor) * position_frequencies)
        keep = 1 - ramp
        inverse = interpolation * (1 - keep) + extrapolation * keep
        return inverse.astype(np.float32), float(attention_factor)


def rotary_tables(spec: RopeSpec, dim: int, positions):
    """cos and sin of every position's angles, in the layout `apply_rotary` takes.

    Args:
        spec: The model's rotary embedding.
        dim: D, the head size (even).
        positions: int `[B, T]` position ids.

    Returns:
        `(cos, sin)`, float32 `[B, T, D]` each (scaled by the type's attention factor).
    """
    inverse, scaling = spec.inverse_frequencies(dim)
    inverse = ops.convert_to_tensor(inverse)
    positions = ops.cast(positions, "float32")
    if spec.rope_type == "dynamic":
        # transformers grows the base with the longest sequence of the call: max(positions) + 1, at least
        # max_position_embeddings (where the formula gives back theta).
        length = ops.maximum(ops.max(positions) + 1.0, float(spec.max_positions))
        growth = spec.factor * length / spec.max_positions - (spec.factor - 1)
        base = spec.theta * ops.power(growth, dim / (dim - 2))
        exponents = ops.convert_to_tensor(np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
        inverse = 1.0 / ops.power(base, exponents)
    angles = positions[..., None] * inverse  # [B, T, D / 2]
    angles = ops.concatenate([angles, angles], axis=-1)
    return ops.cos(angles) * scaling, ops.sin(angles) * scaling


def apply_rotary(x, cos, sin):
    """Rotates `x` `[B, H, T, D]` by the tables `[B, T, D]` of `rotary_tables` (transformers' layout: the
    second half of a head pairs with the first), in `x`'s dtype."""
    half = x.shape[-1] // 2
    rotated = ops.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = ops.cast(cos[:, None], x.dtype), ops.cast(sin[:, None], x.dtype)
    return x * cos + rotated * sin
