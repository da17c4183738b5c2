"""The Llama family (llama, mistral, qwen2, qwen3) against transformers' PyTorch *ForCausalLM (eager attention) on
tiny random checkpoints: every rope type, grouped-query ratios 1/2/4/8, explicit head_dim, biases, Qwen3's
head norms, tied and untied heads, Mistral's sliding window shorter than the prompts."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import tensorflow as tf
import torch
import transformers

from conftest import random_ids, requires_kernels
from generation.helpers import (assert_same_tokens, eos_that_occurs, hf_generate, left_pad, max_logit_diff,
                                torch_logits)
from xlagen import (LlamaConfig, TFAutoModelForCausalLM, TFLlamaForCausalLM, TFMistralForCausalLM,
                    TFQwen2ForCausalLM, TFQwen3ForCausalLM)

PAD = 1
VOCAB = 64
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=PAD, rms_norm_eps=1e-5)
CLASSES = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, TFLlamaForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, TFMistralForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, TFQwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, TFQwen3ForCausalLM)}

# variant -> (model_type, config overrides). Grouped-query ratios: 1 (linear), 2 (llama, qwen2, qwen3),
# 4 (mistral, yarn), 8 (llama3).
VARIANTS = {
    "llama": ("llama", dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True)),
    "linear": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True,
                             rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0})),
    "llama3": ("llama", dict(num_attention_heads=8, num_key_value_heads=1, head_dim=8,
                             rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8,
                                              "rope_theta": 100.0})),
    "dynamic": ("llama", dict(num_key_value_heads=2, max_position_embeddings=12,
                              rope_parameters={"rope_type": "dynamic", "factor": 3.0, "rope_theta": 1000.0})),
    "yarn": ("llama", dict(num_key_value_heads=1, head_dim=16,
                           rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                            "rope_theta": 1000.0})),
    "mistral": ("mistral", dict(num_key_value_heads=1, sliding_window=4)),
    "qwen2": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    # A window of 4 on the second layer only (from max_window_layers on), full attention on the first.
    "qwen2_window": ("qwen2", dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
                                   max_window_layers=1)),
    "qwen3": ("qwen3", dict(num_key_value_heads=2, head_dim=16)),
}

# Left-padded prompts of unequal lengths, longer than Mistral's window of 4.
ROWS = [random_ids((1, n), VOCAB, seed=60 + n)[0] for n in (5, 9, 7)]


def save_tiny(folder, variant: str, seed: int = 0, dtype=None, **save_options):
    """A random transformers model of `variant` saved as safetensors; returns the torch model (eval mode)."""
    family, overrides = VARIANTS[variant]
    config_class, model_class, _ = CLASSES[family]
    torch.manual_seed(seed)
    model = model_class(config_class(attn_implementation="eager", **{**BASE, **overrides})).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2:  # peaked distributions: greedy/beam choices far from ties
                parameter.mul_(2.5)
            else:  # biases and norms away from 0 / 1, so that a swapped mapping shows
                parameter.add_((0.05 if name.endswith("bias") else 0.3) * torch.randn_like(parameter))
    if dtype is None:
        model.save_pretrained(folder, **save_options)
        return model
    model.to(dtype).save_pretrained(folder, **save_options)
    # Loaded again rather than cast back: a cast would keep the rotary frequencies rounded to `dtype`.
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """variant -> (torch reference, xlagen model), each built once for the module."""
    built = {}

    def get(variant):
        if variant not in built:
            folder = tmp_path_factory.mktemp(variant)
            reference = save_tiny(folder, variant)
            built[variant] = reference, TFAutoModelForCausalLM.from_pretrained(folder)
        return built[variant]

    return get


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(tiny, variant):
    reference, model = tiny(variant)
    assert isinstance(model, CLASSES[VARIANTS[variant][0]][2])
    ids, mask = left_pad(ROWS, PAD)
    assert max_logit_diff(reference, model, ids, mask) <= 1e-4
    full = random_ids((2, 20), VOCAB)  # longer than the dynamic rope's 12 positions and the window
    assert max_logit_diff(reference, model, full, np.ones_like(full)) <= 1e-4


BEAM = dict(num_beams=3, num_return_sequences=2, length_penalty=0.5)


@pytest.mark.parametrize("variant, case", [(variant, {}) for variant in ("llama", "dynamic", "qwen3", "qwen2_window")]
                         + [(variant, BEAM) for variant in ("llama3", "mistral", "qwen2")],
                         ids=["llama-greedy", "dynamic-greedy", "qwen3-greedy", "qwen2_window-greedy", "llama3-beam",
                              "mistral-beam", "qwen2-beam"])
def test_generate_matches_transformers(tiny, variant, case):
    reference, model = tiny(variant)
    ids, mask = left_pad(ROWS, PAD)
    eos = eos_that_occurs(model, ids, mask=mask)
    options = dict(max_new_tokens=7, eos_token_id=eos, pad_token_id=PAD, **case)
    theirs = hf_generate(reference, ids, mask, do_sample=False, **options)
    assert_same_tokens(model.generate(ids, attention_mask=mask, **options), theirs, PAD)


def test_left_padded_rows_equal_rows_alone(tiny):
    _, model = tiny("mistral")
    ids, mask = left_pad(ROWS, PAD)
    options = dict(max_new_tokens=6, pad_token_id=PAD, eos_token_id=None)
    batch = np.asarray(model.generate(ids, attention_mask=mask, **options))
    for i, row in enumerate(ROWS):
        alone = np.asarray(model.generate(row[None, :], **options))
        np.testing.assert_array_equal(batch[i, ids.shape[1]:], alone[0, len(row):])


def _generate_steps(model, ids, mask):
    """Logits of prefilling 4 columns then one cached step per column, `[B, T, V]`."""
    cache = model.init_cache(len(ids), ids.shape[1])
    assert cache[0].key.shape[1] == model.config.num_key_value_heads  # the cache holds the key/value heads
    logits, cache = model.call_with_cache(tf.constant(ids[:, :4]), cache, tf.constant(0), mask)
    steps = [logits.numpy()]
    for t in range(4, ids.shape[1]):
        logits, cache = model.call_with_cache(tf.constant(ids[:, t:t + 1]), cache, tf.constant(t), mask)
        steps.append(logits.numpy())
    return np.concatenate(steps, axis=1)


def test_prefill_plus_cached_steps_equal_full_forward(tiny):
    _, model = tiny("mistral")  # 4 queries per key/value head, a window of 4 over 9 columns
    ids, mask = left_pad(ROWS, PAD)
    real = mask.astype(bool)
    # The full forward counts positions by column, generation by real token: compare unpadded rows.
    full = model(ids, attention_mask=mask, position_ids=np.maximum(np.cumsum(mask, 1) - 1, 0)).logits.numpy()
    np.testing.assert_allclose(_generate_steps(model, ids, mask)[real], full[real], atol=1e-5)


def test_grouped_step_attention_hands_the_kernel_shared_key_value_heads(tiny, monkeypatch):
    """Where the policy routes a decoding step to the native step attention, the grouped queries reach it
    as [G, Hkv, g * K, D] over the cache's own [G, Hkv, S, D] (no repeated heads); the kernel's reference
    formula (tests/kernel_reference.py) in its place gives the XLA path's logits."""
    import kernel_reference
    from xlagen import native
    from xlagen.layers.attention import MASK_VALUE

    _, model = tiny("mistral")
    ids, mask = left_pad(ROWS, PAD)
    expected = _generate_steps(model, ids, mask)
    calls = []

    def reference(query, keys, values, key, value, bias, scale, mask_value):
        calls.append((tuple(query.shape), tuple(keys.shape), tuple(key.shape)))
        assert mask_value == MASK_VALUE
        out = kernel_reference.step_attention(query, keys, values, key, value, bias, scale, mask_value)
        return tf.constant(out, tf.float32)

    monkeypatch.setattr(native, "use_step_attention", lambda query, keys: query.shape[0] * query.shape[2] >= 2)
    monkeypatch.setattr(native, "step_attention", reference)
    np.testing.assert_allclose(_generate_steps(model, ids, mask), expected, atol=1e-5)
    # 3 rows, 4 query heads on 1 key/value head: one group of 4 query rows over the 9 cached columns.
    assert calls and set(calls) == {((3, 1, 4, 8), (3, 1, 9, 8), (3, 1, 4, 8))}, calls


def test_config_mapping_and_both_rope_spellings(tiny, tmp_path, caplog):
    reference, _ = tiny("yarn")
    reference.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    with caplog.at_level(logging.WARNING, logger="xlagen"):
        config = LlamaConfig.from_hf_config(saved)
    assert not caplog.records, "a saved config.json should hold no unknown keys"
    assert (config.num_key_value_heads, config.head_dim, config.rope.rope_type, config.rope.factor) == (1, 16, "yarn", 4.0)
    assert LlamaConfig.from_hf_config(config.to_hf_config()) == config
    # transformers 4.x's spelling: rope_scaling with "type", rope_theta beside it.
    old = {k: v for k, v in saved.items() if k != "rope_parameters"}
    old["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    assert LlamaConfig.from_hf_config({**old, "rope_theta": 1000.0}) == config
    # A dynamic rope extends the context: no position limit; any other keeps max_position_embeddings.
    assert tiny("dynamic")[1].config.max_positions is None and config.max_positions == 64
    # Qwen2's window on the layers from max_window_layers on.
    assert tiny("qwen2_window")[1].attention_window == (None, 4) and tiny("mistral")[1].attention_window == 4


def test_save_pretrained_round_trip_and_training_loss(tiny, tmp_path):
    reference, model = tiny("llama")  # biases everywhere, untied head
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = random_ids((2, 9), VOCAB, seed=3)
    np.testing.assert_allclose(torch_logits(reloaded, ids, np.ones_like(ids)),
                               torch_logits(reference, ids, np.ones_like(ids)), atol=1e-5)
    with torch.no_grad():
        theirs = reference(torch.tensor(ids, dtype=torch.long), labels=torch.tensor(ids, dtype=torch.long)).loss.item()
    ours = model({"input_ids": ids})
    assert abs(float(model.compute_loss(x={"input_ids": ids}, y_pred=ours)) - theirs) <= 1e-4
    assert isinstance(TFAutoModelForCausalLM.from_pretrained(tmp_path), TFLlamaForCausalLM)


def test_family_classes_refuse_other_model_types(tiny, tmp_path):
    reference, _ = tiny("qwen2")
    reference.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type 'qwen2' is not supported"):
        TFMistralForCausalLM.from_pretrained(tmp_path)
    assert isinstance(TFQwen2ForCausalLM.from_pretrained(tmp_path), TFQwen2ForCausalLM)


def test_half_precision_and_sharded_checkpoints_load(tmp_path):
    """bfloat16 and float16 checkpoints load upcast to float32 (or as a bfloat16 model), also sharded with
    an index file."""
    ids = random_ids((2, 9), VOCAB, seed=5)
    mask = np.ones_like(ids)
    for dtype in (torch.bfloat16, torch.float16):
        folder = tmp_path / str(dtype)
        reference = save_tiny(folder, "qwen3", dtype=dtype, max_shard_size="20KB")
        assert (folder / "model.safetensors.index.json").exists()
        model = TFAutoModelForCausalLM.from_pretrained(folder)
        assert model.token_embedding.kernel.dtype == "float32"
        assert max_logit_diff(reference, model, ids, mask) <= 1e-4  # the same rounded weights, in float32
    narrow = TFAutoModelForCausalLM.from_pretrained(folder, dtype="bfloat16")
    assert narrow.compute_dtype == "bfloat16"
    assert np.abs(narrow(ids).logits.numpy() - torch_logits(reference, ids, mask)).max() < 1.0


@requires_kernels
@pytest.mark.parametrize("weight_dtype", ["bfloat16", "int8"])
def test_packed_weights_generate(tiny, tmp_path, weight_dtype):
    reference, full = tiny("qwen2")
    reference.save_pretrained(tmp_path)
    model = TFAutoModelForCausalLM.from_pretrained(tmp_path, weight_dtype=weight_dtype)
    ids, mask = left_pad(ROWS, PAD)
    assert np.abs(model(ids, attention_mask=mask).logits.numpy() - full(ids, attention_mask=mask).logits.numpy()).max() < 0.1
    tokens = tf.function(model.generate, jit_compile=True)(input_ids=tf.constant(ids), attention_mask=tf.constant(mask),
                                                           max_new_tokens=4, pad_token_id=PAD)
    assert tokens.shape == (3, ids.shape[1] + 4)


def test_compiled_generator_and_saved_model_export(tiny, tmp_path):
    """Greedy decoding compiled by XLA (CompiledGenerator, and a SavedModel restored here) equals eager
    (beam search under XLA shares every layer call with greedy; it is compared eagerly with transformers)."""
    from xlagen import Buckets, CompiledGenerator
    from xlagen.deploy.export import ExportConfig, export_saved_model

    _, model = tiny("qwen3")  # head norms, 2 queries per key/value head, head_dim 16 != hidden / heads
    ids, mask = left_pad(ROWS, PAD)
    options = dict(max_new_tokens=5, eos_token_id=eos_that_occurs(model, ids, mask=mask))
    expected = model.generate(ids, attention_mask=mask, **options).numpy()
    generator = CompiledGenerator(model, Buckets(batch_sizes=(4,), prompt_lengths=(12,), new_tokens=(5,)))
    np.testing.assert_array_equal(generator.generate(ids, attention_mask=mask, **options).numpy(), expected)
    model.generation_config = model.generation_config.update(eos_token_id=options["eos_token_id"])
    export_saved_model(model, tmp_path / "saved", export=ExportConfig(strategies=("greedy",), max_new_tokens=5,
                                                                      prompt_lengths=(12,), batch_sizes=(4,)))
    served = tf.saved_model.load(str(tmp_path / "saved"))
    np.testing.assert_array_equal(served.greedy(input_ids=ids, attention_mask=mask)["sequences"].numpy(), expected)


def test_every_eos_id_of_generation_config_stops_a_row(tiny, tmp_path):
    """Llama 3's generation_config.json lists several EOS ids: each of them ends a row, as in transformers."""
    reference, model = tiny("mistral")
    ids, mask = left_pad(ROWS, PAD)
    free = np.asarray(model.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None))[:, ids.shape[1]:]

    def ending(row, after=(), avoid=()):
        """(step, id): the first step from 1 on whose id the row did not make before (nor any of `avoid`),
        where the row has made none of `after` up to it."""
        return next((j, int(free[row, j])) for j in range(1, 6) if free[row, j] not in free[row, :j]
                    and free[row, j] not in avoid and not set(after) & set(free[row, :j + 1].tolist()))

    first_step, first = ending(0)
    second_step, second = ending(2, after=[first], avoid=free[0, :first_step + 1].tolist())
    reference.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [first, second]}))
    loaded = TFAutoModelForCausalLM.from_pretrained(tmp_path)
    assert list(loaded.generation_config.eos_token_id) == [first, second]
    ours = np.asarray(loaded.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=PAD))
    theirs = hf_generate(transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager"),
                         ids, mask, max_new_tokens=6, pad_token_id=PAD, do_sample=False)
    assert_same_tokens(ours, theirs, PAD)
    new = ours[:, ids.shape[1]:]
    assert new[0, first_step] == first and (new[0, first_step + 1:] == PAD).all()
    assert new[2, second_step] == second and (new[2, second_step + 1:] == PAD).all()


def test_grouped_decoding_step_reads_the_cache_in_place(tiny, batch_size=3, num_beams=1):
    """4 query heads on 1 key/value head: a compiled decoding step neither copies, transposes, gathers nor
    repeats the key/value cache; the only cache-sized work is the in-place write (see test_introspection)."""
    from test_introspection import _loop_body
    from xlagen.generation.introspect import generate_ir

    _, model = tiny("mistral")
    config = model.config
    beams = f"{num_beams}," if num_beams > 1 else ""
    cache = f"{batch_size},{config.num_key_value_heads},{beams}{8 + 12},{config.head_dim}]"
    hlo = generate_ir(model, batch_size=batch_size, max_new_tokens=12, pad_token_id=PAD, num_beams=num_beams,
                      stage="optimized_hlo")
    body = _loop_body(hlo).splitlines()
    cache_ops = [line for line in body if f"= f32[{cache}" in line and "get-tuple-element(" not in line]
    assert sum("dynamic-update-slice" in line.split("=")[0] for line in cache_ops) == 2 * config.num_layers
    assert not [line for line in cache_ops if " copy(" in line or "transpose" in line.split("=")[0]
                or "gather" in line.split("=")[0]], cache_ops
    repeated = f"{batch_size},{config.num_heads},{beams}{8 + 12},{config.head_dim}]"  # keys repeated per query head
    assert not [line for line in body if f"f32[{repeated}" in line.split("=")[1].split("(")[0]]


def test_memory_estimate_counts_key_value_heads_in_the_cache_and_query_heads_in_the_scores(tiny):
    _, model = tiny("mistral")
    config = model.config
    cache = 2 * config.num_layers * 3 * 10 * config.num_key_value_heads * config.head_dim * 4  # float32 k and v
    assert model.decoding_bytes(3, 10) == cache + 3 * config.num_heads * 10 * 9
