"""GPT-2 parity with transformers' PyTorch GPT2LMHeadModel on tiny random checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import torch

from conftest import random_ids, save_tiny_gpt2
from xlagen import TFAutoModelForCausalLM, TFGPT2LMHeadModel

VARIANTS = {
    "default": {},
    "n_inner": {"n_inner": 48},
    "inverse_layer_idx": {"scale_attn_by_inverse_layer_idx": True},
    "reorder_and_upcast": {"reorder_and_upcast_attn": True},
    "unscaled": {"scale_attn_weights": False},
    "relu": {"activation_function": "relu"},
    "gelu": {"activation_function": "gelu"},
    "quick_gelu": {"activation_function": "quick_gelu"},
    "untied_head": {"tie_word_embeddings": False},
}


def _torch_logits(model, ids, mask=None):
    with torch.no_grad():
        kwargs = {} if mask is None else {"attention_mask": torch.tensor(mask)}
        return model(torch.tensor(ids, dtype=torch.long), **kwargs).logits.numpy()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(tmp_path, variant):
    reference = save_tiny_gpt2(tmp_path, **VARIANTS[variant])
    model = TFAutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(model, TFGPT2LMHeadModel)
    ids = random_ids((2, 11), 64)
    ours = model(ids).logits.numpy()
    assert np.abs(ours - _torch_logits(reference, ids)).max() <= 1e-4


def test_logits_with_padding_mask_match_on_real_tokens(gpt2_checkpoint, gpt2_model):
    _, reference = gpt2_checkpoint
    ids = random_ids((2, 9), 64, seed=1)
    mask = np.ones_like(ids)
    mask[1, 6:] = 0  # right padding: real positions must be unaffected
    ours = gpt2_model(ids, attention_mask=mask).logits.numpy()
    theirs = _torch_logits(reference, ids, mask)
    assert np.abs(ours[0] - theirs[0]).max() <= 1e-4
    assert np.abs(ours[1, :6] - theirs[1, :6]).max() <= 1e-4


def test_xla_forward_equals_eager(gpt2_model):
    ids = tf.constant(random_ids((2, 8), 64, seed=2))
    eager = gpt2_model(ids).logits
    compiled = tf.function(gpt2_model, jit_compile=True)(ids).logits
    np.testing.assert_allclose(compiled.numpy(), eager.numpy(), atol=1e-5)


def test_prefill_plus_cached_steps_equal_full_forward(gpt2_model):
    ids = random_ids((2, 10), 64, seed=3)
    full = gpt2_model(ids).logits.numpy()
    mask = np.ones((2, 10), np.int32)
    cache = gpt2_model.init_cache(2, 10)
    logits, cache = gpt2_model.call_with_cache(tf.constant(ids[:, :6]), cache, tf.constant(0), mask)
    np.testing.assert_allclose(logits.numpy(), full[:, :6], atol=1e-5)
    for t in range(6, 10):
        logits, cache = gpt2_model.call_with_cache(tf.constant(ids[:, t:t + 1]), cache, tf.constant(t), mask)
        np.testing.assert_allclose(logits.numpy()[:, 0], full[:, t], atol=1e-5)


def test_beam_layout_steps_follow_each_beams_own_history(gpt2_model):
    # Two prompts x three beams in the beam layout: after each step the beams continue other beams of
    # their prompt (only the slots table moves), and every row's logits must equal a full forward pass
    # over that row's own token history.
    ids = random_ids((2, 5), 64, seed=4)
    _, state = gpt2_model.prefill(tf.constant(ids), tf.ones((2, 5), tf.int32), 8)
    state = gpt2_model.expand_beams(state, 3)
    histories = [list(ids[row // 3]) for row in range(6)]
    for index, (tokens, parents) in enumerate([([7, 8, 9, 10, 11, 12], [2, 0, 0, 4, 5, 3]),
                                               ([13, 14, 15, 16, 17, 18], [1, 1, 2, 3, 3, 4]),
                                               ([19, 20, 21, 22, 23, 24], None)], start=5):
        logits, state = gpt2_model.decode_step(tf.constant(tokens, tf.int32)[:, None], tf.constant(index), state)
        histories = [history + [token] for history, token in zip(histories, tokens)]
        full = gpt2_model(np.array(histories, np.int32)).logits.numpy()[:, -1]
        np.testing.assert_allclose(logits.numpy(), full, atol=1e-5)
        if parents is not None:
            state = gpt2_model.reorder_state(state, tf.constant(parents, tf.int32))
            histories = [list(histories[parent]) for parent in parents]


def test_reorder_state_needs_the_beam_layout(gpt2_model):
    _, state = gpt2_model.prefill(tf.constant(random_ids((1, 3), 64)), tf.ones((1, 3), tf.int32), 5)
    with pytest.raises(ValueError, match="expand_beams"):
        gpt2_model.reorder_state(state, tf.constant([0]))


def test_keras_model_surface(gpt2_model):
    import keras

    assert isinstance(gpt2_model, keras.Model)
    assert gpt2_model.count_params() == sum(int(np.prod(v.shape)) for v in gpt2_model.weights)
    assert gpt2_model(random_ids((1, 4), 64))[0].shape == (1, 4, gpt2_model.config.vocab_size)


def test_unsupported_config_is_refused(tmp_path):
    save_tiny_gpt2(tmp_path)
    import json

    config = json.loads((tmp_path / "config.json").read_text())
    config["add_cross_attention"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="add_cross_attention"):
        TFAutoModelForCausalLM.from_pretrained(tmp_path)
    config.update(add_cross_attention=False, activation_function="made_up")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="made_up"):
        TFAutoModelForCausalLM.from_pretrained(tmp_path)
