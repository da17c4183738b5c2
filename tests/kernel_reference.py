"""float64 numpy references for xlagen's native kernels (tests/native/ calls the kernels through ctypes,
tests/test_native.py through XLA)."""

from __future__ import annotations

import numpy as np


def attention(q, k, v, scale):
    """softmax(scale * q k^T) v over the last two axes of q [..., t, d], k and v [..., s, d]."""
    scores = np.einsum("...td,...sd->...ts", q.astype(np.float64), k.astype(np.float64)) * scale
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("...ts,...sd->...td", weights / weights.sum(-1, keepdims=True), v.astype(np.float64))


def step_attention(q, keys, values, key, value, bias, scale, mask_value):
    """Softmax over [cache keys, new key] of scale * q.k + bias (a -inf bias: the score is mask_value)."""
    q, keys, values, key, value, bias = (np.asarray(t, np.float64) for t in (q, keys, values, key, value, bias))
    scores = np.concatenate([np.einsum("ghkd,ghsd->ghks", q, keys), np.sum(q * key, -1, keepdims=True)], -1)
    scores = np.where(np.isneginf(bias), mask_value, scores * scale + np.where(np.isneginf(bias), 0, bias))
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("ghks,ghsd->ghkd", weights[..., :-1], values) + weights[..., -1:] * value


def memory_inputs(groups, queries, heads, d, length, embed, seed=0):
    """(query [G, Q, H * D], states [G, L, E], kv_kernel [E, 2 H D], kv_bias [2 H D]), float32."""
    rng = np.random.default_rng(seed)
    query = rng.standard_normal((groups, queries, heads * d)).astype(np.float32)
    states = rng.standard_normal((groups, length, embed)).astype(np.float32)
    kv_kernel = (2 * rng.standard_normal((embed, 2 * heads * d)) / np.sqrt(embed)).astype(np.float32)
    kv_bias = rng.standard_normal(2 * heads * d).astype(np.float32)
    return query, states, kv_kernel, kv_bias


def memory_attention(query, states, kv_kernel, kv_bias, heads, scale):
    """Cross-attention of query [G, Q, H * D] over the keys and values projected from states [G, L, E]."""
    groups, queries, width = query.shape
    d = width // heads
    projected = states.astype(np.float64) @ kv_kernel.astype(np.float64) + kv_bias
    keys = projected[..., :width].reshape(groups, -1, heads, d).transpose(0, 2, 1, 3)
    values = projected[..., width:].reshape(groups, -1, heads, d).transpose(0, 2, 1, 3)
    q = query.astype(np.float64).reshape(groups, queries, heads, d).transpose(0, 2, 1, 3)
    out = attention(q, keys, values, scale)  # [G, H, Q, D]
    return out.transpose(0, 2, 1, 3).reshape(groups, queries, width)


def int8_parts(packed, k, n):
    """(Q int8 [k, n], s float32 [n]) of int8 panels packed by `pack_int8` (read here, not by the library)."""
    quantized = packed[:, :k, :].transpose(1, 0, 2).reshape(k, -1)[:, :n]
    scales = np.ascontiguousarray(packed[:, k:, :]).view(np.float32).reshape(-1)[:n]  # 4 rows of bytes: floats
    return quantized, scales


def quantize_rows(x):
    """(Qx int8, sx float32): each row of float32 x quantized symmetrically as the integer product does,
    Qx = round(x * (127 / max |x|)) ties to even, sx = max |x| / 127 (a row of zeros: 0 and 0)."""
    x = np.asarray(x, np.float32)
    top = np.abs(x).max(axis=1) if x.shape[1] else np.zeros(len(x), np.float32)
    inverse = np.where(top > 0, np.float32(127) / np.where(top > 0, top, 1), 0).astype(np.float32)
    return np.rint(x * inverse[:, None]).astype(np.int8), (top / np.float32(127)).astype(np.float32)


def quantize_rows_seven(x):
    """(Xq uint8, sx float32, zx int32): each row of float32 x quantized to 7 bits with a zero point as the
    many-row integer product does: sx = (max(x, 0) - min(x, 0)) / 126, zx = round(-min(x, 0) * 126 / range),
    Xq = clip(round(x * (126 / range)) + zx, 0, 127), ties to even (a row of zeros: 0, 0 and 0)."""
    x = np.asarray(x, np.float32)
    empty = np.zeros(len(x), np.float32)
    largest = np.maximum(x.max(axis=1), 0) if x.shape[1] else empty
    smallest = np.minimum(x.min(axis=1), 0) if x.shape[1] else empty
    spread = (largest - smallest).astype(np.float32)
    inverse = np.where(spread > 0, np.float32(126) / np.where(spread > 0, spread, 1), 0).astype(np.float32)
    zeros = np.rint(-smallest * inverse).astype(np.int32)
    xq = np.clip(np.rint(x * inverse[:, None]).astype(np.int32) + zeros[:, None], 0, 127).astype(np.uint8)
    return xq, (spread / np.float32(126)).astype(np.float32), zeros


def integer_product(x, quantized, scales, seven: bool = False):
    """y of the integer product (`seven`: the many-row one): exact int32 sums of Xq @ Q (less zx times the
    columns' sums of Q), times float32(sx * s), in float32."""
    quantized = np.asarray(quantized, np.int64)
    if seven:
        qx, sx, zx = quantize_rows_seven(x)
    else:
        (qx, sx), zx = quantize_rows(x), np.zeros(len(x), np.int64)
    sums = qx.astype(np.int64) @ quantized
    assert np.abs(sums).max(initial=0) < 2**31  # the kernel's int32 sums
    sums -= zx[:, None].astype(np.int64) * quantized.sum(axis=0)[None, :]
    return sums.astype(np.int32).astype(np.float32) * (sx[:, None] * np.asarray(scales, np.float32)[None, :])
