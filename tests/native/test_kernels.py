"""xlagen's C++ kernels through their plain entry points (kernels.h), from numpy with ctypes: no TensorFlow.

Edge shapes: one row, sizes that are odd or not a multiple of the 16-lane vectors (AVX-512), multiples of
the 8-lane vectors (AVX2) that are not of 16, the kernels' block sizes and one past them; and the sizes an
entry point refuses (its message comes back, nothing is written). Every test runs on every build of the
kernels this CPU can run (`native.build.supported_isas()`: an AMX CPU tests all four, an AVX-512 CPU without
AMX three, an AVX2 CPU one), so each kind of machine tests the paths it takes and the ones below them.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import kernel_reference
from conftest import requires_kernels
from xlagen import native

pytestmark = requires_kernels

MASK_VALUE = -1e9
_FLOAT = ctypes.POINTER(ctypes.c_float)
BUILDS = native.build.supported_isas() if native.hardware_reason() is None else ()
_build = {"isa": None}  # the build the running test calls (the `kernel_build` fixture's)


@pytest.fixture(autouse=True, params=BUILDS or [None])
def kernel_build(request):
    """Runs each test of this module once per build of the kernels this CPU runs."""
    _build["isa"] = request.param
    yield request.param
    _build["isa"] = None


def _library() -> ctypes.CDLL:
    return native.library.opened_build(_build["isa"])


def _tiles() -> bool:
    """Whether the build under test multiplies on AMX's tiles in this process."""
    return _build["isa"] == "avx512amx" and native.build.tiles_granted()


def _entry(name: str, *argtypes):
    function = getattr(_library(), name)
    function.argtypes, function.restype = list(argtypes), ctypes.c_char_p
    return function


def _p(array: np.ndarray):
    return array.ctypes.data_as(ctypes.c_void_p)


def _assert_refused_without_tiles(name: str, x: np.ndarray, stored: np.ndarray, n: int, bias=None,
                                  residual=None) -> None:
    """A tile product of a build (or process) without AMX's tiles refuses, naming AMX, and writes nothing."""
    m, k = x.shape
    y = np.full((m, n), np.nan, np.float32)
    if bias is None:
        error = _entry(name, *[ctypes.c_void_p] * 3, *[ctypes.c_int] * 3)(_p(x), _p(stored), _p(y), m, k, n)
    else:
        entry = _entry(name, *[ctypes.c_void_p] * 3, ctypes.c_int, *[ctypes.c_void_p] * 2, *[ctypes.c_int] * 3)
        error = entry(_p(x), _p(stored), _p(bias), 1, _p(residual), _p(y), m, k, n)
    assert error is not None and b"AMX" in error, error
    assert np.isnan(y).all()


def _product(name: str, x: np.ndarray, stored: np.ndarray, n: int) -> np.ndarray:
    m, k = x.shape
    y = np.full((m, n), np.nan, np.float32)
    error = _entry(name, *[ctypes.c_void_p] * 3, *[ctypes.c_int] * 3)(_p(x), _p(stored), _p(y), m, k, n)
    assert error is None, error
    return y


SHAPES = [(1, 1, 1), (1, 7, 13), (2, 17, 33), (3, 64, 100), (8, 5, 300), (16, 200, 1025), (17, 33, 257),
          (33, 100, 70), (1, 3000, 96), (5, 1, 2049),
          # multiples of 8 columns, not of 16: whole AVX2 vectors, half a panel, past a block or int8 panel
          (1, 9, 8), (3, 9, 24), (12, 16, 40), (17, 40, 264), (20, 8, 136), (9, 12, 104)]


@pytest.mark.parametrize("m, k, n", SHAPES + [(7, 513, 129), (40, 300, 200), (13, 256, 64), (50, 40, 384),
                                             (30, 20, 1152), (45, 16, 288), (100, 24, 832), (45, 33, 600),
                                             (29, 300, 1000), (200, 17, 520)])
@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8"])
def test_many_row_products_match_numpy(m, k, n, weights):
    # Past the kernel's 256 weight rows per run (513, 300), strips and blocks not whole (129, 200), row counts
    # that are not multiples of its tile; columns split into blocks of equal strips (384, 1152) or as evenly
    # as whole panels allow (288, 832), and rows into one part per thread; with two blocks or more (AVX-512),
    # the part's rows packed for the tiles: K not a multiple of the 16 values packed at a time (33, 300, 17),
    # a part's last tile of rows not whole (45, 29, 200).
    rng = np.random.default_rng(m * k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    stored, used = {"float32": (w, w),
                    "bfloat16": (native.pack_bfloat16(w), w.astype(ml_dtypes.bfloat16).astype(np.float32)),
                    "int8": (native.pack_int8(w), None)}[weights]
    if used is None:
        quantized, scales = kernel_reference.int8_parts(stored, k, n)
        used = quantized.astype(np.float32) * scales
    prefix = {"float32": "f32", "bfloat16": "bf16", "int8": "int8"}[weights]
    y = _product(f"xlagen_{prefix}_many_product", x, stored, n)
    np.testing.assert_allclose(y, x.astype(np.float64) @ used, rtol=1e-5, atol=1e-5 * np.sqrt(k))


def test_many_row_product_splits_every_width_into_blocks_that_fit():
    # The columns' blocks (of equal strips, or panels shared out evenly) never exceed a unit's buffer, which
    # the product checks before it runs: every width up to 3,000 columns, one row and one weight row.
    product = _entry("xlagen_f32_many_product", *[ctypes.c_void_p] * 3, *[ctypes.c_int] * 3)
    x = np.ones((1, 1), np.float32)
    for n in range(1, 3001):
        w = np.arange(n, dtype=np.float32).reshape(1, n)
        y = np.full((1, n), np.nan, np.float32)
        assert product(_p(x), _p(w), _p(y), 1, 1, n) is None, n
        np.testing.assert_array_equal(y, w)


@pytest.mark.parametrize("m, k, n", SHAPES + [(32, 32, 32), (33, 31, 33), (64, 64, 64), (77, 200, 129), (40, 513, 200),
                                             (70, 3000, 130), (33, 1700, 65), (1100, 200, 129), (1057, 1700, 65)])
def test_bfloat16_tile_product_is_that_of_activations_rounded_to_bfloat16(m, k, n):
    # Blocks of 32 rows and columns not whole (33, 77, 129, 200), K past whole tiles of 32 (31, 200, 513),
    # whole blocks written straight into y (32, 64), K in several chunks over several blocks of rows (3000, 1700),
    # rows in several slabs, the last one short (1100, 1057). Against float64 bf16(x) @ W: float32 sums' rounding only.
    rng = np.random.default_rng(m * k + n + 5)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    if not _tiles():
        _assert_refused_without_tiles("xlagen_bf16_tile_product", x, native.pack_bfloat16(w), n)
        return
    rounded = x.astype(ml_dtypes.bfloat16).astype(np.float64)
    y = _product("xlagen_bf16_tile_product", x, native.pack_bfloat16(w), n)
    expected = rounded @ w.astype(ml_dtypes.bfloat16).astype(np.float64)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * np.sqrt(k))
    if k >= 32:  # x was rounded: further from the float32-compute product than the sums' rounding
        assert np.abs(y - x.astype(np.float64) @ w.astype(ml_dtypes.bfloat16).astype(np.float64)).max() > 1e-3


def _gelu_tanh(y: np.ndarray) -> np.ndarray:
    y = y.astype(np.float64)
    return 0.5 * y * (1 + np.tanh(np.sqrt(2 / np.pi) * (y + 0.044715 * y ** 3)))


@pytest.mark.parametrize("m, k, n", SHAPES + [(32, 32, 32), (77, 200, 129), (40, 513, 200), (70, 3000, 130),
                                             (1057, 200, 129)])
@pytest.mark.parametrize("product", ["int8_many_integer", "bf16_tile", "f32_many"])
def test_epilogues_add_the_bias_as_a_float32_add_after_the_product_apply_the_activation_and_add_the_residual(
        m, k, n, product):
    # The bias added as the product stores y: exactly y + b, the add XLA would do after the call, in every
    # column of partial vectors, blocks and panels; then ReLU exactly, and GELU's tanh form within float32
    # roundings (large negative and positive sums included: the products' y reaches +-3 sqrt(k)); then a
    # residual [m, n] added, exactly (y + b) + r as XLA's add after it, in every row and column.
    rng = np.random.default_rng(m * k + n + 9)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    residual = (rng.standard_normal((m, n)) * 10).astype(np.float32)
    stored = {"int8_many_integer": native.pack_int8, "bf16_tile": native.pack_bfloat16, "f32_many": np.asarray}[product](w)
    if product == "bf16_tile" and not _tiles():
        _assert_refused_without_tiles("xlagen_bf16_tile_product_epilogue", x, stored, n, bias=bias, residual=residual)
        return
    y = _product(f"xlagen_{product}_product", x, stored, n)
    entry = _entry(f"xlagen_{product}_product_epilogue", *[ctypes.c_void_p] * 3, ctypes.c_int, *[ctypes.c_void_p] * 2,
                   *[ctypes.c_int] * 3)

    def run(with_bias: bool, activation: int, with_residual: bool = False) -> np.ndarray:
        out = np.full((m, n), np.nan, np.float32)
        error = entry(_p(x), _p(stored), _p(bias) if with_bias else None, activation,
                      _p(residual) if with_residual else None, _p(out), m, k, n)
        assert error is None, error
        return out

    np.testing.assert_array_equal(run(True, 0), y + bias)
    np.testing.assert_array_equal(run(False, 0), y)
    np.testing.assert_array_equal(run(True, 1), np.maximum(y + bias, 0))
    np.testing.assert_allclose(run(True, 2), _gelu_tanh(y + bias), rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(run(False, 2), _gelu_tanh(y), rtol=2e-6, atol=1e-6)
    np.testing.assert_array_equal(run(True, 0, True), (y + bias) + residual)
    np.testing.assert_array_equal(run(False, 0, True), y + residual)
    np.testing.assert_array_equal(run(True, 1, True), np.maximum(y + bias, 0) + residual)
    np.testing.assert_allclose(run(True, 2, True), _gelu_tanh(y + bias) + residual, rtol=2e-6, atol=1e-5)
    assert b"activation must be" in entry(_p(x), _p(stored), None, 3, None, _p(y), m, k, n)


@pytest.mark.parametrize("b, l, heads, d, offset, extra", [(1, 1, 1, 1, 0, 0), (2, 17, 3, 16, 48, 5),
                                                         (1, 70, 8, 64, 512, 0)])
@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("more, start", [(0, 0), (5, 0), (5, 3), (5, 5), (5, 9), (5, -2)])
def test_split_heads_lays_out_a_projection_in_heads(b, l, heads, d, offset, extra, transposed, more, start):
    # Positions past a block of 16 (17, 70), heads from a column offset of a wider projection; into an output
    # `more` positions longer, at `start` with zeros around (clamped as XLA's dynamic-update-slice: 9 -> 5, -2 -> 0).
    width = offset + heads * d + extra
    length = l + more
    rng = np.random.default_rng(b * l + d)
    x = rng.standard_normal((b, l, width)).astype(np.float32)
    shape = (b, heads, d, length) if transposed else (b, heads, length, d)
    out = np.full(shape, np.nan, np.float32)
    split = _entry("xlagen_split_heads", *[ctypes.c_void_p] * 2, *[ctypes.c_int] * 9)
    assert split(_p(x), _p(out), b, l, width, offset, heads, d, int(transposed), length, start) is None
    heads_of_x = x[:, :, offset:offset + heads * d].reshape(b, l, heads, d).transpose((0, 2, 1, 3))
    at = min(max(start, 0), more)
    expected = np.zeros((b, heads, length, d), np.float32)
    expected[:, :, at:at + l] = heads_of_x
    np.testing.assert_array_equal(out, expected.transpose((0, 1, 3, 2)) if transposed else expected)
    assert b"within width" in split(_p(x), _p(out), b, l, width, width, heads, d, 0, length, 0)
    assert b"at least l" in split(_p(x), _p(out), b, l, width, offset, heads, d, 0, l - 1, 0)


@pytest.mark.parametrize("rows, e", [(1, 2), (3, 7), (9, 16), (17, 33), (8, 768), (0, 5)])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_matches_float64_numpy(rows, e, affine):
    # Rows past a unit of 8, widths past whole vectors, without gamma and beta (OPT's elementwise_affine=False);
    # rows far from zero mean, where a one-pass variance would lose digits.
    rng = np.random.default_rng(rows * e + affine)
    x = (rng.standard_normal((rows, e)) * 3 + 20).astype(np.float32)
    gamma, beta = (rng.standard_normal(e).astype(np.float32) for _ in range(2))
    y = np.full((rows, e), np.nan, np.float32)
    norm = _entry("xlagen_layer_norm", *[ctypes.c_void_p] * 4, *[ctypes.c_int] * 2, ctypes.c_float)
    assert norm(_p(x), _p(gamma) if affine else None, _p(beta) if affine else None, _p(y), rows, e, 1e-5) is None
    x64 = x.astype(np.float64)
    expected = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
    if affine:
        expected = expected * gamma + beta
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=2e-5)
    assert b"at least 1" in norm(_p(x), None, None, _p(y), rows, 0, 1e-5)


@pytest.mark.parametrize("rows, e", [(1, 2), (3, 7), (9, 16), (17, 33), (8, 768), (0, 5)])
@pytest.mark.parametrize("scaled", [True, False])
def test_rms_norm_matches_float64_numpy(rows, e, scaled):
    # The same rows and widths as the LayerNorm's; no mean is taken off (rows far from zero mean stay so).
    rng = np.random.default_rng(rows * e + scaled + 1)
    x = (rng.standard_normal((rows, e)) * 3 + 20).astype(np.float32)
    scale = rng.standard_normal(e).astype(np.float32)
    y = np.full((rows, e), np.nan, np.float32)
    norm = _entry("xlagen_rms_norm", *[ctypes.c_void_p] * 3, *[ctypes.c_int] * 2, ctypes.c_float)
    assert norm(_p(x), _p(scale) if scaled else None, _p(y), rows, e, 1e-6) is None
    x64 = x.astype(np.float64)
    expected = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * (scale if scaled else 1)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)
    assert b"at least 1" in norm(_p(x), None, _p(y), rows, 0, 1e-6)
    assert b"epsilon" in norm(_p(x), None, _p(y), rows, e, -1.0)


@pytest.mark.parametrize("e, v, n", [(1, 1, 1), (16, 50, 7), (33, 1000, 40), (768, 5000, 3), (20, 9, 0)])
def test_lookup_takes_columns_and_clamps_ids_as_xla_gather(e, v, n):
    # Rows of the table in units of 16 (33: a unit of one); ids past either end are clamped into [0, v).
    rng = np.random.default_rng(e + v + n)
    table = rng.standard_normal((e, v)).astype(np.float32)
    ids = rng.integers(-3, v + 3, n).astype(np.int32)
    out = np.full((n, e), np.nan, np.float32)
    lookup = _entry("xlagen_lookup_columns", *[ctypes.c_void_p] * 3, *[ctypes.c_int] * 3)
    assert lookup(_p(table), _p(ids), _p(out), e, v, n) is None
    np.testing.assert_array_equal(out, table[:, np.clip(ids, 0, v - 1)].T)
    assert b"at least 1" in lookup(_p(table), _p(ids), _p(out), 0, v, n)


def test_the_bfloat16_tile_product_refuses_without_tiles_and_empty_sizes():
    y = np.full(4, np.nan, np.float32)
    entry = _entry("xlagen_bf16_tile_product", *[ctypes.c_void_p] * 3, *[ctypes.c_int] * 3)
    assert b"at least 1" in entry(_p(y), _p(y), _p(y), 0, 4, 4)
    if not _tiles():
        error = entry(_p(y), _p(y), _p(y), 1, 1, 1)
        assert error is not None and b"AMX" in error
    assert np.isnan(y).all()  # nothing written


@pytest.mark.parametrize("m, k, n", SHAPES)
def test_float32_product_matches_numpy(m, k, n):
    rng = np.random.default_rng(m * k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    y = _product("xlagen_f32_product", x, w, n)
    np.testing.assert_allclose(y, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5 * np.sqrt(k))


@pytest.mark.parametrize("m, k, n", SHAPES)
@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
def test_packed_products_match_numpy(weights, m, k, n):
    rng = np.random.default_rng(m * k + n + 1)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    if weights == "bfloat16":
        stored, used = native.pack_bfloat16(w), w.astype(ml_dtypes.bfloat16).astype(np.float64)
    else:
        step = np.abs(w).max(axis=0) / np.float32(127)
        stored, used = native.pack_int8(w), np.rint(w / step) * step.astype(np.float64)
    y = _product(f"xlagen_{'bf16' if weights == 'bfloat16' else 'int8'}_product", x, stored, n)
    np.testing.assert_allclose(y, x.astype(np.float64) @ used, rtol=1e-5, atol=1e-5 * np.sqrt(k))


def _int8_weights(w):
    """pack_int8(w), and the Q and s packed."""
    stored = native.pack_int8(w)
    return (stored, *kernel_reference.int8_parts(stored, *w.shape))


INTEGER_PRODUCTS = {"xlagen_int8_integer_product": False, "xlagen_int8_many_integer_product": True}  # : 7-bit


@pytest.mark.parametrize("name", INTEGER_PRODUCTS)
@pytest.mark.parametrize("m, k, n", SHAPES + [(4, 4, 64), (5, 6, 65), (70, 31, 130), (64, 8, 16), (3, 2, 7),
                                             (7, 40, 64), (10, 33, 96), (130, 70, 200), (77, 200, 129),
                                             (33, 129, 64), (70, 3000, 130), (33, 1700, 65), (1100, 200, 129),
                                             (1057, 1700, 65)])
def test_int8_integer_products_match_their_numpy_reference_exactly(name, m, k, n):
    rng = np.random.default_rng(m * k + n + 2)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10, (m, 1))).astype(np.float32)
    x[m // 2, :] = 0  # an all-zero row: sx = 0, y = 0
    if m > 2:
        x[m - 1] = np.abs(x[m - 1])  # one-signed rows: the zero point at an end
        x[m - 2] = -np.abs(x[m - 2])
    w = rng.standard_normal((k, n)).astype(np.float32)
    w[:, n // 2] = 0  # an all-zero column: scale 0
    stored, quantized, scales = _int8_weights(w)
    y = _product(name, x, stored, n)
    np.testing.assert_array_equal(y, kernel_reference.integer_product(x, quantized, scales, INTEGER_PRODUCTS[name]))
    assert not y[m // 2].any()


def test_the_amx_build_multiplies_on_tiles():
    # A CPU that lists amx_int8 runs a kernel whose Linux hands out the tiles' state (the flag is hidden
    # otherwise) and grants the process their state: the many-row product must not quietly fall back to vectors.
    assert native.library.amx_tiles() == (native.library.isa() == "avx512amx" and native.build.tiles_granted())


@pytest.mark.parametrize("name", INTEGER_PRODUCTS)
def test_int8_integer_products_sum_extremes_without_saturating(name):
    # Every weight +-127 and x of +-1 (8-bit: +-127; 7-bit: 0 and 126), long rows: maddubs's pairs reach
    # 2 * 127 * 127 (8-bit) and 2 * 126 * 127 (7-bit).
    k, n = 1000, 70
    x = np.where(np.arange(k) % 3 == 0, -1.0, 1.0).astype(np.float32)[None].repeat(5, 0)
    x[1] *= -1
    w = np.where((np.arange(k)[:, None] + np.arange(n)[None]) % 2 == 0, 1.0, -1.0).astype(np.float32)
    w[:, 3] = 1  # a column of +127 only: sums of one sign
    stored, quantized, scales = _int8_weights(w)
    y = _product(name, x, stored, n)
    np.testing.assert_array_equal(y, kernel_reference.integer_product(x, quantized, scales, INTEGER_PRODUCTS[name]))
    np.testing.assert_allclose(y, x.astype(np.float64) @ w, rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("name", INTEGER_PRODUCTS)
def test_int8_integer_products_of_zeros_are_zero(name):
    w = np.random.default_rng(0).standard_normal((9, 70)).astype(np.float32)
    y = _product(name, np.zeros((6, 9), np.float32), native.pack_int8(w), 70)
    assert not y.any()


@pytest.mark.parametrize("name", INTEGER_PRODUCTS)
def test_int8_integer_products_error_is_that_of_their_activations(name):
    # Against float64 x @ (Q * s): the activations' rounding error, at most half a step per element (8-bit:
    # max |x| / 127; 7-bit: (max(x, 0) - min(x, 0)) / 126).
    rng = np.random.default_rng(3)
    x = rng.standard_normal((40, 300)).astype(np.float32)
    x[:20] = np.maximum(x[:20], -0.2)  # rows skewed as after GELU
    w = rng.standard_normal((300, 100)).astype(np.float32)
    stored, quantized, scales = _int8_weights(w)
    y = _product(name, x, stored, 100)
    exact = x.astype(np.float64) @ (quantized * scales.astype(np.float64))
    if INTEGER_PRODUCTS[name]:
        step = (np.maximum(x.max(1), 0) - np.minimum(x.min(1), 0))[:, None] / 126
    else:
        step = np.abs(x).max(1, keepdims=True) / 127
    bound = (step / 2) @ np.abs(quantized * scales.astype(np.float64)).sum(0, keepdims=True)
    assert np.all(np.abs(y - exact) <= bound + 1e-4)
    assert np.abs(y - exact).max() < 0.05 * np.abs(exact).max()


@pytest.mark.parametrize("name", ["xlagen_f32_product", "xlagen_bf16_product", "xlagen_int8_product",
                                  "xlagen_int8_integer_product", "xlagen_int8_many_integer_product"])
@pytest.mark.parametrize("m, k, n", [(0, 4, 4), (1, 0, 4), (1, 4, 0), (-1, 4, 4)])
def test_products_refuse_empty_sizes(name, m, k, n):
    y = np.zeros(4, np.float32)
    error = _entry(name, *[ctypes.c_void_p] * 3, *[ctypes.c_int] * 3)(_p(y), _p(y), _p(y), m, k, n)
    assert error is not None and b"at least 1" in error
    assert not y.any()  # nothing written


@pytest.mark.parametrize("transposed", [0, 1])
@pytest.mark.parametrize("heads, t, s, d", [(1, 1, 1, 16), (2, 9, 17, 32), (1, 8, 33, 64), (3, 1, 300, 128),
                                            (2, 17, 1, 16), (2, 9, 24, 16), (1, 3, 40, 128)])
def test_attention_matches_numpy(heads, t, s, d, transposed):
    rng = np.random.default_rng(heads * t * s + d)
    q = rng.standard_normal((heads, t, d)).astype(np.float32)
    k = (3 * rng.standard_normal((heads, s, d))).astype(np.float32)
    v = rng.standard_normal((heads, s, d)).astype(np.float32)
    given = np.ascontiguousarray(k.transpose(0, 2, 1)) if transposed else k
    out = np.full((heads, t, d), np.nan, np.float32)
    attention = _entry("xlagen_attention", *[ctypes.c_void_p] * 4, *[ctypes.c_int] * 4, ctypes.c_float, ctypes.c_int)
    assert attention(_p(q), _p(given), _p(v), _p(out), heads, t, s, d, d ** -0.5, transposed) is None
    np.testing.assert_allclose(out, kernel_reference.attention(q, k, v, d ** -0.5), rtol=0, atol=2e-5)


def test_attention_refuses_head_sizes_it_has_no_code_for():
    out = np.zeros(4, np.float32)
    attention = _entry("xlagen_attention", *[ctypes.c_void_p] * 4, *[ctypes.c_int] * 4, ctypes.c_float, ctypes.c_int)
    error = attention(_p(out), _p(out), _p(out), _p(out), 1, 1, 4, 24, 1.0, 0)
    assert error is not None and b"16, 32, 64 or 128" in error and not out.any()


def _masked_attention(q, k, v, mask, heads_per_mask, scale):
    heads, t, d = q.shape
    out = np.full(q.shape, np.nan, np.float32)
    masked = _entry("xlagen_masked_attention", *[ctypes.c_void_p] * 5, *[ctypes.c_int] * 4, ctypes.c_float,
                    ctypes.c_int, ctypes.c_int)
    mask = np.ascontiguousarray(mask, np.uint8)
    error = masked(_p(q), _p(k), _p(v), _p(mask), _p(out), heads, t, k.shape[1], d, scale, heads_per_mask,
                   mask.shape[1])
    return error, out


@pytest.mark.parametrize("batch, kv_heads, groups, t, s, d, left_pad, window", [
    (1, 1, 1, 1, 1, 16, 0, None), (1, 2, 1, 9, 9, 32, 0, None), (2, 2, 1, 13, 20, 64, 3, None),
    (1, 2, 4, 17, 40, 64, 5, None), (2, 1, 2, 40, 47, 128, 0, 7), (1, 3, 1, 33, 33, 16, 32, None)])
def test_masked_attention_matches_numpy(batch, kv_heads, groups, t, s, d, left_pad, window):
    # A prompt's causal mask over a longer cache (keys past the prompt unseen), left padding (rows that see
    # no key), grouped queries (g rows of query per key/value head share the mask) and a sliding window.
    rng = np.random.default_rng(t * s + d)
    heads = batch * kv_heads
    q = rng.standard_normal((heads, groups * t, d)).astype(np.float32)
    k = (3 * rng.standard_normal((heads, s, d))).astype(np.float32)
    v = rng.standard_normal((heads, s, d)).astype(np.float32)
    rows, keys = np.arange(t)[:, None], np.arange(s)[None, :]
    mask = np.broadcast_to(keys <= rows, (batch, t, s)).copy()
    if window:
        mask &= keys > rows - window
    mask[-1, :, :left_pad] = False  # the last prompt is left-padded
    error, out = _masked_attention(q, k, v, mask, kv_heads, d ** -0.5)
    assert error is None, error
    full = np.repeat(np.tile(mask, (1, groups, 1)), kv_heads, axis=0)  # [heads, g * t, s]
    scores = np.einsum("htd,hsd->hts", q.astype(np.float64), k) * d ** -0.5
    scores = np.where(full, scores, MASK_VALUE)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    expected = np.einsum("hts,hsd->htd", weights / weights.sum(-1, keepdims=True), v)
    np.testing.assert_allclose(out, expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("t, s, d", [(13, 70, 64), (30, 37, 16), (25, 100, 128)])
def test_masked_attention_with_any_visible_keys_matches_numpy(t, s, d):
    # Masks of no pattern: each row sees keys at random (about half, some rows all, one row a single key in
    # the last vector's tail, one none), and a visible key's byte is any nonzero value, as a kernel reading
    # bytes eight or sixteen at a time must take them.
    rng = np.random.default_rng(t + s + d)
    q = rng.standard_normal((2, t, d)).astype(np.float32)
    k = (3 * rng.standard_normal((2, s, d))).astype(np.float32)
    v = rng.standard_normal((2, s, d)).astype(np.float32)
    mask = rng.random((1, t, s)) < 0.5
    mask[0, 1], mask[0, 2], mask[0, 3], mask[0, 4, -1] = True, False, False, True
    error, out = _masked_attention(q, k, v, mask.astype(np.uint8) * rng.integers(1, 256, mask.shape), 2, 0.3)
    assert error is None, error
    full = np.repeat(mask, 2, axis=0)
    scores = np.where(full, np.einsum("htd,hsd->hts", q.astype(np.float64), k) * 0.3, MASK_VALUE)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    expected = np.einsum("hts,hsd->htd", weights / weights.sum(-1, keepdims=True), v)
    np.testing.assert_allclose(out, expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("batch, heads, t, s, d, shared", [(1, 2, 9, 9, 32, True), (2, 3, 20, 20, 64, True),
                                                        (2, 2, 17, 30, 16, False)])
def test_biased_attention_matches_numpy(batch, heads, t, s, d, shared):
    # An encoder's self-attention as T5's: a padding mask of one row [B, 1, S] (the second sequence
    # padded), a bias per head and position pair (shared by the batch, or one per sequence), scale 1.
    rng = np.random.default_rng(t * s + d + batch)
    q = rng.standard_normal((batch * heads, t, d)).astype(np.float32)
    k = (3 * rng.standard_normal((batch * heads, s, d))).astype(np.float32)
    v = rng.standard_normal((batch * heads, s, d)).astype(np.float32)
    mask = np.ones((batch, 1, s), np.uint8)
    mask[-1, :, :3] = 0
    bias = (4 * rng.standard_normal(((1 if shared else batch) * heads, t, s))).astype(np.float32)
    out = np.full(q.shape, np.nan, np.float32)
    biased = _entry("xlagen_biased_attention", *[ctypes.c_void_p] * 6, *[ctypes.c_int] * 4, ctypes.c_float,
                    *[ctypes.c_int] * 3)
    error = biased(_p(q), _p(k), _p(v), _p(mask), _p(bias), _p(out), batch * heads, t, s, d, 1.0, heads, 1,
                   bias.shape[0])
    assert error is None, error
    full = np.repeat(mask.astype(bool), heads, axis=0)  # [B * H, 1, S]
    scores = np.einsum("htd,hsd->hts", q.astype(np.float64), k) + np.tile(bias, (len(q) // len(bias), 1, 1))
    scores = np.where(full, scores, MASK_VALUE)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    expected = np.einsum("hts,hsd->htd", weights / weights.sum(-1, keepdims=True), v)
    np.testing.assert_allclose(out, expected, rtol=0, atol=2e-5)
    error = biased(_p(q), _p(k), _p(v), _p(mask), _p(bias), _p(out), batch * heads, t, s, d, 1.0, heads, 1, 4 * heads)
    assert error is not None and b"bias_heads must divide heads" in error


@pytest.mark.parametrize("batch, heads, t, d, masked, biased", [(1, 1, 1, 16, False, False), (2, 3, 13, 32, True, True),
                                                            (2, 2, 30, 64, True, False), (1, 4, 9, 128, False, False),
                                                            (3, 2, 25, 16, False, True)])
def test_attention_at_reads_heads_in_place_and_writes_tokens(batch, heads, t, d, masked, biased):
    # An encoder's self-attention straight from its fused projection [B, T, 3 H D] (q, k, v one after the
    # other along the columns), its output written as [B, T, H D], the next product's input: nothing
    # transposed around the call. The columns around each head hold NaN, which no read may touch.
    rng = np.random.default_rng(batch * t + d)
    width = 3 * heads * d + 5  # and 5 columns of nothing
    projection = np.full((batch, t, width), np.nan, np.float32)
    projection[..., :3 * heads * d] = rng.standard_normal((batch, t, 3 * heads * d))
    q, k, v = (projection[..., i * heads * d:(i + 1) * heads * d].reshape(batch, t, heads, d).transpose(0, 2, 1, 3)
               for i in range(3))
    mask = np.ones((batch, 1, t), np.uint8)
    if masked:
        mask[-1, :, :min(3, t - 1)] = 0
    bias = (4 * rng.standard_normal((heads, t, t))).astype(np.float32) if biased else None
    out = np.full((batch, t, heads * d + 3), np.nan, np.float32)  # rows of 3 more columns, left as they are
    layout = np.array([0, t * width, d, width,  # q
                       heads * d, t * width, d, width,  # k
                       2 * heads * d, t * width, d, width,  # v
                       0, t * out.shape[2], d, out.shape[2]], np.int32)  # out
    at = _entry("xlagen_attention_at", *[ctypes.c_void_p] * 6, *[ctypes.c_int] * 4, ctypes.c_float,
                *[ctypes.c_int] * 3, ctypes.c_void_p)
    error = at(*(_p(a) for a in (projection, projection, projection)), _p(mask) if masked else None,
               _p(bias) if biased else None, _p(out), batch * heads, t, t, d, 0.5, heads, 1, heads, _p(layout))
    assert error is None, error
    scores = np.einsum("bhtd,bhsd->bhts", q.astype(np.float64), k) * 0.5 + (0 if bias is None else bias)
    scores = np.where(mask[:, None].astype(bool), scores, MASK_VALUE)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    expected = np.einsum("bhts,bhsd->bhtd", weights / weights.sum(-1, keepdims=True), v)
    np.testing.assert_allclose(out[..., :heads * d], expected.transpose(0, 2, 1, 3).reshape(batch, t, heads * d),
                               rtol=0, atol=2e-5)
    assert np.isnan(out[..., heads * d:]).all()
    layout[5] = -1
    error = at(*(_p(a) for a in (projection, projection, projection)), None, None, _p(out), batch * heads, t, t, d,
               0.5, heads, 1, 1, _p(layout))
    assert error is not None and b"at least 0" in error


def test_masked_attention_refuses_a_mask_it_cannot_share():
    out = np.zeros((4, 4, 16), np.float32)
    error, _ = _masked_attention(out, out, out, np.ones((3, 4, 4), bool), 3, 1.0)  # 4 heads, 3 per mask
    assert error is not None and b"heads_per_mask" in error


def _step_attention(q, keys, values, key, value, bias, scale, mask_value=MASK_VALUE, d=None):
    groups, heads, queries, head_dim = q.shape
    d = head_dim if d is None else d
    out = np.full(q.shape, np.nan, np.float32)
    step = _entry("xlagen_step_attention", *[ctypes.c_void_p] * 7, *[ctypes.c_int] * 6, ctypes.c_float,
                  ctypes.c_float)
    error = step(*(_p(t) for t in (q, keys, values, key, value, bias, out)), groups, heads, queries,
                 keys.shape[2], d, bias.shape[1], scale, mask_value)
    return error, out


@pytest.mark.parametrize("groups, heads, queries, s, d, bias_heads", [
    (1, 1, 1, 0, 1, 1), (1, 1, 1, 1, 16, 1), (2, 3, 2, 15, 17, 3), (1, 2, 1, 16, 33, 1), (3, 1, 4, 31, 256, 1),
    (2, 4, 1, 600, 64, 4), (1, 2, 2, 24, 8, 1), (2, 1, 3, 8, 40, 1), (1, 1, 1, 3, 24, 1)])
def test_step_attention_matches_numpy(groups, heads, queries, s, d, bias_heads):
    # An empty cache (only the new key), head sizes 1 and odd, the largest head size, and a step big enough
    # for the pool; a third of the cache keys masked.
    rng = np.random.default_rng(groups * 100 + s + d)
    q = rng.standard_normal((groups, heads, queries, d)).astype(np.float32)
    keys, values = (rng.standard_normal((groups, heads, s, d)).astype(np.float32) for _ in range(2))
    key, value = (rng.standard_normal((groups, heads, queries, d)).astype(np.float32) for _ in range(2))
    bias = rng.standard_normal((groups, bias_heads, queries, s + 1)).astype(np.float32)
    bias[..., :-1][rng.random((groups, bias_heads, queries, s)) < 1 / 3] = -np.inf
    error, out = _step_attention(q, keys, values, key, value, bias, 0.3)
    assert error is None, error
    expected = kernel_reference.step_attention(q, keys, values, key, value, bias, 0.3, MASK_VALUE)
    np.testing.assert_allclose(out, expected, rtol=0, atol=2e-5)


def test_step_attention_uses_the_mask_value_it_is_given():
    # Every key masked: each score is the mask value, so the weights are uniform over cache and new key.
    q = np.ones((1, 1, 1, 4), np.float32)
    keys = values = np.arange(12, dtype=np.float32).reshape(1, 1, 3, 4)
    key = value = np.full((1, 1, 1, 4), 100.0, np.float32)
    bias = np.full((1, 1, 1, 4), -np.inf, np.float32)
    error, out = _step_attention(q, keys, values, key, value, bias, 1.0, mask_value=-5.0)
    assert error is None
    np.testing.assert_allclose(out[0, 0, 0], (values[0, 0].sum(0) + value[0, 0, 0]) / 4, rtol=1e-6)


@pytest.mark.parametrize("d, bias_heads, message", [(0, 1, b"1 to 256"), (257, 1, b"1 to 256"),
                                                    (16, 2, b"bias_heads")])
def test_step_attention_refuses_what_it_cannot_run(d, bias_heads, message):
    q = np.zeros((1, 3, 1, max(d, 1)), np.float32)
    bias = np.zeros((1, bias_heads, 1, 2), np.float32)
    error, out = _step_attention(q, q, q, q, q, bias, 1.0, d=d)
    assert error is not None and message in error
    assert np.isnan(out).all()  # nothing written


@pytest.mark.parametrize("groups, queries, heads, d, length, embed", [
    (1, 1, 1, 16, 1, 64), (2, 1, 7, 16, 5, 64), (1, 3, 2, 32, 257, 128), (3, 1, 6, 64, 300, 384),
    (1, 2, 1, 128, 33, 192), (1, 1, 3, 32, 24, 64)])
def test_memory_attention_matches_numpy(groups, queries, heads, d, length, embed):
    query, states, kv_kernel, kv_bias = kernel_reference.memory_inputs(groups, queries, heads, d, length, embed,
                                                                       seed=length + embed)
    width, scale = heads * d, d ** -0.5
    key_kernel_t = np.ascontiguousarray(kv_kernel[:, :width].T)
    out = np.full((groups, queries, width), np.nan, np.float32)
    memory = _entry("xlagen_memory_attention", *[ctypes.c_void_p] * 6, *[ctypes.c_int] * 6, ctypes.c_float)
    error = memory(*(_p(t) for t in (query, states, key_kernel_t, kv_kernel, kv_bias, out)), groups, queries, heads,
                   d, length, embed, scale)
    assert error is None, error
    expected = kernel_reference.memory_attention(query, states, kv_kernel, kv_bias, heads, scale)
    np.testing.assert_allclose(out, expected, rtol=0, atol=3e-5 * np.abs(expected).max())


def test_memory_attention_refuses_widths_it_has_no_code_for():
    out = np.zeros(4, np.float32)
    memory = _entry("xlagen_memory_attention", *[ctypes.c_void_p] * 6, *[ctypes.c_int] * 6, ctypes.c_float)
    for d, embed, message in [(16, 96, b"multiple of 64"), (24, 64, b"16, 32, 64 or 128")]:
        error = memory(*[_p(out)] * 6, 1, 1, 1, d, 4, embed, 1.0)
        assert error is not None and message in error and not out.any()


@pytest.mark.parametrize("rows, n", [(0, 5), (1, 1), (1, 15), (3, 16), (2, 17), (5, 1000), (1, 8), (3, 24), (2, 40)])
def test_argmax_matches_numpy(rows, n):
    x = np.random.default_rng(rows * n).standard_normal((rows, n)).astype(np.float32)
    out = np.full(rows, -1, np.int32)
    assert _entry("xlagen_argmax", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int)(
        _p(x), _p(out), rows, n) is None
    np.testing.assert_array_equal(out, x.argmax(-1))


def test_argmax_takes_the_first_of_equal_maxima_across_lanes():
    # The largest value at indices that fall in different lanes and vectors, and after the tail's start.
    x = np.zeros((4, 41), np.float32)
    x[0, [3, 11, 27]] = 5.0
    x[1, [19, 35]] = 5.0
    x[2, [40]] = 5.0
    x[3] = -np.inf
    out = np.full(4, -1, np.int32)
    assert _entry("xlagen_argmax", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int)(
        _p(x), _p(out), 4, 41) is None
    np.testing.assert_array_equal(out, [3, 19, 40, 0])


def test_argmax_refuses_an_empty_row():
    out = np.full(1, -1, np.int32)
    error = _entry("xlagen_argmax", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int)(
        _p(out), _p(out), 1, 0)
    assert error is not None and b"n at least 1" in error and out[0] == -1


def test_constants_come_from_the_library_and_match_the_packing():
    assert native.PANEL == native.constant("panel") == 32
    assert native.INT8_PANEL == native.constant("int8_panel") == 64
    assert native.STEP_ATTENTION_MAX_HEAD_DIM == native.constant("step_attention_max_head_dim")
    assert native.constant("lanes") == {"avx512amx": 16, "avx512vnni": 16, "avx512": 16, "avx2": 8}[native.library.isa()]  # the build for this CPU
    lanes = ctypes.c_long()
    function = _library().xlagen_constant
    function.argtypes, function.restype = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_long)], ctypes.c_int
    assert function(b"lanes", ctypes.byref(lanes))
    assert lanes.value == {"avx512amx": 16, "avx512vnni": 16, "avx512": 16, "avx2": 8}[_build["isa"]]  # the build tested
    assert native.pack_bfloat16(np.ones((3, 5), np.float32)).shape == (1, 3, native.PANEL // 2)
    assert native.pack_int8(np.ones((3, 5), np.float32)).shape == (1, 3 + 4, native.INT8_PANEL)
    with pytest.raises(KeyError, match="no constant 'nonsense'"):
        native.constant("nonsense")


def test_the_kernels_need_no_tensorflow():
    code = ("import sys, numpy as np; from xlagen import native; native.constant('panel'); "
            "native.pack_int8(np.ones((2, 2), np.float32)); assert 'tensorflow' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
