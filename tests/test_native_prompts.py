"""The kernels of long prompts and encoders: a prompt's masked self-attention (`native.masked_attention`) and
the many-row products (`gemm.cc`), under XLA and inside `generate`, against XLA's own attention and dot.

(Kept apart from test_native.py so that the suite's workers, which take whole files, share the time.)
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tensorflow as tf

from conftest import random_ids, requires_kernels
from test_native import FLOAT_INT8, FORMATS, _assert_same_outputs, _generate, _pair
from xlagen import native

pytestmark = requires_kernels


@pytest.mark.parametrize("weight_dtype", list(FORMATS))
@pytest.mark.parametrize("extra_rows", [7, 150])
def test_packed_products_of_many_rows_run_the_many_row_product(weight_dtype, extra_rows):
    # More rows than packed_max_rows outside a step: the many-row product, x @ unpack(W) (without it: unpacked
    # for XLA's dot); inside a step the streaming kernel, whatever the rows. With 150 more, the product's one
    # block of columns is split into units of rows.
    _, pack, streaming = FORMATS[weight_dtype]
    many = native.GEMM_TARGETS[weight_dtype]
    rng = np.random.default_rng(3)
    words = tf.constant(pack(rng.standard_normal((300, 70)).astype(np.float32)))
    rows = native.Kernels().packed_max_rows + extra_rows
    x = rng.standard_normal((rows, 300)).astype(np.float32)
    function = tf.function(lambda x: native.matmul(x, words, 70), jit_compile=True)
    with native.tracing(FLOAT_INT8):
        hlo = function.experimental_get_compiler_ir(x)(stage="optimized_hlo")
        assert f'custom_call_target="{many}"' in hlo and streaming not in hlo
        np.testing.assert_allclose(function(x).numpy(), x.astype(np.float64) @ native.unpack(words, 70).numpy(),
                                   rtol=0, atol=2e-5 * np.sqrt(300) * np.abs(x).max())
    with native.tracing(FLOAT_INT8.replace(many_rows=False)):
        assert many not in tf.function(lambda x: native.matmul(x, words, 70), jit_compile=True
                                       ).experimental_get_compiler_ir(x)(stage="optimized_hlo")

    def step(i, y):
        with native.decoding_step():
            return i + 1, y + native.matmul(x, words, 70)

    looped = tf.function(lambda: tf.while_loop(lambda i, y: i < 2, step, (0, tf.zeros((rows, 70))))[1],
                         jit_compile=True)
    with native.tracing(FLOAT_INT8):
        hlo = looped.experimental_get_compiler_ir()(stage="optimized_hlo")
    assert f'custom_call_target="{streaming}"' in hlo and many not in hlo


# The last two: units of rows as well as of columns (with 2 threads: 2 or 3 blocks of columns by 2 parts of
# the rows; one block by 4 parts, the last shorter).
@pytest.mark.parametrize("rows, k, n", [(17, 300, 70), (40, 768, 129), (100, 33, 1000), (300, 200, 300),
                                        (130, 70, 40)])
def test_float32_many_row_product_matches_float64_numpy(rows, k, n):
    rng = np.random.default_rng(rows + n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    with native.tracing(native.Kernels(float32_many_rows=True)):
        function = tf.function(lambda x: native.matmul_float32(x, tf.constant(w)), jit_compile=True)
        assert f'custom_call_target="{native.GEMM_TARGETS["float32"]}"' in function.experimental_get_compiler_ir(x)(
            stage="optimized_hlo")
        np.testing.assert_allclose(function(x).numpy(), x.astype(np.float64) @ w, rtol=1e-5, atol=1e-4)


def _count(hlo: str, target: str) -> int:
    return hlo.count(f'custom_call_target="{target}"')


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    """family -> a tiny model with 16-wide heads (which the fused attentions take): GPT-2, and Mistral with 4
    query heads per key/value head and a window of 5 positions."""
    from models.test_llama import BASE, CLASSES

    from conftest import save_tiny_gpt2
    from xlagen import TFAutoModelForCausalLM

    gpt2 = tmp_path_factory.mktemp("gpt2_wide")
    save_tiny_gpt2(gpt2, n_embd=64, n_positions=160)  # room for a prompt of prompt_attention_min_tokens
    mistral = tmp_path_factory.mktemp("mistral_wide")
    config_class, model_class, _ = CLASSES["mistral"]
    config = config_class(attn_implementation="eager", **{**BASE, "hidden_size": 64, "num_key_value_heads": 1,
                                                          "head_dim": 16, "sliding_window": 5,
                                                          "max_position_embeddings": 160})
    import torch

    torch.manual_seed(0)
    model_class(config).eval().save_pretrained(mistral)
    return {"gpt2": TFAutoModelForCausalLM.from_pretrained(gpt2),
            "mistral": TFAutoModelForCausalLM.from_pretrained(mistral)}


@pytest.mark.parametrize("family, options", [("gpt2", {"max_new_tokens": 6}), ("mistral", {"max_new_tokens": 6}),
                                             ("mistral", {"max_new_tokens": 5, "num_beams": 2})])
def test_prompt_attention_generates_as_xla_attention(wide_heads, family, options):
    # Left padding (a row whose first queries see no key), a prompt longer than Mistral's window, and the
    # cache's positions after the prompt, which the kernel never scores.
    model = wide_heads[family]
    ids = random_ids((2, 11), 60, seed=7)
    mask = np.ones_like(ids)
    mask[1, :4] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    fused, plain = native.Kernels(prompt_attention_min_tokens=2), native.Kernels(prompt_attention_min_tokens=None)
    _assert_same_outputs(_generate(model, inputs, kernels=fused, **options),
                         _generate(model, inputs, kernels=plain, **options))

    def hlo(kernels, ids=ids, mask=mask):
        program = tf.function(lambda ids, mask: model.generate(ids, attention_mask=mask, kernels=kernels, **options),
                              jit_compile=True)
        return program.experimental_get_compiler_ir(ids, mask)(stage="optimized_hlo")

    # The last block attends from the prompt's last token only: XLA's attention over GPT-2's one row; the
    # kernel's over Mistral's 4 (its 4 query heads per key/value head are rows of that head).
    layers = model.config.num_layers - (family == "gpt2")
    assert _count(hlo(fused), native.MASKED_ATTENTION_TARGET) == layers
    if family != "gpt2":
        return
    assert _count(hlo(plain), native.MASKED_ATTENTION_TARGET) == 0
    # By default only from prompt_attention_min_tokens tokens.
    most = native.Kernels().prompt_attention_min_tokens
    assert _count(hlo(native.Kernels()), native.MASKED_ATTENTION_TARGET) == 0
    longer = random_ids((1, most), 60, seed=8)
    assert _count(hlo(native.Kernels(), longer, np.ones_like(longer)), native.MASKED_ATTENTION_TARGET) == layers


def test_long_prompts_with_packed_weights_generate_as_float32_with_rounded_weights(gpt2_checkpoint):
    # 3 prompts of 12 tokens: 36 rows, past packed_max_rows, so the prompt's products are the many-row product.
    from xlagen import TFAutoModelForCausalLM

    ids = random_ids((3, 12), 300, seed=9)
    mask = np.ones_like(ids)
    mask[2, :5] = 0
    assert ids.size > native.Kernels().packed_max_rows
    for weight_dtype in FORMATS:
        packed, reference = _pair(lambda: TFAutoModelForCausalLM.from_pretrained(gpt2_checkpoint[0]), weight_dtype)
        inputs = {"input_ids": ids, "attention_mask": mask}
        with native.tracing(FLOAT_INT8):
            _assert_same_outputs(_generate(packed, inputs, max_new_tokens=5), _generate(reference, inputs, max_new_tokens=5))
            program = tf.function(lambda inputs: packed.generate(**inputs, max_new_tokens=5), jit_compile=True)
            hlo = program.experimental_get_compiler_ir(inputs)(stage="optimized_hlo")
        # The last block's products after its query/key/value projection run on the last token's row only.
        assert _count(hlo, native.GEMM_TARGETS[weight_dtype]) == 4 * packed.config.num_layers - 3


def test_long_prompts_with_bfloat16_weights_on_amx_tiles_stay_close_to_float32_compute(gpt2_checkpoint):
    # By default, where this process has AMX's tiles, a prompt's products of more than packed_max_rows rows
    # with bfloat16 weights round x to bfloat16 on them (and nowhere else: the steps keep float32 x); the
    # logits then move by about that rounding.
    from xlagen import TFAutoModelForCausalLM

    ids = tf.constant(random_ids((3, 12), 300, seed=9))
    packed, _ = _pair(lambda: TFAutoModelForCausalLM.from_pretrained(gpt2_checkpoint[0]), "bfloat16")
    logits = {}
    for name, kernels in (("default", native.Kernels()), ("float32", FLOAT_INT8)):
        with native.tracing(kernels):
            forward = tf.function(lambda ids: packed(ids).logits, jit_compile=True)
            hlo = forward.experimental_get_compiler_ir(ids)(stage="optimized_hlo")
            logits[name] = forward(ids).numpy()
        tiles = name == "default" and native.amx_tiles()
        products = 4 * packed.config.num_layers + 1  # and the LM head's over every position
        # Every projection's with its bias added by the product (the MLP's input projection's GELU too); the
        # head's has none.
        assert _count(hlo, native.ops.EPILOGUE_TARGETS[native.BF16_TILE_TARGET]) == (products - 1 if tiles else 0)
        assert _count(hlo, native.BF16_TILE_TARGET) == (1 if tiles else 0)
        assert _count(hlo, native.GEMM_TARGETS["bfloat16"]) == (0 if tiles else products)
    difference = np.abs(logits["default"] - logits["float32"]).max()
    assert difference < 0.02 * np.ptp(logits["float32"])
    assert (difference > 0) == native.amx_tiles()
    if native.amx_tiles():
        with native.tracing(native.Kernels(bfloat16_tiles=True)):
            forward = tf.function(lambda ids: packed(ids).logits, jit_compile=True)
            assert _count(forward.experimental_get_compiler_ir(ids)(stage="optimized_hlo"), native.BF16_TILE_TARGET)
    else:  # refused before anything is traced
        with pytest.raises(native.NativeUnavailable, match="bfloat16_tiles=True needs AMX"):
            with native.tracing(native.Kernels(bfloat16_tiles=True)):
                pass


def test_float32_many_rows_in_a_prompt_pass_generate_as_xla_dot(gpt2_model):
    ids = random_ids((2, 9), 300, seed=10)  # 18 rows: past float32_max_rows
    inputs = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    many = native.Kernels(float32_many_rows=True)
    _assert_same_outputs(_generate(gpt2_model, inputs, kernels=many, max_new_tokens=4),
                         _generate(gpt2_model, inputs, kernels=native.Kernels(float32=False), max_new_tokens=4))
    program = tf.function(lambda inputs: gpt2_model.generate(**inputs, kernels=many, max_new_tokens=4),
                          jit_compile=True)
    hlo = program.experimental_get_compiler_ir(inputs)(stage="optimized_hlo")
    # Every GPT-2 projection has a bias, which the product adds (and GELU, which the first MLP one applies).
    fused = native.ops.EPILOGUE_TARGETS[native.GEMM_TARGETS["float32"]]
    # The last block's products after its query/key/value projection run on the last token's row only.
    assert _count(hlo, fused) == 4 * gpt2_model.config.num_layers - 3
    assert _count(hlo, native.GEMM_TARGETS["float32"]) == 0
    # The attention's and the MLP's output projections add the residual connection's input too (but the last
    # block's, of one row per sequence: XLA's add after the streaming product).
    assert len(re.findall(r'backend_config="\d+,\d+,\d+,1,0,1"', hlo)) == 2 * (gpt2_model.config.num_layers - 1)
    # Not in a forward pass (training): XLA's dot, which has a gradient.
    with native.tracing(many):
        forward = tf.function(lambda ids: gpt2_model(ids).logits, jit_compile=True)
        assert native.GEMM_TARGETS["float32"] not in forward.experimental_get_compiler_ir(ids)(stage="optimized_hlo")


def test_t5_encoder_attention_with_its_position_bias_generates_as_xla_attention(tmp_path):
    # T5's encoder: a padding mask of one row per sequence ([B, 1, 1, S], the first sequence right-padded)
    # and the relative position bias (of each distance) added to the scores, both in the kernel.
    import torch
    import transformers
    from models.test_t5 import T5_BASE

    from xlagen import TFAutoModelForSeq2SeqLM

    torch.manual_seed(3)
    config = transformers.T5Config(attn_implementation="eager",
                                   **{**T5_BASE, "d_model": 64, "d_kv": 16, "feed_forward_proj": "relu"})
    reference = transformers.T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if "relative_attention_bias" in name:
                parameter.mul_(4)  # a bias that moves the weights, so that a bias left out would show
    reference.save_pretrained(tmp_path)
    model = TFAutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    ids = random_ids((2, 12), 64, seed=9)
    mask = np.ones_like(ids)
    mask[0, 9:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    fused, plain = native.Kernels(prompt_attention_min_tokens=2), native.Kernels(prompt_attention_min_tokens=None)
    _assert_same_outputs(_generate(model, inputs, kernels=fused, max_new_tokens=5),
                         _generate(model, inputs, kernels=plain, max_new_tokens=5))

    def hlo(kernels):
        program = tf.function(lambda ids, mask: model.generate(ids, attention_mask=mask, kernels=kernels,
                                                               max_new_tokens=5), jit_compile=True)
        return program.experimental_get_compiler_ir(ids, mask)(stage="optimized_hlo")

    # The encoder's layers read the bias of each distance (2 T - 1 per head), not a [T, S] matrix.
    assert _count(hlo(fused), native.RELATIVE_ATTENTION_TARGET) == config.num_layers
    assert _count(hlo(plain), native.RELATIVE_ATTENTION_TARGET) == 0


def _check_prompt_kernel(model, ids, field: str, target: str, count: int, new_tokens: int):
    """`generate` from `ids` under the default kernels calls `target` `count` times and gives the same
    output as with `field` None (the kernel off), which calls it never."""
    inputs = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    off = native.Kernels(**{field: None})
    _assert_same_outputs(_generate(model, inputs, kernels=native.Kernels(), max_new_tokens=new_tokens),
                         _generate(model, inputs, kernels=off, max_new_tokens=new_tokens))
    for kernels, expected in ((native.Kernels(), count), (off, 0)):
        program = tf.function(lambda inputs: model.generate(**inputs, kernels=kernels, max_new_tokens=new_tokens),
                              jit_compile=True)
        assert _count(program.experimental_get_compiler_ir(inputs)(stage="optimized_hlo"), target) == expected


def test_long_prompts_embeddings_come_from_the_native_lookup_with_the_same_values(gpt2_model):
    # 2 x 40 prompt tokens: past lookup_min_tokens (64), the native lookup of the embedding columns, and
    # the same generation as XLA's gather; 2 x 20 stay on the gather.
    for rows, count in ((40, 1), (20, 0)):
        _check_prompt_kernel(gpt2_model, random_ids((2, rows), 300, seed=rows), "lookup_min_tokens",
                             native.LOOKUP_TARGET, count, 3)


def test_long_prompts_rms_norms_run_natively_close_to_xla(wide_heads):
    # The Llama family's RMS norms (Mistral's): 2 per block, the last block's second and the final one on the
    # last token's row only; from layer_norm_min_rows (64) rows, as the LayerNorms.
    model = wide_heads["mistral"]
    for rows, count in ((40, 2 * model.config.num_layers - 1), (20, 0)):
        _check_prompt_kernel(model, random_ids((2, rows), 60, seed=rows + 2), "layer_norm_min_rows",
                             native.RMS_NORM_TARGET, count, 3)


def test_long_prompts_layer_norms_run_natively_close_to_xla(gpt2_model):
    # 2 x 40 prompt tokens: past layer_norm_min_rows (64), the prompt pass's LayerNorms (2 per block; the last
    # block's second and the final one normalise the last token's row only) are the native kernel, and the
    # generation is XLA's; 2 x 20 stay on XLA's.
    for rows, count in ((40, 2 * gpt2_model.config.num_layers - 1), (20, 0)):
        _check_prompt_kernel(gpt2_model, random_ids((2, rows), 300, seed=rows + 1), "layer_norm_min_rows",
                             native.LAYER_NORM_TARGET, count, 3)


def test_long_prompts_keys_and_values_are_written_into_the_fresh_cache_natively(wide_heads):
    # 2 x 70 prompt tokens: past prompt_cache_min_tokens (64), each GPT-2 layer's keys and values go into the
    # fresh cache by the native kernel (2 calls per layer, the last layer's too, which attends from its last
    # row only), and the generation is the same as with XLA's writes; 2 x 40 stay XLA's, and so do Mistral's
    # rotated keys.
    gpt2 = wide_heads["gpt2"]
    for model, rows, count in ((gpt2, 70, 2 * gpt2.config.num_layers), (gpt2, 40, 0), (wide_heads["mistral"], 70, 0)):
        _check_prompt_kernel(model, random_ids((2, rows), 60, seed=rows + 3), "prompt_cache_min_tokens",
                             native.SPLIT_HEADS_TARGET, count, 3)


def test_a_long_encoder_outputs_cross_attention_memory_is_laid_out_in_heads_natively(tmp_path):
    # T5 over 70 encoder positions: past memory_heads_min_positions (64), each decoder layer's keys (transposed)
    # and values are laid out by the native kernel, 2 calls per layer, with the same generation as XLA's.
    import torch
    import transformers
    from models.test_t5 import T5_BASE

    from xlagen import TFAutoModelForSeq2SeqLM

    torch.manual_seed(4)
    config = transformers.T5Config(**{**T5_BASE, "d_model": 64, "d_kv": 16, "feed_forward_proj": "relu"})
    transformers.T5ForConditionalGeneration(config).eval().save_pretrained(tmp_path)
    model = TFAutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    for length, count in ((70, 2 * config.num_decoder_layers), (40, 0)):
        _check_prompt_kernel(model, random_ids((2, length), 64, seed=length), "memory_heads_min_positions",
                             native.SPLIT_HEADS_TARGET, count, 4)
