"""xlagen.native: the packed-weight matrix products (XLA custom calls) and models that use them.

The bfloat16 kernel must compute exactly `x @ float32(bfloat16(W))`, the int8 one `x @ (Q * s)` for the
column-wise quantized Q and scales s (up to float32 rounding): checked against float64 numpy on weights
rounded or quantized here, independently of the packing code, against the unpacking fallback, and end to
end against the same model whose float32 weights were rounded or quantized beforehand (tokens equal,
scores equal to float32 rounding).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import kernel_reference
from conftest import random_ids, requires_kernels, tiny_family_model
from kernel_reference import memory_inputs
from xlagen import native
from xlagen.layers.attention import MASK_VALUE

pytestmark = requires_kernels


def _rounded(w: np.ndarray) -> np.ndarray:
    return w.astype(ml_dtypes.bfloat16).astype(np.float32)


def _quantized(w: np.ndarray) -> np.ndarray:
    """Each column to int8 steps of max |column| / 127, back in float32 (the weights an int8 layer uses)."""
    step = np.abs(w).max(axis=0) / np.float32(127)
    return (np.rint(w / np.where(step > 0, step, 1)) * step).astype(np.float32)


# Packed weights multiplied in float32 at every row count: the packed products compute x @ (Q * s) for int8,
# x @ float32(W) for bfloat16 (no rounding of x to bfloat16 on AMX's tiles)
FLOAT_INT8 = native.Kernels(int8_integer_min_rows=None, int8_many_integer_min_rows=None, bfloat16_tiles=False)

# weight dtype -> (what the layer multiplies by, the packing function, the custom-call target)
FORMATS = {"bfloat16": (_rounded, native.pack_bfloat16, native.TARGET),
           "int8": (_quantized, native.pack_int8, native.INT8_TARGET)}


def _xla(function, *args):
    return tf.function(function, jit_compile=True)(*args).numpy()


def test_packing_rounds_to_nearest_even_and_unpacks_exactly():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((5, 70)).astype(np.float32)
    # Ties: 1 + 2^-8 lies halfway between two bfloat16 values and rounds to the even one (1.0).
    w[0, :3] = [1 + 2 ** -8, 1 + 3 * 2 ** -8, -0.0]
    words = native.pack_bfloat16(w)
    assert words.shape == (3, 5, 16) and words.dtype == np.int32  # ceil(70 / 32) panels
    unpacked = native.unpack(tf.constant(words), 70).numpy()
    np.testing.assert_array_equal(unpacked, _rounded(w))
    assert unpacked[0, 0] == 1.0 and unpacked[0, 1] == 1 + 4 * 2 ** -8
    assert np.signbit(unpacked[0, 2])


def test_int8_packing_quantizes_each_column_with_its_own_scale():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((5, 70)).astype(np.float32) * np.linspace(0.01, 3, 70, dtype=np.float32)
    w[:, 7] = 0  # an all-zero column: scale 0, weights 0
    w[0, 8], w[1, 8] = 2.0, -2.0  # both ends of a column reach +-127
    packed = native.pack_int8(w)
    assert packed.shape == (2, 5 + 4, 64) and packed.dtype == np.int8  # ceil(70 / 64) panels, 4 rows of scales
    unpacked = native.unpack(tf.constant(packed), 70).numpy()
    np.testing.assert_allclose(unpacked, _quantized(w), rtol=1e-6, atol=0)
    step = np.abs(w).max(axis=0) / 127
    assert np.all(np.abs(unpacked - w) <= step / 2 * (1 + 1e-5))
    assert not unpacked[:, 7].any() and packed[0, :5, 7].tolist() == [0] * 5
    assert packed[0, 0, 8] == 127 and packed[0, 1, 8] == -127
    assert not packed[1, :5, 70 - 64:].any()  # columns past N are zero, with zero scales
    assert not packed[1, 5:, 4 * (70 - 64):].any()


@pytest.mark.parametrize("weight_dtype", list(FORMATS))
@pytest.mark.parametrize("rows,k,n", [(1, 768, 2304), (1, 64, 50), (3, 37, 19), (8, 96, 1000), (9, 40, 70),
                                      (16, 256, 33), (32, 300, 100)])
def test_kernel_computes_x_times_rounded_weights(rows, k, n, weight_dtype):
    weights_of, pack, _ = FORMATS[weight_dtype]
    rng = np.random.default_rng(rows + k + n)
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    words = tf.constant(pack(w))
    reference = x.astype(np.float64) @ weights_of(w).astype(np.float64)
    with native.tracing(FLOAT_INT8):
        compiled = _xla(lambda x: native.matmul(x, words, n), x)
    eager = native.matmul(x, words, n).numpy()  # the fallback: unpack + tf.matmul
    scale = np.abs(reference).max()
    assert compiled.shape == (rows, n)
    np.testing.assert_allclose(compiled, reference, atol=2e-6 * scale * np.sqrt(k), rtol=0)
    np.testing.assert_allclose(eager, reference, atol=2e-6 * scale * np.sqrt(k), rtol=0)


@pytest.mark.parametrize("rows,k,n", [(4, 768, 2304), (9, 40, 70), (23, 33, 130), (24, 33, 130), (100, 33, 130)])
def test_int8_products_of_many_rows_run_in_integers(rows, k, n):
    # 8-bit activations from Kernels.int8_integer_min_rows rows, 7-bit from int8_many_integer_min_rows (24, or 8
    # where the kernels run on AMX's tiles).
    rng = np.random.default_rng(rows + k)
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    packed = native.pack_int8(w)
    quantized, scales = kernel_reference.int8_parts(packed, k, n)
    words = tf.constant(packed)
    function = tf.function(lambda x: native.matmul(x, words, n), jit_compile=True)
    seven = rows >= native.Kernels().int8_many_integer_min_rows
    hlo = function.experimental_get_compiler_ir(x)(stage="optimized_hlo")
    for target, expected in ((native.INT8_MANY_INTEGER_TARGET, seven), (native.INT8_INTEGER_TARGET, not seven)):
        assert (f'custom_call_target="{target}"' in hlo) == expected
    np.testing.assert_array_equal(function(x).numpy(), kernel_reference.integer_product(x, quantized, scales, seven))


def _epilogue_products(weight_dtype: str, rows: int) -> tuple:
    """(kernels, fused) for the epilogue tests: a policy under which `rows` rows of x take the many-row products
    with an epilogue (the 7-bit int8, the bfloat16 tiles where AMX runs them, the float32 one), and whether they
    do at this many rows."""
    kernels = native.Kernels(int8_many_integer_min_rows=8, bfloat16_tiles=None if native.amx_tiles() else False,
                             float32_many_rows=True)
    return kernels, rows == 40 and (weight_dtype != "bfloat16" or native.amx_tiles())


def _compiled_in_prompt_pass(function):
    """`function` compiled by XLA and traced as a generation's prompt pass (where float32 weights take the
    kernels)."""
    def traced(x):
        with native.prefill():
            return function(x)
    return tf.function(traced, jit_compile=True)


@pytest.mark.parametrize("weight_dtype", ["int8", "bfloat16", "float32"])
@pytest.mark.parametrize("rows", [4, 40])
def test_a_bias_and_an_activation_are_applied_by_the_many_row_products_and_after_the_others(weight_dtype, rows):
    # `matmul(..., bias=b)` is x @ W - (-b) bit for bit: the 7-bit int8 product, the bfloat16 tiles and the
    # float32 many-row product (a prompt pass's) add b as they store y (their epilogue call, nothing after it);
    # the products of 4 rows leave the add to XLA, and `projection` then returns None (the caller applies the
    # activation). The epilogue's ReLU is exact, its GELU within float32 roundings of the formula's.
    from xlagen.layers.feedforward import ACTIVATIONS

    rng = np.random.default_rng(rows)
    k, n = 70, 130
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    bias = tf.constant(rng.standard_normal(n).astype(np.float32))
    words = tf.constant({"int8": native.pack_int8, "bfloat16": native.pack_bfloat16, "float32": np.asarray}[weight_dtype](w))
    kernels, fused = _epilogue_products(weight_dtype, rows)
    compiled = _compiled_in_prompt_pass

    def product(x, bias=None):
        if weight_dtype == "float32":
            return native.matmul_float32(x, words, bias=bias)
        return native.matmul(x, words, n, bias=bias)

    with native.tracing(kernels):
        biased = compiled(lambda x: product(x, bias))
        plain = compiled(lambda x: product(x) - (-bias))
        hlo = biased.experimental_get_compiler_ir(x)(stage="optimized_hlo")
        np.testing.assert_array_equal(biased(x).numpy(), plain(x).numpy())
        for name in ("relu", "gelu_new"):
            projected = compiled(lambda x: native.projection(x, words, n, bias, name))
            if not fused:
                left = compiled(lambda x: native.projection(x, words, n, bias, name) is None)
                assert left(x)
                continue
            expected = ACTIVATIONS[name](plain(x)).numpy()
            if name == "relu":
                np.testing.assert_array_equal(projected(x).numpy(), expected)
            else:
                np.testing.assert_allclose(projected(x).numpy(), expected, rtol=1e-5, atol=1e-6)
        assert native.projection(tf.constant(x), words, n, bias, "silu") is None  # no epilogue for it
    assert any(f'custom_call_target="{target}"' in hlo for target in native.ops.EPILOGUE_TARGETS.values()) == fused


@pytest.mark.parametrize("weight_dtype", ["int8", "bfloat16", "float32"])
@pytest.mark.parametrize("rows", [4, 40])
@pytest.mark.parametrize("with_bias", [True, False])
def test_a_residual_is_added_by_the_many_row_products_and_after_the_others(weight_dtype, rows, with_bias):
    # `matmul(..., residual=r)` is (x @ W - (-b)) + r bit for bit: the many-row products with an epilogue add r
    # as they store y (their epilogue call has the residual as its last operand, and nothing adds after it);
    # the products of 4 rows leave both adds to XLA. A residual of another shape than y's is refused.
    rng = np.random.default_rng(rows + 3)
    k, n = 70, 130
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = rng.standard_normal((2, rows // 2, k)).astype(np.float32)
    residual = tf.constant((rng.standard_normal((2, rows // 2, n)) * 10).astype(np.float32))
    bias = tf.constant(rng.standard_normal(n).astype(np.float32)) if with_bias else None
    words = tf.constant({"int8": native.pack_int8, "bfloat16": native.pack_bfloat16, "float32": np.asarray}[weight_dtype](w))
    kernels, fused = _epilogue_products(weight_dtype, rows)
    compiled = _compiled_in_prompt_pass

    def product(x, **options):
        if weight_dtype == "float32":
            return native.matmul_float32(x, words, bias=bias, **options)
        return native.matmul(x, words, n, bias=bias, **options)

    with native.tracing(kernels):
        summed = compiled(lambda x: product(x, residual=residual))
        plain = compiled(lambda x: product(x) + residual)
        np.testing.assert_array_equal(summed(x).numpy(), plain(x).numpy())
        hlo = summed.experimental_get_compiler_ir(x)(stage="optimized_hlo")
        with pytest.raises(ValueError, match="the residual must be float32"):
            compiled(lambda x: product(x, residual=residual[:, :1]))(x)
    config = f'backend_config="{rows},{k},{n},{int(with_bias)},0,1"'
    assert (config in hlo) == fused
    assert ("add(" in hlo or "subtract(" in hlo) != fused


@pytest.mark.parametrize("weight_dtype", list(FORMATS))
def test_kernel_runs_as_a_custom_call_for_few_rows_and_inside_loops(weight_dtype):
    with native.tracing(FLOAT_INT8):
        _check_custom_call_for_few_rows_and_inside_loops(weight_dtype)


def _check_custom_call_for_few_rows_and_inside_loops(weight_dtype):
    _, pack, target = FORMATS[weight_dtype]
    rng = np.random.default_rng(1)
    words = tf.constant(pack(rng.standard_normal((32, 48)).astype(np.float32)))

    def hlo(rows):
        function = tf.function(lambda x: native.matmul(x, words, 48), jit_compile=True)
        return function.experimental_get_compiler_ir(tf.zeros((rows, 32)))(stage="optimized_hlo")

    most = native.Kernels().packed_max_rows
    assert f'custom_call_target="{target}"' in hlo(most)
    assert target not in hlo(most + 1)
    with native.tracing(native.Kernels.OFF):
        assert target not in hlo(most)
    # In a decoding step the kernel runs whatever the rows: unpacking there would repeat every iteration.
    x = rng.standard_normal((most + 8, 32)).astype(np.float32)

    def step(i, y):
        with native.decoding_step():
            return i + 1, y + native.matmul(x, words, 48)

    def loop(x):
        return tf.while_loop(lambda i, y: i < 2, step, (0, tf.zeros((x.shape[0], 48))))[1]

    looped = tf.function(loop, jit_compile=True)
    assert f'custom_call_target="{target}"' in looped.experimental_get_compiler_ir(x)(stage="optimized_hlo")
    np.testing.assert_allclose(looped(x).numpy(), 2 * (x @ native.unpack(words, 48).numpy()), rtol=1e-5, atol=1e-4)
    # Leading axes are flattened into rows: [2, 3, K] is 6 rows.
    x = rng.standard_normal((2, 3, 32)).astype(np.float32)
    expected = x @ native.unpack(words, 48).numpy()
    np.testing.assert_allclose(_xla(lambda x: native.matmul(x, words, 48), x), expected, atol=1e-5)


@pytest.mark.parametrize("weight_dtype", list(FORMATS))
def test_concurrent_products_from_two_threads_are_each_right(weight_dtype):
    """The pool runs one product at a time; a call that finds it busy computes on its own thread."""
    weights_of, pack, _ = FORMATS[weight_dtype]
    rng = np.random.default_rng(2)
    w = rng.standard_normal((512, 4096)).astype(np.float32)
    words = tf.constant(pack(w))
    function = tf.function(lambda x: tf.stack([native.matmul(x + float(i), words, 4096) for i in range(4)]),
                           jit_compile=True)
    inputs = [rng.standard_normal((2, 512)).astype(np.float32) for _ in range(4)]
    expected = [np.stack([(x + i) @ weights_of(w) for i in range(4)]) for x in inputs]
    function(inputs[0])  # compile once
    results, errors = [None] * 4, []

    def work(index):
        try:
            for _ in range(20):
                results[index] = function(inputs[index]).numpy()
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for result, reference in zip(results, expected):
        np.testing.assert_allclose(result, reference, rtol=1e-4, atol=1e-3)


def test_matmul_refuses_non_float32_activations():
    for pack in (native.pack_bfloat16, native.pack_int8):
        words = tf.constant(pack(np.ones((4, 4), np.float32)))
        with pytest.raises(TypeError, match="float32"):
            native.matmul(tf.ones((1, 4), tf.bfloat16), words, 4)


def test_pack_tensor_refuses_unknown_formats():
    with pytest.raises(ValueError, match="int8"):
        native.pack_tensor(np.ones((4, 4), np.float32), "int4")


# ----------------------------------------------------------------------------- models

def _round_kernels(model, weight_dtype: str) -> None:
    from xlagen.layers.dense import Dense
    from xlagen.layers.embeddings import TokenEmbedding

    weights_of = FORMATS[weight_dtype][0]
    for layer in model._flatten_layers():
        if isinstance(layer, (Dense, TokenEmbedding)):
            layer.kernel.assign(weights_of(layer.kernel.numpy()))


def _pair(load, weight_dtype: str = "bfloat16"):
    """(packed model, float32 model with the same bfloat16-rounded or int8-quantized weights)."""
    packed, reference = load(), load()
    for model in (packed, reference):
        _round_kernels(model, weight_dtype)
    packed.pack_weights(weight_dtype)
    assert packed.weight_dtype == weight_dtype
    return packed, reference


def _generate(model, inputs: dict, **options):
    function = tf.function(lambda inputs: model.generate(**inputs, output_scores=True, return_dict_in_generate=True,
                                                         **options), jit_compile=True)
    return function(inputs)


def _assert_same_outputs(a, b):
    """Two generate outputs (with scores): the same tokens, the same infinite scores, the rest within 1e-4."""
    np.testing.assert_array_equal(a.sequences.numpy(), b.sequences.numpy())
    for x, y in zip(a.scores, b.scores):
        finite = np.isfinite(y.numpy())
        np.testing.assert_array_equal(np.isfinite(x.numpy()), finite)
        np.testing.assert_allclose(x.numpy()[finite], y.numpy()[finite], atol=1e-4, rtol=1e-5)


def _assert_same_generation(packed, reference, inputs: dict, **options):
    with native.tracing(FLOAT_INT8):  # int8: x @ (Q * s), as the reference computes
        _check_same_generation(packed, reference, inputs, **options)


def _check_same_generation(packed, reference, inputs: dict, **options):
    _assert_same_outputs(_generate(packed, inputs, **options), _generate(reference, inputs, **options))
    program = tf.function(lambda inputs: packed.generate(**inputs, **options), jit_compile=True)
    hlo = program.experimental_get_compiler_ir(inputs)(stage="optimized_hlo")
    target = FORMATS[packed.weight_dtype][2]
    assert f'custom_call_target="{target}"' in hlo  # the packed model really uses the kernel


@pytest.mark.parametrize("weight_dtype", list(FORMATS))
@pytest.mark.parametrize("options", [{"max_new_tokens": 10}, {"max_new_tokens": 8, "num_beams": 3},
                                     {"max_new_tokens": 6, "num_beams": 6}])
def test_gpt2_with_packed_weights_generates_as_float32_with_rounded_weights(gpt2_checkpoint, options,
                                                                          weight_dtype):
    from xlagen import TFAutoModelForCausalLM

    packed, reference = _pair(lambda: TFAutoModelForCausalLM.from_pretrained(gpt2_checkpoint[0]), weight_dtype)
    ids = random_ids((2, 7), 300, seed=3)
    mask = np.ones_like(ids)
    mask[1, :3] = 0  # left padding
    _assert_same_generation(packed, reference, {"input_ids": ids, "attention_mask": mask}, **options)
    # Eager calls (the unpacking fallback) give the same logits.
    np.testing.assert_allclose(packed(ids).logits.numpy(), reference(ids).logits.numpy(), atol=1e-4)


@pytest.mark.parametrize("bits", [8, 7])
def test_gpt2_int8_in_integers_stays_close_to_float32_compute(gpt2_checkpoint, bits):
    # A prompt of 2 x 7 rows runs an int8 x int8 product: 8-bit activations from int8_integer_min_rows (4),
    # 7-bit ones with a zero point from int8_many_integer_min_rows (here 8); the same model under FLOAT_INT8
    # multiplies x @ (Q * s). The activations' rounding moves the logits a little, the ranking of the clear
    # winners not at all.
    from xlagen import TFAutoModelForCausalLM

    model = TFAutoModelForCausalLM.from_pretrained(gpt2_checkpoint[0], weight_dtype="int8")
    ids = tf.constant(random_ids((2, 7), 300, seed=3))
    integer = native.Kernels(int8_many_integer_min_rows=None if bits == 8 else 8)
    target = native.INT8_INTEGER_TARGET if bits == 8 else native.INT8_MANY_INTEGER_TARGET
    programs = {}
    for name, kernels in (("integer", integer), ("float", FLOAT_INT8)):
        with native.tracing(kernels):
            programs[name] = tf.function(lambda ids: model(ids).logits, jit_compile=True)
            hlo = programs[name].experimental_get_compiler_ir(ids)(stage="optimized_hlo")
        assert (f'custom_call_target="{target}"' in hlo) == (name == "integer")
    integer, expected = programs["integer"](ids).numpy(), programs["float"](ids).numpy()
    assert 0 < np.abs(integer - expected).max() < 0.02 * np.ptp(expected)
    top = np.sort(expected, -1)
    clear = top[..., -1] - top[..., -2] > 0.05 * np.ptp(expected)
    assert clear.any()
    np.testing.assert_array_equal(integer.argmax(-1)[clear], expected.argmax(-1)[clear])


@pytest.mark.parametrize("variant,weight_dtype", [("projected_pre_norm", "bfloat16"), ("untied_head", "bfloat16"),
                                                  ("untied_head", "int8")])
def test_opt_with_packed_weights_generates_as_float32_with_rounded_weights(tmp_path, variant, weight_dtype):
    from models.test_opt import VARIANTS, save_tiny_opt
    from xlagen import TFAutoModelForCausalLM

    save_tiny_opt(tmp_path, **VARIANTS[variant])  # project_in / project_out, or an untied LM head
    packed, reference = _pair(lambda: TFAutoModelForCausalLM.from_pretrained(tmp_path), weight_dtype)
    ids = random_ids((2, 6), 50, seed=4)
    _assert_same_generation(packed, reference, {"input_ids": ids, "attention_mask": np.ones_like(ids)},
                            max_new_tokens=8, num_beams=2)


# T5 v1.0: a tied and rescaled head; v1.1: untied, gated MLP.
@pytest.mark.parametrize("variant,weight_dtype", [("v1_0", "bfloat16"), ("v1_1", "bfloat16"), ("v1_0", "int8")])
def test_t5_with_packed_weights_generates_as_float32_with_rounded_weights(tmp_path, variant, weight_dtype):
    from models.test_t5 import save_tiny_t5
    from xlagen import TFAutoModelForSeq2SeqLM

    save_tiny_t5(tmp_path, variant)
    packed, reference = _pair(lambda: TFAutoModelForSeq2SeqLM.from_pretrained(tmp_path), weight_dtype)
    ids = random_ids((2, 6), 50, seed=5)
    _assert_same_generation(packed, reference, {"input_ids": ids, "attention_mask": np.ones_like(ids)},
                            max_new_tokens=8)


@pytest.mark.parametrize("weight_dtype", list(FORMATS))
def test_whisper_with_packed_weights_generates_as_float32_with_rounded_weights(tmp_path, weight_dtype):
    from models.test_whisper import save_tiny_whisper
    from xlagen import TFWhisperForConditionalGeneration

    save_tiny_whisper(tmp_path)
    packed, reference = _pair(lambda: TFWhisperForConditionalGeneration.from_pretrained(tmp_path), weight_dtype)
    features = np.random.default_rng(6).standard_normal((1, packed.config.num_mel_bins, 3000)).astype(np.float32)
    _assert_same_generation(packed, reference, {"input_features": features}, max_new_tokens=6, num_beams=2)


def test_weight_dtype_at_load_time(gpt2_checkpoint):
    from xlagen import TFAutoModelForCausalLM

    for weight_dtype in ("bfloat16", "int8"):
        model = TFAutoModelForCausalLM.from_pretrained(gpt2_checkpoint[0], weight_dtype=weight_dtype)
        assert model.packed_weights and not model.trainable and model.weight_dtype == weight_dtype
        with pytest.raises(ValueError, match=f"already packed as {weight_dtype}"):
            model.pack_weights()
    full = TFAutoModelForCausalLM.from_pretrained(gpt2_checkpoint[0], weight_dtype="float32")
    assert not full.packed_weights and full.weight_dtype == "float32"
    with pytest.raises(ValueError, match="weight_dtype must be"):
        TFAutoModelForCausalLM.from_pretrained(gpt2_checkpoint[0], weight_dtype="int4")


def test_packing_needs_a_float32_model(gpt2_checkpoint):
    from xlagen import TFAutoModelForCausalLM

    model = TFAutoModelForCausalLM.from_pretrained(gpt2_checkpoint[0], dtype="bfloat16")
    with pytest.raises(ValueError, match="float32 model"):
        model.pack_weights()


def test_packed_models_are_not_exported(gpt2_checkpoint, tmp_path):
    from xlagen import TFAutoModelForCausalLM
    from xlagen.deploy.aot import aot_compile
    from xlagen.deploy.export import export_saved_model

    model = TFAutoModelForCausalLM.from_pretrained(gpt2_checkpoint[0], weight_dtype="bfloat16")
    with pytest.raises(ValueError, match="native kernel"):
        export_saved_model(model, tmp_path / "saved")
    with pytest.raises(ValueError, match="native kernel"):
        aot_compile(model, tmp_path / "aot", prompt_length=4, max_new_tokens=2)
    assert not (tmp_path / "saved").exists() or not any((tmp_path / "saved").iterdir())


def test_save_pretrained_of_a_packed_model_writes_the_float32_weights(gpt2_checkpoint, tmp_path):
    from xlagen import TFAutoModelForCausalLM

    model = TFAutoModelForCausalLM.from_pretrained(gpt2_checkpoint[0], weight_dtype="bfloat16")
    model.save_pretrained(tmp_path)
    again = TFAutoModelForCausalLM.from_pretrained(tmp_path)
    ids = random_ids((1, 5), 300)
    np.testing.assert_array_equal(again(ids).logits.numpy(),
                                  TFAutoModelForCausalLM.from_pretrained(gpt2_checkpoint[0])(ids).logits.numpy())


def test_unavailable_reason_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(native.library.platform, "machine", lambda: "aarch64")
    assert "x86-64" in native.unavailable_reason()
    monkeypatch.undo()
    monkeypatch.setattr(native.library, "_compiler", lambda: None)
    assert "C++ compiler" in native.unavailable_reason()


@pytest.mark.parametrize("weight_dtype", list(FORMATS))
def test_cli_generate_with_packed_weights_matches_the_api(gpt2_checkpoint, capsys, weight_dtype):
    from xlagen import AutoTokenizer, TFAutoModelForCausalLM
    from xlagen.cli.__main__ import main

    prompts = ["Hello world", "XLA compiles"]
    code = main(["generate", "--model", gpt2_checkpoint[0], *prompts, "--max-new-tokens", "5",
                 "--weight-dtype", weight_dtype])
    out, err = capsys.readouterr()
    assert code == 0, err
    model = TFAutoModelForCausalLM.from_pretrained(gpt2_checkpoint[0], weight_dtype=weight_dtype)
    tokenizer = AutoTokenizer.from_pretrained(gpt2_checkpoint[0], padding_side="left", pad_token="<|endoftext|>")
    encoding = tokenizer(prompts, padding=True, pad_to_multiple_of=8, return_tensors="tf")
    program = tf.function(lambda inputs: model.generate(**inputs, max_new_tokens=5), jit_compile=True)
    sequences = program(dict(encoding))
    new = tokenizer.batch_decode(sequences[:, encoding["input_ids"].shape[1]:], skip_special_tokens=True)
    assert out == "---\n".join(p + c + "\n" for p, c in zip(prompts, new))  # as tests/test_cli.py


def test_bench_measures_packed_weights_beside_float32(tmp_path):
    import json

    from xlagen.cli.__main__ import main

    code = main(["bench", "--tiny", "--quiet", "--modes", "xla", "--strategies", "greedy", "--dtype", "float32",
                 "bfloat16-weights", "int8-weights", "--output-dir", str(tmp_path), "--name", "packed", "--no-plot"])
    assert code == 0
    report = json.loads((tmp_path / "packed.json").read_text())
    results = {r["dtype"]: r for r in report["results"]}
    assert set(results) == {"float32", "bfloat16-weights", "int8-weights"}
    assert not any("error" in r for r in results.values())
    assert report["command"][report["command"].index("--dtype") + 1:][:3] == ["float32", "bfloat16-weights",
                                                                              "int8-weights"]
    text = (tmp_path / "packed.md").read_text()
    assert "tokens/s bfloat16-weights / float32 = " in text and "tokens/s int8-weights / float32 = " in text


def test_the_kernel_library_builds_into_the_cache_folder_once(tmp_path, monkeypatch):
    monkeypatch.setenv("XLAGEN_CACHE", str(tmp_path))
    library = native.build.build()
    assert library.parent == tmp_path / "native" and library.suffix == ".so"
    built = library.stat().st_mtime_ns
    assert native.build.build() == library and library.stat().st_mtime_ns == built  # cached: not rebuilt
    # no scratch left behind; the library's SHA-256 beside it (tests/test_native_build.py)
    assert sorted(p.name for p in library.parent.iterdir()) == [library.name, library.name + ".sha256"]
    monkeypatch.setenv("XLAGEN_CACHE", str(tmp_path / "file"))
    (tmp_path / "file").write_text("")  # a file where the folder should be
    with pytest.raises(native.NativeUnavailable, match="XLAGEN_CACHE"):
        native.build.build()


# ----------------------------------------------------------------------------- the float32 kernel

@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 20])
@pytest.mark.parametrize("k, n", [(64, 2304), (515, 300), (37, 19), (16, 50257)])
def test_float32_kernel_matches_float64_numpy(rows, k, n):
    # Up to 16 rows, the streaming path (up to 3 rows two vectors of columns per pass, from 4 one vector):
    # (64, 2304) two column spans; (515, 300) one span, K split eight ways with a partial last group of
    # weight rows, and a masked tail; (16, 50257) eight spans; (37, 19) one whole vector and a tail. 20
    # rows, the tiles: (515, 300) two column blocks, the last one narrow, K split four ways with a partial
    # last chunk; (16, 50257) many blocks and a masked tail.
    rng = np.random.default_rng(rows * 7 + k)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    y = _xla(lambda x: native.matmul_float32(x, tf.constant(w)), x)
    np.testing.assert_allclose(y, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-4)


def _float32_generate(model, inputs: dict, enabled: bool, **options):
    """(generate output with scores, optimized HLO) of a compiled generate traced with the float32 kernel on
    or off."""
    kernels = native.Kernels(float32=enabled)
    program = tf.function(lambda inputs: model.generate(**inputs, kernels=kernels, **options), jit_compile=True)
    return (_generate(model, inputs, kernels=kernels, **options),
            program.experimental_get_compiler_ir(inputs)(stage="optimized_hlo"))


def _assert_kernel_changes_nothing(model, inputs: dict, **options):
    (with_kernel, hlo_with), (without, hlo_without) = (_float32_generate(model, inputs, True, **options),
                                                       _float32_generate(model, inputs, False, **options))
    _assert_same_outputs(with_kernel, without)
    assert f'custom_call_target="{native.FLOAT32_TARGET}"' in hlo_with
    assert f'custom_call_target="{native.STEP_ATTENTION_TARGET}"' in hlo_with
    assert (f'custom_call_target="{native.ARGMAX_TARGET}"' in hlo_with) == (options.get("num_beams", 1) == 1)
    for target in (native.FLOAT32_TARGET, native.STEP_ATTENTION_TARGET, native.ARGMAX_TARGET):
        assert target not in hlo_without


@pytest.mark.parametrize("options", [{"max_new_tokens": 10}, {"max_new_tokens": 8, "num_beams": 3},
                                     {"max_new_tokens": 6, "num_beams": 6}])
def test_gpt2_generates_the_same_with_the_float32_kernel(gpt2_model, options):
    ids = random_ids((2, 7), 300, seed=3)
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    _assert_kernel_changes_nothing(gpt2_model, {"input_ids": ids, "attention_mask": mask}, **options)


@pytest.mark.parametrize("family", ["opt", "t5", "whisper"])
def test_other_models_generate_the_same_with_the_float32_kernel(tmp_path, family):
    model, inputs = tiny_family_model(tmp_path, family)
    _assert_kernel_changes_nothing(model, inputs, max_new_tokens=6, num_beams=2)


def test_float32_kernel_only_in_decoding_loops_of_few_rows(gpt2_model):
    ids = random_ids((3, 5), 300, seed=1)
    steps_only = native.Kernels(float32_prefill=False)

    def hlo(function, *args):
        return tf.function(function, jit_compile=True).experimental_get_compiler_ir(*args)(stage="optimized_hlo")

    # A forward pass (training, predict) is neither a decoding step nor a generation's prompt pass: XLA's dot.
    assert native.FLOAT32_TARGET not in hlo(lambda ids: gpt2_model(ids).logits, ids)
    # 3 rows x 6 beams = 18 rows per product, above float32_max_rows; x 5 beams = 15, within it.
    assert 15 <= native.Kernels().float32_max_rows < 18
    assert native.FLOAT32_TARGET not in hlo(
        lambda ids: gpt2_model.generate(ids, max_new_tokens=3, num_beams=6, kernels=steps_only), ids)
    assert native.FLOAT32_TARGET in hlo(
        lambda ids: gpt2_model.generate(ids, max_new_tokens=3, num_beams=5, kernels=steps_only), ids)
    # The prompt pass (float32_prefill) of 3 x 5 = 15 rows takes the kernel, even where the steps' 18 do not;
    # of 3 x 6 = 18 rows, only the products of the 3 last positions do: the last block's after its keys and
    # values (3), and the head.
    assert native.FLOAT32_TARGET in hlo(lambda ids: gpt2_model.generate(ids, max_new_tokens=3, num_beams=6), ids)
    longer = random_ids((3, 6), 300, seed=1)
    assert hlo(lambda ids: gpt2_model.generate(ids, max_new_tokens=3, num_beams=6), longer).count(
        f'custom_call_target="{native.FLOAT32_TARGET}"') == 4
    with native.tracing(native.Kernels.OFF):
        assert native.FLOAT32_TARGET not in hlo(lambda ids: gpt2_model.generate(ids, max_new_tokens=3), ids)
    assert native.FLOAT32_TARGET not in hlo(
        lambda ids: gpt2_model.generate(ids, max_new_tokens=3, kernels=native.Kernels(float32=False)), ids)
    # A policy given to generate wins over the one in force.
    with native.tracing(native.Kernels.OFF):
        assert native.FLOAT32_TARGET in hlo(
            lambda ids: gpt2_model.generate(ids, max_new_tokens=3, kernels=native.Kernels()), ids)


def test_float32_kernel_limits_by_size_and_width(gpt2_model):
    ids = random_ids((1, 5), 300, seed=1)

    def kernel_calls(kernels=native.Kernels(), **options):
        program = tf.function(lambda ids: gpt2_model.generate(ids, max_new_tokens=3, kernels=kernels, **options),
                              jit_compile=True)
        return program.experimental_get_compiler_ir(ids)(stage="optimized_hlo").count(
            f'custom_call_target="{native.FLOAT32_TARGET}"')

    # By default every decoding product goes through the kernel: 4 projections per block and the head, even
    # the tiny model's few-kB matrices; so does the 5-token prompt pass's (its head on the last position).
    projections = 4 * gpt2_model.config.num_layers
    assert kernel_calls() == 2 * (projections + 1)
    assert kernel_calls(native.Kernels(float32_prefill=False)) == projections + 1
    # float32_max_columns keeps wider matrices (the head) with XLA's dot at one row, not at two beams.
    narrow = native.Kernels(float32_max_columns=gpt2_model.config.vocab_size - 1, float32_prefill=False)
    assert kernel_calls(narrow) == projections
    assert kernel_calls(narrow, num_beams=2) == projections + 1
    # float32_min_bytes keeps smaller matrices (here all of them) with XLA's dot.
    assert kernel_calls(narrow.replace(float32_min_bytes=2 * 2**20, float32_prefill=True)) == 0


def test_float32_kernel_falls_back_to_xla_where_it_cannot_run(monkeypatch, gpt2_model, caplog):
    ids = random_ids((1, 5), 300, seed=2)
    expected = gpt2_model.generate(ids, max_new_tokens=4).numpy()  # eager: XLA's kernels are not involved
    monkeypatch.setattr(native.library, "hardware_reason", lambda: "no AVX-512 here")
    native.library.ready.cache_clear()
    try:
        program = tf.function(lambda ids: gpt2_model.generate(ids, max_new_tokens=4), jit_compile=True)
        with caplog.at_level("INFO", logger="xlagen.native"):
            np.testing.assert_array_equal(program(ids).numpy(), expected)
        assert native.FLOAT32_TARGET not in program.experimental_get_compiler_ir(ids)(stage="optimized_hlo")
        assert "no AVX-512 here" in caplog.text
    finally:
        native.library.ready.cache_clear()


@pytest.mark.parametrize("transposed", [False, True], ids=["keys", "transposed keys"])
@pytest.mark.parametrize("heads, t, s, d", [(2, 300, 300, 64), (3, 37, 45, 32), (1, 9, 17, 128), (2, 1, 515, 16),
                                            (1, 20, 1500, 64), (6, 1, 1500, 64), (3, 2, 1500, 32)])
def test_attention_kernel_matches_float64_numpy(heads, t, s, d, transposed):
    # Query rows not a multiple of the kernel's 8, keys not a multiple of its 32 score columns (nor of 16,
    # for transposed keys read in place up to the last one); scores spread over +-40 so that the softmax
    # leans on its maximum and most weights underflow.
    rng = np.random.default_rng(heads * t + s)
    q = rng.standard_normal((2, heads, t, d)).astype(np.float32)
    k = (3 * rng.standard_normal((2, heads, s, d))).astype(np.float32)
    v = rng.standard_normal((2, heads, s, d)).astype(np.float32)
    scale = d ** -0.5
    given = np.ascontiguousarray(k.transpose(0, 1, 3, 2)) if transposed else k
    out = _xla(lambda q, k, v: native.attention(q, k, v, scale, transposed), q, given, v)
    expected = kernel_reference.attention(q, k, v, scale)
    np.testing.assert_allclose(out, expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("transposed", [False, True], ids=["keys", "transposed keys"])
def test_attention_kernel_gradients_are_the_formulas(transposed):
    rng = np.random.default_rng(3)
    q, k, v = (tf.constant(rng.standard_normal((1, 2, n, 32)).astype(np.float32)) for n in (40, 300, 300))
    if transposed:
        k = tf.transpose(k, (0, 1, 3, 2))

    def gradients(attention):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            loss = tf.reduce_sum(tf.sin(attention(q, k, v, 0.2, transposed)))
        return tape.gradient(loss, [q, k, v])

    ours = tf.function(lambda: gradients(native.attention), jit_compile=True)()
    reference = tf.function(lambda: gradients(native.ops._reference_attention), jit_compile=True)()
    for got, expected in zip(ours, reference):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["unmasked", "biased encoder", "prompt over a cache", "relative encoder",
                                  "relative over a cache"])
def test_attention_kernels_read_the_heads_of_a_fused_projection_in_place(kind):
    # The heads of a projection [B, T, 3 H D] (`native.Heads`, columns of q, then k, then v) as the kernels'
    # operands, and the output merged into [B, T, H D]: the same values and gradients as the formulas over
    # the heads split out by TensorFlow. Over a cache, only the queries are in place (the keys and values
    # are the cache [B, H, S, D]).
    batch, heads, t, d, cache = 2, 3, 20, 32, 27
    rng = np.random.default_rng(5)
    projection = tf.constant(rng.standard_normal((batch, t, 3 * heads * d + 4)).astype(np.float32))
    cached = [tf.constant(rng.standard_normal((batch, heads, cache, d)).astype(np.float32)) for _ in range(2)]
    bias = tf.constant((3 * rng.standard_normal((1, heads, t, t))).astype(np.float32))
    # A relative bias: of the encoder's 2 t - 1 distances, shared by the batch; over the cache's t + 27 - 1,
    # one per sequence (the kernel's bias heads are then the batch's heads).
    relative = {"relative encoder": (3 * rng.standard_normal((1, heads, 2 * t - 1))).astype(np.float32),
                "relative over a cache": (3 * rng.standard_normal((batch, heads, t + cache - 1))).astype(np.float32)}
    causal = np.arange(cache)[None, :] <= np.arange(t)[:, None] + 2
    encoder_mask = tf.constant(np.arange(t)[None, None, None, :] < [[[[t]]], [[[t - 5]]]])
    cache_mask = tf.constant(np.broadcast_to(causal, (batch, 1, t, cache)))
    masks = {"biased encoder": encoder_mask, "prompt over a cache": cache_mask, "relative encoder": encoder_mask,
             "relative over a cache": cache_mask}
    mask = masks.get(kind)
    dense = None
    if kind in relative:  # the dense bias, element by element
        table = relative[kind]
        keys = cache if kind.endswith("over a cache") else t
        dense = np.empty((table.shape[0], heads, t, keys), np.float32)
        for i in range(t):
            for j in range(keys):
                dense[:, :, i, j] = table[:, :, j - i + t - 1]
        np.testing.assert_array_equal(native.relative_to_dense(tf.constant(table), t, keys).numpy(), dense)
        dense = tf.constant(dense)

    def run(projection, key_cache, value_cache, in_place):
        parts = [native.Heads(projection, i * heads * d, heads, d) for i in range(3)]
        query, key, value = parts if in_place else [p.split() for p in parts]
        if kind.endswith("over a cache"):
            key, value = key_cache, value_cache
        if kind == "unmasked":
            if in_place:
                return native.attention(query, key, value, 0.3, merged=True)
            return native.ops._reference_attention(query, key, value, 0.3)
        extra = {"bias": bias} if kind == "biased encoder" else {}
        if kind in relative:
            extra = {"bias": tf.constant(relative[kind]), "relative": True} if in_place else {"bias": dense}
        if in_place:
            return native.masked_attention(query, key, value, mask, 0.3, -1e9, merged=True, **extra)
        return native.ops._reference_masked_attention(query, key, value, mask, 0.3, -1e9, **extra)

    def outputs_and_gradients(in_place):
        with tf.GradientTape() as tape:
            tape.watch([projection, *cached])
            out = run(projection, *cached, in_place)
            if not in_place:
                out = tf.reshape(tf.transpose(out, (0, 2, 1, 3)), (batch, t, heads * d))
            loss = tf.reduce_sum(tf.sin(out))
        return [out, *tape.gradient(loss, [projection, *cached], unconnected_gradients="zero")]

    ours = tf.function(lambda: outputs_and_gradients(True), jit_compile=True)()
    reference = tf.function(lambda: outputs_and_gradients(False), jit_compile=True)()
    assert ours[0].shape == (batch, t, heads * d)
    for got, expected in zip(ours, reference):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=0, atol=2e-5)
    hlo = tf.function(lambda p: run(p, *cached, True), jit_compile=True).experimental_get_compiler_ir(projection)(
        stage="optimized_hlo")
    width = 3 * heads * d + 4
    assert f"0,{t * width},{d},{width}," in hlo  # the queries' layout: read from the projection, in place


def test_attention_kernels_refuse_heads_they_would_read_past():
    # The kernel takes each operand's strides from its shape and its heads from the queries': mismatched
    # operands, or heads past their projection's columns, would read past a buffer.
    projection = tf.zeros((1, 4, 3 * 2 * 16))
    query = native.Heads(projection, 0, 2, 16)
    with pytest.raises(ValueError, match=r"Heads: 2 heads of 16 from column 80 of a float32 \(1, 4, 96\)"):
        native.attention(query, native.Heads(projection, 80, 2, 16), query, 1.0, merged=True)
    with pytest.raises(ValueError, match="differ in batch, heads or head size"):
        native.attention(query, tf.zeros((1, 1, 4, 16)), tf.zeros((1, 1, 4, 16)), 1.0)
    with pytest.raises(ValueError, match="or keys and values in length"):
        native.masked_attention(tf.zeros((1, 2, 4, 16)), tf.zeros((1, 2, 6, 16)), tf.zeros((1, 2, 5, 16)),
                                tf.ones((1, 1, 4, 6), tf.bool), 1.0, -1e9)


def test_attention_kernel_only_for_long_unmasked_float32_attention_under_xla():
    q, k = tf.zeros((1, 2, 4, 64)), tf.zeros((1, 2, native.Kernels().attention_min_keys, 64))
    seen = {}

    def probe(name, *args, **kwargs):
        seen[name] = native.use_attention_kernel(*args, **kwargs)
        return tf.zeros(())

    def traced():
        probe("plain", q, k)
        probe("constant all-true mask", q, k, tf.ones((1, 1, 1, 1), tf.bool))
        probe("constant mask", q, k, tf.constant([[[[True, False]]]]))
        probe("bias", q, k, bias=tf.zeros((1, 2, 4, native.Kernels().attention_min_keys)))
        probe("dropout", q, k, dropout=True)
        probe("short", q, k[:, :, :-1])
        probe("head size 48", q[..., :48], k[..., :48])
        probe("bfloat16", tf.cast(q, tf.bfloat16), tf.cast(k, tf.bfloat16))
        kt = tf.transpose(k, (0, 1, 3, 2))
        probe("transposed", q, kt, key_transposed=True)
        probe("transposed, short", q, kt[..., :-1], key_transposed=True)
        probe("transposed, other head size", q[..., :32], kt, key_transposed=True)
        with native.tracing(native.Kernels.OFF):
            probe("kernels off", q, k)
        return tf.zeros(())

    tf.function(traced, jit_compile=True)()
    assert seen == {"plain": True, "constant all-true mask": True, "constant mask": False, "bias": False,
                    "dropout": False, "short": False, "head size 48": False, "bfloat16": False, "kernels off": False,
                    "transposed": True, "transposed, short": False, "transposed, other head size": False}
    assert not native.use_attention_kernel(q, k)  # eager: not under XLA
    tf.function(traced)()  # a graph not compiled by XLA
    assert not any(seen.values())
    with native.tracing(native.Kernels(float32=False)):
        tf.function(traced, jit_compile=True)()
    assert not any(seen.values())


# ----------------------------------------------------------------------------- the folded cross-attention


@pytest.mark.parametrize("groups, queries, heads, d, length, embed", [
    (2, 1, 6, 64, 1500, 384), (1, 1, 7, 16, 257, 64), (3, 2, 4, 32, 301, 128), (1, 4, 2, 128, 1000, 256),
    (5, 1, 1, 16, 256, 64), (1, 3, 5, 64, 3001, 320)])
def test_memory_attention_matches_float64_numpy_over_projected_keys_and_values(groups, queries, heads, d,
                                                                                length, embed):
    # Query rows per memory row (queries x heads) below, at and past the kernel's blocks of 6; keys not a
    # multiple of its 4 (nor of 16) and split into chunks; a key bias that the softmax must ignore. The
    # expectation projects keys and values first, as `CrossAttention.project_memory` does.
    query, states, kv_kernel, kv_bias = memory_inputs(groups, queries, heads, d, length, embed,
                                                       seed=groups * length + embed)
    width, scale = heads * d, d ** -0.5
    out = _xla(lambda q, m, w, b: native.memory_attention(q, m, tf.transpose(w[:, :width]), w, b, heads, scale),
               query, states, kv_kernel, kv_bias)
    expected = kernel_reference.memory_attention(query, states, kv_kernel, kv_bias, heads, scale)
    np.testing.assert_allclose(out, expected, rtol=0, atol=3e-5 * np.abs(expected).max())
    reference = native.reference_memory_attention(tf.constant(query), tf.constant(states),
                                                  tf.transpose(kv_kernel[:, :width]), tf.constant(kv_kernel),
                                                  tf.constant(kv_bias), heads, scale)
    np.testing.assert_allclose(reference.numpy(), expected, rtol=0, atol=3e-5 * np.abs(expected).max())


def test_memory_attention_gradients_are_the_reference_formulas():
    inputs = [tf.constant(t) for t in memory_inputs(2, 1, 4, 16, 300, 64, seed=4)]
    inputs.insert(2, tf.transpose(inputs[2][:, :64]))

    def gradients(attention):
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            loss = tf.reduce_sum(tf.sin(attention(*inputs, 4, 0.25)))
        return tape.gradient(loss, inputs)

    ours = tf.function(lambda: gradients(native.memory_attention), jit_compile=True)()
    reference = tf.function(lambda: gradients(native.reference_memory_attention), jit_compile=True)()
    for got, expected in zip(ours, reference):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=0,
                                   atol=1e-5 * max(np.abs(expected.numpy()).max(), 1.0))


def test_reference_memory_attention_takes_unknown_batch_sizes():
    # The path without the kernel (a folded context traced where the kernel cannot run) in a graph whose
    # batch and query counts are unknown until it runs.
    query, states, kv_kernel, kv_bias = (tf.constant(t) for t in memory_inputs(2, 3, 4, 16, 300, 64, seed=2))
    key_kernel_t = tf.transpose(kv_kernel[:, :64])
    signature = [tf.TensorSpec((None, None, 64)), tf.TensorSpec((None, 300, 64))]
    traced = tf.function(lambda q, m: native.reference_memory_attention(q, m, key_kernel_t, kv_kernel, kv_bias, 4,
                                                                        0.25), input_signature=signature)
    expected = native.reference_memory_attention(query, states, key_kernel_t, kv_kernel, kv_bias, 4, 0.25)
    np.testing.assert_allclose(traced(query, states).numpy(), expected.numpy(), rtol=0, atol=1e-6)


def test_memory_attention_refuses_shapes_it_has_no_code_for():
    query, states, kv_kernel, kv_bias = (tf.constant(t) for t in memory_inputs(1, 1, 2, 24, 300, 64))
    with pytest.raises(ValueError, match="head sizes"):
        native.memory_attention(query, states, tf.transpose(kv_kernel[:, :48]), kv_kernel, kv_bias, 2, 1.0)
    query, states, kv_kernel, kv_bias = (tf.constant(t) for t in memory_inputs(1, 1, 2, 16, 300, 64))
    with pytest.raises(ValueError, match="do not match"):
        native.memory_attention(query, states, kv_kernel[:, :32], kv_kernel, kv_bias, 2, 1.0)


def test_memory_attention_only_for_large_unmasked_float32_states_under_xla():
    states = tf.zeros((2, native.Kernels().attention_min_keys, 128))
    seen = {}

    def probe(name, *args):
        seen[name] = native.use_memory_attention(*args)

    def traced():
        probe("plain", states, None, 64)
        probe("mask", states, tf.ones((2, native.Kernels().attention_min_keys)), 64)
        probe("short", states[:, 1:], None, 64)
        probe("width 96", states[..., :96], None, 32)
        probe("head size 48", states, None, 48)
        probe("bfloat16", tf.cast(states, tf.bfloat16), None, 64)
        with native.tracing(native.Kernels.OFF):
            probe("kernels off", states, None, 64)
        return tf.zeros(())

    tf.function(traced, jit_compile=True)()
    assert not any(seen.values())  # 256 KB: smaller than memory_attention_min_bytes
    with native.tracing(native.Kernels(memory_attention_min_bytes=4 * 2 * native.Kernels().attention_min_keys * 128)):
        tf.function(traced, jit_compile=True)()
    assert seen == {"plain": True, "mask": False, "short": False, "width 96": False, "head size 48": False,
                    "bfloat16": False, "kernels off": False}
    assert not native.use_memory_attention(states, None, 64)  # eager: not under XLA
    with native.tracing(native.Kernels(memory_attention_min_bytes=0)):
        tf.function(traced)()  # a graph not compiled by XLA
    assert not any(seen.values())
    with native.tracing(native.Kernels(float32=False)):
        tf.function(traced, jit_compile=True)()
    assert not any(seen.values())


# ----------------------------------------------------------------------------- reading ahead


@pytest.fixture
def lookahead():
    """`native.set_lookahead`, restored to the default in force afterwards."""
    default = native.lookahead_kib()
    yield native.set_lookahead
    native.set_lookahead(default)


def _chain(weights):
    """A compiled program of products in sequence, each on the previous result, all on the streaming product
    (which reads ahead), at 20 rows too."""
    constants = [tf.constant(w) for w in weights]

    def chain(x):
        outputs = []
        with native.tracing(native.Kernels(float32_many_rows=False)):
            for w in constants:
                x = native.matmul_float32(x, w)
                outputs.append(x)
                x = tf.tanh(x[..., :w.shape[1]])
        return outputs

    return tf.function(chain, jit_compile=True)


def _chain_reference(x, weights):
    outputs = []
    for w in weights:
        x = x @ w
        outputs.append(x)
        x = np.tanh(x)
    return outputs


@pytest.mark.parametrize("rows", [1, 3, 20])
def test_lookahead_predicts_a_repeated_sequence_and_changes_no_result(lookahead, rows):
    # Products of one span (K split eight ways), of several spans, a narrow one and, at 20 rows, the tiles:
    # the workers read ahead the product that followed last time; the sums are the same in any case.
    lookahead(768)
    assert native.lookahead_kib() == (768 if os.cpu_count() > 1 else 0)
    rng = np.random.default_rng(rows)
    shapes = [(300, 700), (700, 2304), (2304, 40), (40, 300)]
    weights = [(rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32) for shape in shapes]
    x = rng.standard_normal((rows, 300)).astype(np.float32)
    program = _chain(weights)
    expected = _chain_reference(x.astype(np.float64), [w.astype(np.float64) for w in weights])
    before = native.lookahead_counts()
    for _ in range(3):
        for result, reference in zip(program(x), expected):
            np.testing.assert_allclose(result.numpy(), reference, rtol=1e-4, atol=1e-4)
    after = native.lookahead_counts()
    calls = after["calls"] - before["calls"]
    assert calls == 12
    # The second run knows every successor but the first product's (the fourth's successor is learned when
    # the second run starts); the third knows all four.
    assert after["predicted"] - before["predicted"] >= 7
    if os.cpu_count() > 1:
        # A worker reads ahead only while it spins between products, which it does only where a core is free
        # (on a loaded machine it sleeps at once), and is scheduled in that window: over many calls, a worker
        # that spun after a predicted product read ahead.
        spun = native.pool_counts()["spun_ns"]
        for _ in range(50):
            if native.lookahead_counts()["bytes_read_ahead"] > before["bytes_read_ahead"]:
                break
            program(x)
        if native.pool_counts()["spun_ns"] > spun:
            assert native.lookahead_counts()["bytes_read_ahead"] > before["bytes_read_ahead"]


def test_lookahead_off_reads_nothing_ahead_and_a_new_order_is_still_right(lookahead):
    rng = np.random.default_rng(5)
    shapes = [(256, 512), (512, 1024), (1024, 256)]
    weights = [(rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32) for shape in shapes]
    x = rng.standard_normal((2, 256)).astype(np.float32)
    program = _chain(weights)
    expected = _chain_reference(x.astype(np.float64), [w.astype(np.float64) for w in weights])
    lookahead(0)
    assert native.lookahead_kib() == 0
    program(x)
    before = native.lookahead_counts()
    for _ in range(2):
        for result, reference in zip(program(x), expected):
            np.testing.assert_allclose(result.numpy(), reference, rtol=1e-4, atol=1e-4)
    assert native.lookahead_counts()["bytes_read_ahead"] == before["bytes_read_ahead"]
    # On again: the same weights in another program and another order (every guess from the first program
    # is wrong at first) give the same products.
    lookahead(768)
    order = [2, 0, 1]
    reordered = _chain([weights[i] for i in order])
    y = rng.standard_normal((2, shapes[order[0]][0])).astype(np.float32)
    expected = _chain_reference(y.astype(np.float64), [weights[i].astype(np.float64) for i in order])
    for _ in range(3):
        for result, reference in zip(reordered(y), expected):
            np.testing.assert_allclose(result.numpy(), reference, rtol=1e-4, atol=1e-4)


def test_float32_kernel_refuses_other_dtypes():
    w = tf.constant(np.ones((8, 4)))  # float64
    with pytest.raises(TypeError, match="float64"):
        native.matmul_float32(tf.ones((1, 8)), w)


def test_set_lookahead_refuses_negative_sizes():
    with pytest.raises(ValueError, match=">= 0"):
        native.set_lookahead(-1)


# ----------------------------------------------------------------------------- a decoding step's attention


@pytest.mark.parametrize("groups, heads, queries, s, d, bias_heads", [
    (1, 12, 1, 136, 64, 1), (2, 3, 2, 2 * 45, 32, 3), (3, 2, 4, 4 * 17, 16, 1), (1, 1, 1, 1, 128, 1),
    (8, 4, 2, 2 * 300, 64, 4), (8, 12, 1, 600, 64, 1), (2, 4, 1, 9, 8, 4), (1, 2, 3, 3 * 20, 40, 1)])
def test_step_attention_kernel_matches_float64_numpy(groups, heads, queries, s, d, bias_heads):
    # Key counts (s + 1) not a multiple of 16; a random third of the keys masked, every query's new key
    # visible except in one row that sees only cache keys; two cases large enough for the workers; head
    # sizes not a multiple of 16 (8, 40: the tiny test models' and a masked last vector).
    rng = np.random.default_rng(groups * 100 + s)
    q = rng.standard_normal((groups, heads, queries, d)).astype(np.float32)
    keys, values = ((2 * rng.standard_normal((groups, heads, s, d))).astype(np.float32) for _ in range(2))
    key, value = (rng.standard_normal((groups, heads, queries, d)).astype(np.float32) for _ in range(2))
    bias = rng.standard_normal((groups, bias_heads, queries, s + 1)).astype(np.float32)
    bias[rng.random(bias.shape) < 1 / 3] = -np.inf
    bias[..., -1] = np.where(np.isneginf(bias[..., -1]), 0.0, bias[..., -1])
    if s > 1:
        bias[0, :, 0, -1] = -np.inf
        bias[0, :, 0, 0] = 0.5
    scale = d ** -0.5
    out = _xla(lambda *args: native.step_attention(*args, scale, MASK_VALUE), q, keys, values, key, value, bias)
    expected = kernel_reference.step_attention(q, keys, values, key, value, bias, scale, MASK_VALUE)
    np.testing.assert_allclose(out, expected, rtol=0, atol=2e-5)


def test_step_attention_kernel_reads_the_first_rows_of_a_larger_cache():
    # A slot decoder's narrow step: 3 groups of queries over a cache of 8 rows; rows 3-7 are never read.
    rng = np.random.default_rng(5)
    q, key, value = (rng.standard_normal((3, 4, 1, 32)).astype(np.float32) for _ in range(3))
    keys, values = (rng.standard_normal((8, 4, 40, 32)).astype(np.float32) for _ in range(2))
    bias = np.zeros((3, 1, 1, 41), np.float32)
    out = _xla(lambda *args: native.step_attention(*args, 0.2, MASK_VALUE), q, keys, values, key, value, bias)
    expected = kernel_reference.step_attention(q, keys[:3], values[:3], key, value, bias, 0.2, MASK_VALUE)
    np.testing.assert_allclose(out, expected, rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match="2 rows for 3 groups"):
        native.step_attention(tf.constant(q), tf.constant(keys[:2]), tf.constant(values[:2]), key, value, bias, 0.2,
                              MASK_VALUE)


def test_step_attention_kernel_refuses_a_bias_or_head_size_it_cannot_take():
    q = tf.zeros((2, 3, 1, 32))
    keys = tf.zeros((2, 3, 10, 32))
    with pytest.raises(ValueError, match="does not match"):
        native.step_attention(q, keys, keys, q, q, tf.zeros((2, 1, 1, 10)), 1.0, MASK_VALUE)
    wide = tf.zeros((2, 3, 1, native.STEP_ATTENTION_MAX_HEAD_DIM + 16))
    with pytest.raises(ValueError, match="head size"):
        native.step_attention(wide, wide, wide, wide, wide, tf.zeros((2, 1, 1, 2)), 1.0, MASK_VALUE)


def test_step_attention_kernel_only_in_compiled_decoding_loops():
    q, keys = tf.zeros((2, 2, 1, 64)), tf.zeros((2, 2, 9, 64))
    seen = {}

    def probe(name, *args):
        seen[name] = native.use_step_attention(*args)

    def step(i):
        probe("loop", q, keys)
        probe("two beams of one prompt", tf.zeros((1, 2, 2, 64)), keys[:1])
        probe("one row", q[:1], keys[:1])
        probe("bfloat16", tf.cast(q, tf.bfloat16), tf.cast(keys, tf.bfloat16))
        wide = tf.zeros((2, 2, 1, native.STEP_ATTENTION_MAX_HEAD_DIM + 16))
        probe("head size 272", wide, tf.zeros((2, 2, 9, native.STEP_ATTENTION_MAX_HEAD_DIM + 16)))
        with native.tracing(native.Kernels.OFF):
            probe("kernels off", q, keys)
        return (i + 1,)

    def body(i):
        with native.decoding_step():
            return step(i)

    def traced():
        probe("outside the loop", q, keys)
        return tf.while_loop(lambda i: i < 1, body, (tf.constant(0),))

    def undeclared():  # a compiled tf.while_loop that does not say it is a decoding step
        return tf.while_loop(lambda i: i < 1, step, (tf.constant(0),))

    tf.function(traced, jit_compile=True)()
    assert native.Kernels().step_attention_min_rows == 2
    assert seen == {"outside the loop": False, "loop": True, "two beams of one prompt": True, "one row": False,
                    "bfloat16": False, "head size 272": False,
                    "kernels off": False}
    tf.function(traced)()  # a graph not compiled by XLA
    assert not any(seen.values())
    tf.function(undeclared, jit_compile=True)()
    assert not any(seen.values())
    with native.tracing(native.Kernels(float32=False)):
        tf.function(traced, jit_compile=True)()
    assert not any(seen.values())


@pytest.mark.parametrize("rows, n", [(1, 1), (1, 15), (3, 16), (2, 17), (8, 51865), (16, 50257), (5, 1000)])
def test_argmax_kernel_matches_numpy(rows, n):
    # One row on the caller, more on the pool; vocabularies that are and are not a multiple of 16 lanes.
    x = np.random.default_rng(rows * n).standard_normal((rows, n)).astype(np.float32)
    np.testing.assert_array_equal(_xla(native.argmax, x), x.argmax(-1))


def test_argmax_kernel_ties_infinities_and_nan():
    x = np.zeros((6, 40), np.float32)
    x[0, [5, 21, 30]] = 1.0  # ties in different lanes and vectors: the first
    x[1] = -np.inf  # nothing larger than -inf: 0, as tf.argmax
    x[2, [3, 9]] = [np.nan, 2.0]  # NaN is skipped
    x[3, 39] = np.inf  # the last lane of the tail
    x[4] = np.nan
    x[5, [0, 16]] = 7.0  # the same lane in two vectors: the first
    np.testing.assert_array_equal(_xla(native.argmax, x), [5, 0, 9, 39, 0, 0])
    expected = tf.argmax(x, -1, output_type=tf.int32).numpy()
    np.testing.assert_array_equal(_xla(native.argmax, x)[[0, 1, 3, 5]], expected[[0, 1, 3, 5]])


def test_argmax_kernel_only_for_static_float32_scores_under_xla():
    seen = {}

    def probe(name, scores):
        seen[name] = native.use_argmax(scores)

    def traced(scores):
        probe("compiled", scores)
        probe("bfloat16", tf.cast(scores, tf.bfloat16))
        probe("three axes", scores[None])
        with native.tracing(native.Kernels.OFF):
            probe("kernels off", scores)
        return scores

    scores = tf.zeros((2, 50))
    tf.function(traced, jit_compile=True)(scores)
    assert seen == {"compiled": True, "bfloat16": False, "three axes": False, "kernels off": False}
    tf.function(traced)(scores)  # a graph not compiled by XLA
    assert not any(seen.values())
    tf.function(traced, jit_compile=True, input_signature=[tf.TensorSpec((None, 50))])(scores)
    assert not seen["compiled"]  # rows not static
    with native.tracing(native.Kernels(float32=False)):
        tf.function(traced, jit_compile=True)(scores)
    assert not any(seen.values())


# ----------------------------------------------------------------------------- configuration errors


def test_a_custom_call_it_cannot_run_is_an_xla_error_not_a_crash():
    # A backend config the kernel cannot parse, and sizes its entry point refuses, end as an error of the
    # program (in a subprocess, so that a crash would fail this test rather than the suite).
    code = textwrap.dedent("""
        import tensorflow as tf
        from tensorflow.compiler.tf2xla.ops import gen_xla_ops
        from xlagen import native

        native.load()
        assert native.status_supported()
        for config in ["2,nonsense", "2,0", "2,5,"]:
            call = tf.function(lambda x: gen_xla_ops.xla_custom_call_v2(
                operands=[x], call_target_name=native.ARGMAX_TARGET, backend_config=config, has_side_effect=False,
                result_dtypes=[tf.int32], result_shapes=[tf.TensorShape([2])])[0], jit_compile=True)
            try:
                call(tf.zeros((2, 5)))
            except tf.errors.OpError as error:
                assert "xlagen_f32_argmax" in str(error), error
            else:
                raise AssertionError(config + " ran")
        print("ok")
        """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
