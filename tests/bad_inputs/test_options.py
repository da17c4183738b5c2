"""Bad generate options and inputs: each refused with a clear error before anything is traced or compiled,
eagerly, under `tf.function(model.generate, jit_compile=True)` and through `CompiledGenerator`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import tensorflow as tf

from conftest import random_ids, tiny_family_model
from xlagen import CompiledGenerator, GenerationConfig
from xlagen.generation import checks

IDS = random_ids((2, 4), 64, seed=51)
MASK = np.ones_like(IDS)


def _with(array, row, column, value, dtype=None):
    array = np.array(array, dtype=dtype or array.dtype)
    array[row, column] = value
    return array


# (keyword arguments of generate besides the prompt, error type, message pattern naming the culprit)
BAD_OPTIONS = [
    (dict(num_beams=2.5), TypeError, "num_beams must be an int"),
    (dict(num_beams="2"), TypeError, "num_beams must be an int"),
    (dict(max_new_tokens=3.0), TypeError, "max_new_tokens must be an int"),
    (dict(max_new_tokens=True), TypeError, "max_new_tokens must be an int"),
    (dict(top_k=None), TypeError, "top_k must be an int"),
    (dict(max_length=0), ValueError, "max_length must be >= 1"),
    (dict(min_new_tokens=-1), ValueError, "min_new_tokens must be >= 0"),
    (dict(num_beams=2, length_penalty=math.nan), ValueError, "length_penalty must be a finite number"),
    (dict(num_beams=2, length_penalty=math.inf), ValueError, "length_penalty must be a finite number"),
    (dict(do_sample=True, temperature=math.nan), ValueError, "temperature must be a finite number"),
    (dict(do_sample=True, temperature=math.inf), ValueError, "temperature must be a finite number"),
    (dict(do_sample=True, top_p=math.nan), ValueError, "top_p must be a finite number"),
    (dict(repetition_penalty=math.inf), ValueError, "repetition_penalty must be a finite number"),
    (dict(temperature="hot"), TypeError, "temperature must be a number"),
    (dict(max_memory_gb=0), ValueError, "max_memory_gb must be > 0"),
    (dict(eos_token_id="a"), TypeError, "eos_token_id must be a token id .an int. or a list of them, got str 'a'"),
    (dict(eos_token_id=[0, "a"]), TypeError, r"eos_token_id must be a token id .* got list \[0, 'a'\]"),
    (dict(pad_token_id=1.0), TypeError, "pad_token_id must be an int, got float"),
    (dict(suppress_tokens=["a"]), TypeError, "suppress_tokens must be a list of token ids"),
    # Sizes that would segfault or exhaust memory: refused from the estimate, naming the options.
    (dict(num_beams=10**6, num_return_sequences=1), ValueError, r"needs about .* GB .*num_beams 1000000"),
    (dict(max_new_tokens=8, max_memory_gb=1e-6), ValueError, r"max_new_tokens 8.* GB limit.*max_memory_gb"),
    (dict(max_new_tokens=10**9), ValueError, "exceeds the model's 64 positions"),
]

BAD_INPUTS = [
    (dict(input_ids=IDS.astype(np.float32)), TypeError, "input_ids must hold integer token ids, got dtype float"),
    (dict(input_ids=IDS.astype(bool)), TypeError, "input_ids must hold integer token ids, got dtype bool"),
    (dict(input_ids=[[1, 2], [3]]), ValueError, "input_ids must be a rectangular"),
    (dict(input_ids=_with(IDS, 1, 2, 1000)), ValueError,
     r"input_ids holds token id 1000 at row 1, column 2.*\[0, 320\)"),
    (dict(input_ids=_with(IDS, 0, 0, -3)), ValueError, "input_ids holds token id -3 at row 0"),
    (dict(input_ids=_with(IDS, 0, 1, 2**33 + 5, np.int64)), ValueError,
     "input_ids holds 8589934597, outside the int32"),
    (dict(input_ids=IDS[:0]), ValueError, "empty batch: input_ids has 0 rows"),
    (dict(input_ids=IDS, attention_mask=_with(MASK, 1, 0, 2)), ValueError,
     "attention_mask must hold only 0 .* got 2 at row 1"),
    (dict(input_ids=IDS, attention_mask=_with(MASK, 0, 3, -1)), ValueError,
     "attention_mask .* got -1 at row 0, column 3"),
    (dict(input_ids=IDS, attention_mask=_with(MASK, 0, 0, 0.5, np.float32)), ValueError, "attention_mask .* got 0.5"),
    (dict(input_ids=IDS, attention_mask=np.stack([MASK[0], np.zeros(4, np.int32)])), ValueError,
     "attention_mask row 1 is all zeros"),
    (dict(input_ids=IDS, attention_mask=MASK[:1]), ValueError,
     r"attention_mask shape \(1, 4\) does not match input_ids"),
    (dict(input_ids=IDS, attention_mask=MASK[:, :3]), ValueError, "attention_mask shape"),
    (dict(input_ids=np.full((1, 3), 1, np.int32), pad_token_id=1), ValueError, "attention_mask row 0 is all zeros"),
    (dict(input_ids=IDS, do_sample=True, seed=2**40), ValueError, "seed 1099511627776 is outside the int32"),
    (dict(input_ids=IDS, do_sample=True, seed=[1, 2, 3]), ValueError, "seed must be an int or .2. ints, got shape"),
    (dict(input_ids=IDS, do_sample=True, seed=1.5), TypeError, "seed must be an int or .2. ints, got dtype float"),
]


@pytest.mark.parametrize("options, error, message", BAD_OPTIONS)
def test_bad_options_eager(gpt2_model, options, error, message):
    with pytest.raises(error, match=message):
        gpt2_model.generate(IDS, **options)


@pytest.mark.parametrize("inputs, error, message", BAD_INPUTS)
def test_bad_inputs_eager(gpt2_model, inputs, error, message):
    with pytest.raises(error, match=message):
        gpt2_model.generate(**inputs, max_new_tokens=2)


@pytest.mark.parametrize("options, error, message", [case for case in BAD_OPTIONS if case[1] is ValueError])
def test_bad_options_xla_raise_while_tracing(gpt2_model, options, error, message):
    xla_generate = tf.function(gpt2_model.generate, jit_compile=True)
    with pytest.raises(error, match=message):
        xla_generate(tf.constant(IDS), **options)


def test_xla_checks_dtypes_and_shapes_of_symbolic_inputs(gpt2_model):
    xla_generate = tf.function(gpt2_model.generate, jit_compile=True)
    with pytest.raises(TypeError, match="input_ids must hold integer token ids"):
        xla_generate(tf.constant(IDS, tf.float32), max_new_tokens=2)
    with pytest.raises(ValueError, match="attention_mask shape"):
        xla_generate(tf.constant(IDS), attention_mask=tf.constant(MASK[:1]), max_new_tokens=2)


@pytest.mark.parametrize("inputs, error, message", BAD_INPUTS + [
    (dict(input_ids=IDS, **options), error, message) for options, error, message in BAD_OPTIONS[-3:-1]])
def test_bad_inputs_compiled_before_compiling(gpt2_model, inputs, error, message):
    generator = CompiledGenerator(gpt2_model)
    with pytest.raises(error, match=message):
        generator.generate(**{"max_new_tokens": 2, **inputs})
    assert generator.trace_log == [] and not generator._programs


def test_padding_may_hold_any_id(gpt2_model):
    """Masked positions are never looked up: a pad id outside the vocabulary is fine (GPT-2 + added pad)."""
    ids, mask = _with(IDS, 0, 0, 1000), _with(MASK, 0, 0, 0)
    assert gpt2_model.generate(ids, attention_mask=mask, max_new_tokens=1, pad_token_id=1000).shape == (2, 5)


def test_numpy_scalars_are_accepted(gpt2_model):
    config = GenerationConfig(max_new_tokens=np.int64(2), temperature=np.float32(0.5), eos_token_id=None)
    assert config.max_new_tokens == 2 and isinstance(config.max_new_tokens, int)
    assert gpt2_model.generate(IDS, generation_config=config).shape == (2, 6)


@pytest.mark.parametrize("sizes, error, message", [
    (dict(max_new_tokens=0), ValueError, "max_new_tokens must be positive"),
    (dict(batch_sizes=1.5), TypeError, "batch_sizes must be an int or"),
    (dict(prompt_lengths=()), TypeError, "prompt_lengths must be an int or a non-empty"),
    (dict(max_new_tokens=10**6), ValueError, "1000000 new tokens exceeds the model's 64 positions"),
])
def test_bad_warmup_sizes(gpt2_model, sizes, error, message):
    generator = CompiledGenerator(gpt2_model)
    with pytest.raises(error, match=message):
        generator.warmup(**sizes)
    assert generator.trace_log == []


def test_warmup_takes_plain_ints(gpt2_model):
    generator = CompiledGenerator(gpt2_model)
    generator.warmup(batch_sizes=2, prompt_lengths=4, max_new_tokens=3)
    assert [event.key[:4] for event in generator.trace_log] == [(2, 8, 0, 16)]


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    return tiny_family_model(str(tmp_path_factory.mktemp("t5")), "t5")


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    return tiny_family_model(str(tmp_path_factory.mktemp("whisper")), "whisper")


def test_t5_unbounded_new_tokens_refused_before_tracing(t5):
    """T5 has no position limit: only the memory estimate stops max_new_tokens=10**9."""
    model, inputs = t5
    with pytest.raises(ValueError, match=r"needs about .* GB .*max_new_tokens 1000000000"):
        model.generate(**inputs, max_new_tokens=10**9)
    xla_generate = tf.function(model.generate, jit_compile=True)
    with pytest.raises(ValueError, match=r"max_new_tokens 1000000000"):
        xla_generate(**{k: tf.constant(v) for k, v in inputs.items()}, max_new_tokens=10**9)
    generator = CompiledGenerator(model)
    with pytest.raises(ValueError, match="max_new_tokens 1000000000"):
        generator.generate(**inputs, max_new_tokens=10**9)
    assert generator.trace_log == []


@pytest.mark.parametrize("name, row, column, value, message", [
    ("input_ids", 1, 0, 10**4, "input_ids holds token id 10000 at row 1"),
    ("decoder_input_ids", 0, 1, -1, "decoder_input_ids holds token id -1 at row 0, column 1"),
])
def test_t5_token_range(t5, name, row, column, value, message):
    model, inputs = t5
    start = model.generation_config.decoder_start_token_id or 0
    decoder = np.array([[start, 3], [start, 4]], np.int32)
    inputs = {**inputs, "decoder_input_ids": decoder}
    inputs[name] = _with(inputs[name], row, column, value)
    with pytest.raises(ValueError, match=message):
        model.generate(**inputs, max_new_tokens=2)


@pytest.mark.parametrize("change, error, message", [
    (lambda f: np.full_like(f, np.nan), ValueError, r"input_features holds NaN or infinite values \(first in row 0\)"),
    (lambda f: _with(f[:, 0], 0, 5, np.inf)[:, None] + f, ValueError, "input_features holds NaN or infinite"),
    (lambda f: f[:, :7], ValueError, "input_features of shape"),
    (lambda f: f[:0], ValueError, "empty batch: input_features has 0 rows"),
    (lambda f: f.astype(np.int32), ValueError, "input_features must be float log-mel features"),
])
def test_whisper_bad_features(whisper, change, error, message):
    model, inputs = whisper
    features = change(inputs["input_features"])
    with pytest.raises(error, match=message):
        model.generate(features, max_new_tokens=2)
    generator = CompiledGenerator(model)
    with pytest.raises(error, match=message):
        generator.generate(features, max_new_tokens=2)
    assert generator.trace_log == []


@pytest.mark.parametrize("values, message", [
    ({"num_beams": "2"}, "num_beams must be an int, got str"),
    ({"length_penalty": "NaN"}, "length_penalty must be a number"),
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ({"eos_token_id": "a"}, "eos_token_id must be a token id .an int. or a list of them, got str 'a'"),
    ({"eos_token_id": [1, None]}, "eos_token_id must be a token id"),
    ({"decoder_start_token_id": "0"}, "decoder_start_token_id must be an int, got str"),
])
def test_bad_generation_config_file_names_the_file(tmp_path, values, message):
    (tmp_path / "generation_config.json").write_text(json.dumps(values))
    with pytest.raises(ValueError, match=f"generation_config.json: {message}"):
        GenerationConfig.from_pretrained(tmp_path)


def test_generation_config_file_nulls_mean_default(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"temperature": null, "max_new_tokens": null}')
    assert GenerationConfig.from_pretrained(tmp_path).temperature == 1.0


def test_memory_estimate_follows_the_cache(gpt2_model):
    """`decoding_bytes` is the real cache size plus one step's scores; ordinary calls are estimated small."""
    cache = gpt2_model.init_cache(3, 10)
    cache_bytes = sum(int(np.prod(t.shape)) * t.dtype.size for t in tf.nest.flatten(cache))
    heads = gpt2_model.config.num_heads
    assert gpt2_model.decoding_bytes(3, 10) == cache_bytes + 3 * heads * 10 * 9
    assert checks.estimate_bytes(gpt2_model, 2, 8, 16, GenerationConfig(), {}) < 2**20
    # Beam search's step scores grow with the square of the beams.
    beams = [checks.estimate_bytes(gpt2_model, 1, 8, 16, GenerationConfig(num_beams=k), {}) for k in (100, 200)]
    assert 3.5 < beams[1] / beams[0] < 4.5
