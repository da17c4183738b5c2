"""`run_blocks` traces the blocks of one spec once (a nested tf.function fed each block's weights): the
compiled programs compute what block-by-block tracing computes, from each block's own weights."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import random_ids, requires_kernels, tiny_family_model
from xlagen import native
from xlagen.layers import block as block_lib


def _generate(model, inputs: dict, shared: bool, monkeypatch, **options):
    """(generate output with scores, TensorFlow operations traced, graph and function bodies)."""
    kernels = native.Kernels(share_traces=shared)
    program = tf.function(lambda inputs: model.generate(**inputs, output_scores=True, return_dict_in_generate=True,
                                                        kernels=kernels, **options), jit_compile=True)
    graph = program.get_concrete_function(inputs).graph.as_graph_def()
    operations = len(graph.node) + sum(len(function.node_def) for function in graph.library.function)
    return program(inputs), operations


def _assert_sharing_changes_nothing(model, inputs: dict, monkeypatch, **options):
    (shared, shared_ops), (own, own_ops) = (_generate(model, inputs, True, monkeypatch, **options),
                                            _generate(model, inputs, False, monkeypatch, **options))
    np.testing.assert_array_equal(shared.sequences.numpy(), own.sequences.numpy())
    for a, b in zip(shared.scores, own.scores):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    return shared_ops, own_ops


def _tiny_gpt2(**config):
    from xlagen.modeling import TFGPT2LMHeadModel
    from xlagen.models.gpt2 import GPT2Config

    keras.utils.set_random_seed(7)
    return TFGPT2LMHeadModel(GPT2Config(vocab_size=300, hidden_size=32, num_layers=4, num_heads=4,
                                        max_positions=64, **config))


@pytest.mark.parametrize("options", [{"max_new_tokens": 8}, {"max_new_tokens": 6, "num_beams": 3}])
def test_gpt2_generates_the_same_with_one_trace_per_block_spec(monkeypatch, options):
    model = _tiny_gpt2()
    ids = random_ids((2, 7), 300, seed=3)
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    shared_ops, own_ops = _assert_sharing_changes_nothing(model, {"input_ids": ids, "attention_mask": mask},
                                                          monkeypatch, **options)
    # Four blocks traced in two places (prompt, step): 3 traces (the prompt's last block, which goes on with
    # the last token's row only, has its own) instead of 8.
    assert shared_ops < 0.7 * own_ops


def test_blocks_of_different_specs_get_their_own_trace(monkeypatch):
    # GPT-2's scale_attn_by_inverse_layer_idx gives each block its own attention scale: nothing is shared,
    # and every block keeps its scale.
    model = _tiny_gpt2(scale_attn_by_inverse_layer_idx=True)
    assert len({block.spec for block in model.blocks}) == 4
    ids = random_ids((1, 5), 300, seed=2)
    _assert_sharing_changes_nothing(model, {"input_ids": ids}, monkeypatch, max_new_tokens=5)


@requires_kernels
@pytest.mark.parametrize("weight_dtype", ["bfloat16", "int8"])
def test_each_block_reads_its_own_packed_weights(monkeypatch, weight_dtype):
    model = _tiny_gpt2()
    model.pack_weights(weight_dtype)
    ids = random_ids((1, 5), 300, seed=4)
    _assert_sharing_changes_nothing(model, {"input_ids": ids}, monkeypatch, max_new_tokens=6, num_beams=2)


@pytest.mark.parametrize("family", ["opt", "t5", "whisper"])
def test_other_models_generate_the_same_with_shared_traces(tmp_path, monkeypatch, family):
    model, inputs = tiny_family_model(tmp_path, family)  # T5: encoder and decoder stacks, position bias
    _assert_sharing_changes_nothing(model, inputs, monkeypatch, max_new_tokens=5, num_beams=2)


def test_eager_calls_and_training_run_block_by_block():
    assert block_lib._share_traces(False) is False  # eager: nothing to trace
    seen = []

    @tf.function
    def traced(training):
        seen.append((training, block_lib._share_traces(training)))
        return tf.constant(0)

    traced(False)
    traced(True)
    assert seen == [(False, True), (True, False)]
