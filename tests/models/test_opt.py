"""OPT parity with transformers' PyTorch OPTForCausalLM on tiny random checkpoints."""

from __future__ import annotations

import json
import logging
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf
import torch
import transformers
from transformers.models.opt import modeling_opt

from conftest import random_ids
from generation.helpers import assert_same_tokens, eos_that_occurs, hf_generate, left_pad, max_logit_diff
from xlagen import OPTConfig, TFAutoModelForCausalLM, TFOPTForCausalLM

PAD = 1  # OPT's own pad id; differs from the tiny models' EOS 0 (see generation/test_generate.py)
VOCAB = 64
OPT_BASE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=48,
                max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=PAD)

VARIANTS = {
    "pre_norm": {},  # the OPT-125m layout
    "post_norm": {"do_layer_norm_before": False, "word_embed_proj_dim": 16},  # the OPT-350m layout
    "no_bias": {"enable_bias": False},
    "no_affine": {"layer_norm_elementwise_affine": False},
    "untied_head": {"tie_word_embeddings": False},
    "projected_pre_norm": {"word_embed_proj_dim": 16},
    "no_final_norm": {"_remove_final_layer_norm": True},
    "gelu": {"activation_function": "gelu"},
}
GENERATION_VARIANTS = ["pre_norm", "post_norm", "no_bias", "no_affine", "untied_head"]

# Left-padded prompts of unequal lengths: positions must follow the mask, not the column.
ROWS = [random_ids((1, n), VOCAB, seed=40 + n)[0] for n in (3, 7, 5)]


def _init_weights(self, module):
    # transformers 4.57's OPT initialiser fills LayerNorm weights unconditionally and so cannot build
    # layer_norm_elementwise_affine=False (whose LayerNorms have none); its forward pass handles it.
    if isinstance(module, torch.nn.LayerNorm) and module.weight is None:
        return
    _ORIGINAL_INIT(self, module)


_ORIGINAL_INIT = modeling_opt.OPTPreTrainedModel._init_weights


def save_tiny_opt(folder, seed: int = 0, **overrides):
    """A random transformers OPTForCausalLM saved as safetensors; returns the torch model (eval mode)."""
    torch.manual_seed(seed)
    config = transformers.OPTConfig(attn_implementation="eager", **{**OPT_BASE, **overrides})
    with mock.patch.object(modeling_opt.OPTPreTrainedModel, "_init_weights", _init_weights):
        model = transformers.OPTForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:  # peaked distributions: greedy/beam choices far from ties
                parameter.mul_(6.0)
            else:  # biases and norms away from 0 / 1, so that a swapped mapping shows
                parameter.add_(0.3 * torch.randn_like(parameter))
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def opt(tmp_path_factory):
    """variant -> (torch reference, xlagen model), each built once for the module."""
    built = {}

    def get(variant):
        if variant not in built:
            folder = tmp_path_factory.mktemp(f"opt_{variant}")
            reference = save_tiny_opt(folder, **VARIANTS[variant])
            built[variant] = reference, TFAutoModelForCausalLM.from_pretrained(folder)
        return built[variant]

    return get


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(opt, variant):
    reference, model = opt(variant)
    assert isinstance(model, TFOPTForCausalLM)
    ids, mask = left_pad(ROWS, PAD)
    assert max_logit_diff(reference, model, ids, mask) <= 1e-4
    full = random_ids((2, 11), VOCAB)
    assert max_logit_diff(reference, model, full, np.ones_like(full)) <= 1e-4


@pytest.mark.parametrize("case", [dict(), dict(num_beams=3, num_return_sequences=2, length_penalty=0.5)],
                         ids=["greedy", "beam"])
@pytest.mark.parametrize("variant", GENERATION_VARIANTS)
def test_generate_matches_transformers(opt, variant, case):
    reference, model = opt(variant)
    ids, mask = left_pad(ROWS, PAD)
    eos = eos_that_occurs(model, ids, mask=mask)
    options = dict(max_new_tokens=10, eos_token_id=eos, pad_token_id=PAD, **case)
    theirs = hf_generate(reference, ids, mask, do_sample=False, **options)
    if not case:
        assert (theirs[:, ids.shape[1]:] == eos).any(), "the test should exercise EOS"
    assert_same_tokens(model.generate(ids, attention_mask=mask, **options), theirs, PAD)


@pytest.mark.parametrize("num_beams", [1, 2])
@pytest.mark.parametrize("variant", ["pre_norm", "post_norm"])
def test_left_padded_rows_equal_rows_alone(opt, variant, num_beams):
    _, model = opt(variant)
    ids, mask = left_pad(ROWS, PAD)
    options = dict(max_new_tokens=8, pad_token_id=PAD, eos_token_id=None, num_beams=num_beams)
    batch = np.asarray(model.generate(ids, attention_mask=mask, **options))
    for i, row in enumerate(ROWS):
        alone = np.asarray(model.generate(row[None, :], **options))
        np.testing.assert_array_equal(batch[i, ids.shape[1]:], alone[0, len(row):])


@pytest.mark.parametrize("variant, case", [("post_norm", dict()), ("pre_norm", dict(num_beams=3))],
                         ids=["post_norm-greedy", "pre_norm-beam"])
def test_xla_equals_eager(opt, variant, case):
    _, model = opt(variant)
    ids, mask = left_pad(ROWS, PAD)
    options = dict(max_new_tokens=9, eos_token_id=eos_that_occurs(model, ids, mask=mask), pad_token_id=PAD, **case)
    eager = model.generate(ids, attention_mask=mask, **options)
    compiled = tf.function(model.generate, jit_compile=True)(input_ids=tf.constant(ids),
                                                             attention_mask=tf.constant(mask), **options)
    np.testing.assert_array_equal(compiled.numpy(), eager.numpy())


def test_prefill_plus_cached_steps_equal_full_forward(opt):
    _, model = opt("post_norm")
    ids, mask = left_pad(ROWS, PAD)
    real = mask.astype(bool)
    full = model(ids, attention_mask=mask).logits.numpy()
    cache = model.init_cache(len(ROWS), ids.shape[1])
    logits, cache = model.call_with_cache(tf.constant(ids[:, :4]), cache, tf.constant(0), mask)
    np.testing.assert_allclose(logits.numpy()[real[:, :4]], full[:, :4][real[:, :4]], atol=1e-5)
    for t in range(4, ids.shape[1]):
        logits, cache = model.call_with_cache(tf.constant(ids[:, t:t + 1]), cache, tf.constant(t), mask)
        np.testing.assert_allclose(logits.numpy()[:, 0], full[:, t], atol=1e-5)


def test_bare_opt_model_checkpoint_loads(opt, tmp_path):
    # Checkpoints saved from OPTModel (as the original facebook/opt-* ones) have no "model." prefix.
    reference, _ = opt("post_norm")
    reference.model.save_pretrained(tmp_path)
    model = TFOPTForCausalLM.from_pretrained(tmp_path)
    ids, mask = left_pad(ROWS, PAD)
    assert max_logit_diff(reference, model, ids, mask) <= 1e-4


def test_config_mapping(opt, tmp_path, caplog):
    assert OPTConfig.from_hf_config(transformers.OPTConfig().to_diff_dict()) == OPTConfig()
    reference, _ = opt("post_norm")
    reference.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="xlagen"):
        config = OPTConfig.from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    assert not caplog.records, "a saved config.json should hold no unknown keys"
    assert (config.norm_first, config.embedding_size, config.has_final_norm) == (False, 16, False)
    assert OPTConfig.from_hf_config(config.to_hf_config()) == config


@pytest.mark.parametrize("key, value", [("activation_function", "made_up"), ("pruned_heads", {"0": [1]}),
                                        ("num_attention_heads", 5)])
def test_unsupported_config_is_refused(tmp_path, key, value):
    save_tiny_opt(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(ValueError, match=key):
        TFAutoModelForCausalLM.from_pretrained(tmp_path)


def test_opt_class_refuses_other_model_types(gpt2_checkpoint):
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        TFOPTForCausalLM.from_pretrained(gpt2_checkpoint[0])


@pytest.mark.parametrize("variant", ["pre_norm", "post_norm"])
def test_save_pretrained_and_training_loss_match_transformers(opt, variant, tmp_path):
    reference, model = opt(variant)
    ids = random_ids((2, 9), 64, seed=81)
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        theirs = reloaded(torch.tensor(ids, dtype=torch.long), labels=torch.tensor(ids, dtype=torch.long))
    ours = model({"input_ids": ids})
    assert np.abs(theirs.logits.numpy() - ours.logits.numpy()).max() <= 1e-4
    assert abs(float(model.compute_loss(x={"input_ids": ids}, y_pred=ours)) - theirs.loss.item()) <= 1e-4
    np.testing.assert_array_equal(TFAutoModelForCausalLM.from_pretrained(tmp_path)(ids).logits.numpy(),
                                  ours.logits.numpy())
