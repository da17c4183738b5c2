"""CompiledGenerator: bucketed shapes, tensor options, one compile per bucket, same tokens."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import tensorflow as tf

from conftest import random_ids, save_tiny_gpt2
from xlagen import TFAutoModelForCausalLM
from xlagen.generation.compiled import Buckets, CompiledGenerator

PAD = 1


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2_long")
    save_tiny_gpt2(folder, n_positions=160)
    return TFAutoModelForCausalLM.from_pretrained(folder)


def test_guide_example_traces_once(gpt2_model):
    xla_generate = tf.function(gpt2_model.generate, jit_compile=True)
    ids = random_ids((3, 8), 64, seed=70)
    mask = np.ones_like(ids)
    mask[0, :3] = mask[1, :5] = 0  # three prompts of different lengths, left-padded to 8
    for _ in range(3):
        xla_generate(input_ids=tf.constant(ids), attention_mask=tf.constant(mask), num_beams=2, pad_token_id=PAD)
    assert xla_generate.experimental_get_tracing_count() == 1


def test_varied_workload_compiles_once_per_bucket(long_model):
    generator = CompiledGenerator(long_model)
    rng = np.random.RandomState(0)
    lengths = np.linspace(1, 100, 50).astype(int)
    results, requests = [], []
    for i, length in enumerate(lengths):
        options = dict(max_new_tokens=int(rng.randint(1, 17)), do_sample=True, pad_token_id=PAD,
                       temperature=float(rng.uniform(0.5, 1.5)), top_p=float(rng.uniform(0.5, 1.0)), seed=[i, 7])
        ids = random_ids((1, length), 64, seed=100 + i)
        requests.append((ids, options))
        results.append(generator.generate(ids, **options).numpy())
    touched = {next(b for b in Buckets().prompt_lengths if b >= length) for length in lengths}
    assert generator.compile_count == len(touched)  # prompt buckets 8..128; one new-token bucket (16)
    assert [event.key.prompt_bucket for event in generator.trace_log] == sorted(touched)
    for index in range(0, len(requests), 7):  # compiled == uncompiled, spot-checked across buckets
        ids, options = requests[index]
        np.testing.assert_array_equal(results[index], long_model.generate(ids, **options).numpy())


@pytest.mark.parametrize("options", [
    dict(max_new_tokens=7),
    dict(max_new_tokens=9, repetition_penalty=1.3, no_repeat_ngram_size=2, min_new_tokens=3),
    dict(max_new_tokens=10, num_beams=3, num_return_sequences=2, length_penalty=0.7,
         output_scores=True, return_dict_in_generate=True),
    dict(max_new_tokens=6, do_sample=True, top_k=5, seed=[3, 3], num_return_sequences=2,
         output_scores=True, return_dict_in_generate=True),
    dict(max_new_tokens=7, output_scores=True, output_logprobs=True, return_dict_in_generate=True),
], ids=["greedy", "processors", "beam-scores", "sample-scores", "logprobs"])
def test_compiled_equals_uncompiled(gpt2_model, options):
    generator = CompiledGenerator(gpt2_model)
    ids = random_ids((3, 5), 64, seed=71)
    mask = np.ones_like(ids)
    mask[1, :2] = 0
    eos = int(gpt2_model.generate(ids, max_new_tokens=4, eos_token_id=None)[0, 8])
    options = dict(eos_token_id=eos, pad_token_id=PAD, **options)
    expected = gpt2_model.generate(ids, attention_mask=mask, **options)
    got = generator.generate(ids, attention_mask=mask, **options)
    if not options.get("return_dict_in_generate"):
        np.testing.assert_array_equal(got.numpy(), expected.numpy())
        return
    np.testing.assert_array_equal(got.sequences.numpy(), expected.sequences.numpy())
    assert len(got.scores) == len(expected.scores)
    for ours, theirs in zip(got.scores, expected.scores):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=1e-5)
    if expected.sequences_scores is not None:
        np.testing.assert_allclose(got.sequences_scores.numpy(), expected.sequences_scores.numpy(), atol=1e-5)
    if expected.logprobs is not None:
        np.testing.assert_allclose(got.logprobs.numpy(), expected.logprobs.numpy(), atol=1e-5)
        unpadded = [0, 2]  # row 1's first column is padding: what follows it means nothing
        np.testing.assert_allclose(got.first_logprobs.numpy()[unpadded], expected.first_logprobs.numpy()[unpadded],
                                   atol=1e-5)


def test_numeric_options_do_not_recompile_and_reasons_are_logged(gpt2_model, caplog):
    generator = CompiledGenerator(gpt2_model)
    ids = random_ids((2, 6), 64, seed=72)
    with caplog.at_level(logging.INFO, logger="xlagen"):
        for value in (0.5, 0.8, 1.2):
            generator.generate(ids, do_sample=True, temperature=value, top_p=value / 2, top_k=10 + int(value * 10),
                               repetition_penalty=value + 0.5, seed=[1, int(value * 10)], max_new_tokens=5 + int(value),
                               pad_token_id=PAD, eos_token_id=[0, 3])
        assert generator.compile_count == 1
        generator.generate(ids, max_new_tokens=5, num_beams=2, pad_token_id=PAD, eos_token_id=[0, 3])
        generator.generate(random_ids((2, 20), 64), max_new_tokens=5, num_beams=2, pad_token_id=PAD,
                           eos_token_id=[0, 3])
    reasons = [event.reason for event in generator.trace_log]
    assert reasons[0] == "first call"
    assert "num beams 1 -> 2" in reasons[1] and "do sample True -> False" in reasons[1]
    assert reasons[2] == "prompt bucket 8 -> 32"
    assert "prompt bucket 8 -> 32" in caplog.text


def test_threads_share_one_program(gpt2_model):
    generator = CompiledGenerator(gpt2_model)
    ids = random_ids((2, 6), 64, seed=73)
    expected = gpt2_model.generate(ids, max_new_tokens=6, pad_token_id=PAD).numpy()
    outputs, errors = [], []

    def work():
        try:
            outputs.append(generator.generate(ids, max_new_tokens=6, pad_token_id=PAD).numpy())
        except Exception as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert generator.compile_count == 1
    for output in outputs:
        np.testing.assert_array_equal(output, expected)


def test_large_batches_are_split_and_limits_are_named(gpt2_model):
    generator = CompiledGenerator(gpt2_model, Buckets(batch_sizes=(1, 2), prompt_lengths=(8,), new_tokens=(8,)))
    ids = random_ids((5, 4), 64, seed=74)
    np.testing.assert_array_equal(generator.generate(ids, max_new_tokens=5, pad_token_id=PAD).numpy(),
                                  gpt2_model.generate(ids, max_new_tokens=5, pad_token_id=PAD).numpy())
    with pytest.raises(ValueError, match="prompt length 9 exceeds the largest bucket 8"):
        generator.generate(random_ids((1, 9), 64), max_new_tokens=5)
    with pytest.raises(ValueError, match="max_new_tokens 9 exceeds the largest bucket 8"):
        generator.generate(ids, max_new_tokens=9)
    with pytest.raises(ValueError, match="ascending"):
        Buckets(batch_sizes=(4, 2))


def test_warmup_compiles_ahead(gpt2_model):
    generator = CompiledGenerator(gpt2_model)
    generator.warmup(batch_sizes=(2,), prompt_lengths=(6,), max_new_tokens=(5,), pad_token_id=PAD)
    assert generator.compile_count == 1
    generator.generate(random_ids((2, 7), 64), max_new_tokens=9, pad_token_id=PAD)
    assert generator.compile_count == 1
