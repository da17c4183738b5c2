"""from_pretrained: folders, the HF cache, sharded checkpoints, and clear errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from conftest import random_ids, save_tiny_gpt2
from xlagen import TFAutoModelForCausalLM, TFGPT2LMHeadModel


def _logits(model, ids):
    return model(ids).logits.numpy()


def test_sharded_checkpoint_loads_identically(tmp_path, gpt2_checkpoint, gpt2_model):
    _, reference = gpt2_checkpoint
    reference.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ids = random_ids((1, 6), 64)
    np.testing.assert_array_equal(_logits(TFGPT2LMHeadModel.from_pretrained(tmp_path), ids),
                                  _logits(gpt2_model, ids))


def test_loads_from_hf_cache_by_repo_id(tmp_path, gpt2_checkpoint, gpt2_model, monkeypatch):
    folder, _ = gpt2_checkpoint
    snapshot = tmp_path / "models--tiny--gpt2" / "snapshots" / ("a" * 40)
    shutil.copytree(folder, snapshot)
    (tmp_path / "models--tiny--gpt2" / "refs").mkdir()
    (tmp_path / "models--tiny--gpt2" / "refs" / "main").write_text("a" * 40)
    model = TFAutoModelForCausalLM.from_pretrained("tiny/gpt2", cache_dir=tmp_path, local_files_only=True)
    ids = random_ids((1, 6), 64)
    np.testing.assert_array_equal(_logits(model, ids), _logits(gpt2_model, ids))


def test_generation_config_json_gives_defaults(tmp_path):
    save_tiny_gpt2(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3, "eos_token_id": None,
                                                                 "pad_token_id": 1}))
    model = TFAutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.generate(random_ids((1, 4), 64)).shape == (1, 7)


def test_pickle_checkpoint_is_refused_with_instructions(tmp_path):
    save_tiny_gpt2(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(OSError, match="(?s)pickle.*safe_serialization"):
        TFAutoModelForCausalLM.from_pretrained(tmp_path)


def test_tensor_problems_are_reported_together(tmp_path):
    from safetensors.numpy import load_file, save_file

    save_tiny_gpt2(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["transformer.h.0.ln_1.weight"]
    tensors["transformer.h.1.mlp.c_fc.bias"] = np.zeros(7, np.float32)
    tensors["transformer.extra.weight"] = np.zeros(3, np.float32)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as error:
        TFAutoModelForCausalLM.from_pretrained(tmp_path)
    message = str(error.value)
    for name in ("h.0.ln_1.weight", "h.1.mlp.c_fc.bias", "extra.weight"):
        assert name in message


def test_unknown_model_type_and_missing_folder(tmp_path):
    save_tiny_gpt2(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    with pytest.raises(ValueError, match="model_type 'mamba' is not supported"):
        TFAutoModelForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(OSError):
        TFAutoModelForCausalLM.from_pretrained(tmp_path / "nope")
    (tmp_path / "config.json").unlink()
    with pytest.raises(OSError, match="config.json"):
        TFAutoModelForCausalLM.from_pretrained(tmp_path)
