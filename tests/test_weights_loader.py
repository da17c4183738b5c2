"""Tests for xlagen.weights.checkpoint (reading safetensors) and xlagen.weights.loader (convert)."""

import copy
import json

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

from xlagen.weights.checkpoint import read_checkpoint, read_json
from xlagen.weights.loader import (
    CheckpointMismatchError,
    Rule,
    chain,
    concat_first,
    concat_last,
    convert,
    identity,
    normalize_prefix,
    split_last,
    transpose,
)


def _random_tensors(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "wte.weight": rng.standard_normal((8, 4)).astype(np.float32),
        "h.0.ln.weight": rng.standard_normal(4).astype(np.float16),
        "h.0.attn.bias": np.tril(np.ones((3, 3), dtype=bool)),
        "position_ids": np.arange(5, dtype=np.int64),
    }


def _assert_same(got, want):
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        np.testing.assert_array_equal(got[name], value, err_msg=name)


# --- read_checkpoint -------------------------------------------------------------------------


def test_single_file_round_trip(tmp_path):
    tensors = _random_tensors()
    safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors")
    _assert_same(read_checkpoint(tmp_path), tensors)
    _assert_same(read_checkpoint(str(tmp_path)), tensors)


def test_hand_written_two_shard_index(tmp_path):
    tensors = _random_tensors()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    for shard, shard_names in shards.items():
        safetensors.numpy.save_file({n: tensors[n] for n in shard_names}, tmp_path / shard)
    weight_map = {n: shard for shard, shard_names in shards.items() for n in shard_names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _assert_same(read_checkpoint(tmp_path), tensors)


def test_single_file_wins_over_index(tmp_path):
    tensors = _random_tensors()
    safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"x": "gone.safetensors"}}')
    _assert_same(read_checkpoint(tmp_path), tensors)


@pytest.fixture(scope="module")
def tiny_gpt2():
    """A tiny random transformers GPT-2 (test dependency only)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def _saved_state(model):
    # save_pretrained drops tied copies (lm_head.weight is wte.weight), so compare on shared names.
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def test_real_sharded_gpt2_checkpoint(tmp_path, tiny_gpt2):
    tiny_gpt2.save_pretrained(tmp_path, max_shard_size="20KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "model.safetensors").exists()
    tensors = read_checkpoint(tmp_path)
    index = read_json(tmp_path, "model.safetensors.index.json")
    assert sorted(tensors) == sorted(index["weight_map"])
    state = _saved_state(tiny_gpt2)
    assert "transformer.h.1.mlp.c_fc.weight" in tensors
    for name, value in tensors.items():
        assert value.dtype == np.float32
        np.testing.assert_array_equal(value, state[name], err_msg=name)
    assert read_json(tmp_path, "config.json")["n_layer"] == 2


def test_real_bfloat16_gpt2_checkpoint(tmp_path, tiny_gpt2):
    model = copy.deepcopy(tiny_gpt2).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    state = _saved_state(model)
    tensors = read_checkpoint(tmp_path)
    for name, value in tensors.items():
        assert value.dtype == np.float32, name
        np.testing.assert_array_equal(value, state[name], err_msg=name)


def test_bfloat16_is_widened_exactly(tmp_path):
    torch.manual_seed(0)
    bf16 = torch.randn(2, 3, dtype=torch.bfloat16)
    special = torch.tensor([0.0, -0.0, 1e-40, 3.0e38, -3.0e38], dtype=torch.bfloat16)
    others = {
        "a_f32": torch.randn(5),
        "m_f16": torch.randn(3, dtype=torch.float16),
        "z_i32": torch.arange(4, dtype=torch.int32),
    }
    safetensors.torch.save_file({"w": bf16, "special": special, **others}, tmp_path / "model.safetensors")
    tensors = read_checkpoint(tmp_path)
    assert tensors["w"].dtype == np.float32 and tensors["w"].shape == (2, 3)
    np.testing.assert_array_equal(tensors["w"], bf16.float().numpy())
    np.testing.assert_array_equal(tensors["special"], special.float().numpy())
    assert tensors["m_f16"].dtype == np.float16
    for name, value in others.items():
        np.testing.assert_array_equal(tensors[name], value.numpy())
    # Infinities widen exactly too, and are then refused as weights.
    infinite = torch.tensor([1.0, float("inf"), -float("inf")], dtype=torch.bfloat16)
    safetensors.torch.save_file({"w": bf16, "infinite": infinite}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"weights in 1 tensor\(s\): infinite \(0 NaN, 2 infinite of 3\)"):
        read_checkpoint(tmp_path)


def test_unsupported_numpy_dtype_raises(tmp_path):
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch without float8")
    safetensors.torch.save_file({"f8": torch.zeros(2, dtype=torch.float8_e4m3fn)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="'f8'.*F8_E4M3"):
        read_checkpoint(tmp_path)


@pytest.mark.parametrize("filename", ["pytorch_model.bin", "model.pt", "model.ckpt", "tf_model.h5"])
def test_pickle_only_folder_is_refused(tmp_path, filename):
    (tmp_path / "config.json").write_text("{}")
    torch.save({"w": torch.zeros(2)}, tmp_path / filename)
    with pytest.raises(OSError) as info:
        read_checkpoint(tmp_path)
    message = str(info.value)
    assert filename in message
    assert "arbitrary code" in message
    assert "safe_serialization=True" in message and "safetensors/convert" in message


def test_sharded_pickle_index_is_refused(tmp_path):
    (tmp_path / "pytorch_model.bin.index.json").write_text('{"weight_map": {}}')
    with pytest.raises(OSError, match="arbitrary code"):
        read_checkpoint(tmp_path)


def test_empty_folder_lists_what_was_looked_for(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(OSError) as info:
        read_checkpoint(tmp_path)
    message = str(info.value)
    assert "model.safetensors" in message and "model.safetensors.index.json" in message
    assert "config.json" in message


def test_other_safetensors_names_are_reported(tmp_path):
    safetensors.numpy.save_file({"x": np.zeros(1, np.float32)}, tmp_path / "adapter_model.safetensors")
    with pytest.raises(OSError, match="adapter_model.safetensors"):
        read_checkpoint(tmp_path)


def test_missing_folder_raises(tmp_path):
    with pytest.raises(OSError, match="No such checkpoint folder"):
        read_checkpoint(tmp_path / "absent")


def test_missing_shards_are_named(tmp_path, tiny_gpt2):
    tiny_gpt2.save_pretrained(tmp_path, max_shard_size="20KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    shards[0].unlink()
    shards[-1].unlink()
    with pytest.raises(OSError) as info:
        read_checkpoint(tmp_path)
    message = str(info.value)
    assert shards[0].name in message and shards[-1].name in message
    assert f"2 of {len(shards)} shards" in message
    assert shards[1].name not in message


def test_index_naming_absent_tensor_raises(tmp_path):
    safetensors.numpy.save_file({"a": np.zeros(1, np.float32)}, tmp_path / "s1.safetensors")
    weight_map = {"a": "s1.safetensors", "ghost": "s1.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match="ghost"):
        read_checkpoint(tmp_path)


def test_index_without_weight_map_raises(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match="weight_map"):
        read_checkpoint(tmp_path)


# --- read_json -------------------------------------------------------------------------------


def test_read_json(tmp_path):
    (tmp_path / "config.json").write_text('{"n_layer": 2}')
    assert read_json(tmp_path, "config.json") == {"n_layer": 2}
    assert read_json(tmp_path, "generation_config.json", required=False) is None
    with pytest.raises(FileNotFoundError, match="generation_config.json"):
        read_json(tmp_path, "generation_config.json")
    (tmp_path / "bad.json").write_text('{"n_layer": 2,}')
    with pytest.raises(ValueError, match="bad.json.*not valid JSON"):
        read_json(tmp_path, "bad.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="list.json.*JSON object"):
        read_json(tmp_path, "list.json", required=False)


# --- transforms ------------------------------------------------------------------------------


def test_transforms():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = a + 10
    np.testing.assert_array_equal(identity([a]), a)
    np.testing.assert_array_equal(transpose([a]), a.T)
    np.testing.assert_array_equal(concat_last([a, b]), np.hstack([a, b]))
    np.testing.assert_array_equal(concat_first([a, b]), np.vstack([a, b]))
    fused = np.arange(12, dtype=np.float32).reshape(2, 6)
    np.testing.assert_array_equal(split_last(1, 3)([fused]), fused[:, 2:4])
    np.testing.assert_array_equal(chain(transpose, split_last(0, 2))([fused]), fused.T[:, :1])
    assert split_last(2, 3).__name__ == "split_last(2, 3)"
    with pytest.raises(ValueError):
        transpose([np.zeros(3)])
    with pytest.raises(ValueError):
        identity([a, b])
    with pytest.raises(ValueError):
        split_last(3, 3)


def test_rule_normalizes_sources():
    assert Rule("x", "a.weight").sources == ("a.weight",)
    with pytest.raises(ValueError):
        Rule("x", ())


# --- convert ---------------------------------------------------------------------------------


def _gpt2_like():
    rng = np.random.default_rng(1)
    tensors = {
        "h.0.attn.q.weight": rng.standard_normal((4, 4)).astype(np.float16),
        "h.0.attn.k.weight": rng.standard_normal((4, 4)).astype(np.float32),
        "h.0.attn.v.weight": rng.standard_normal((4, 4)).astype(np.float32),
        "h.0.mlp.fc.weight": rng.standard_normal((8, 4)).astype(np.float32),
        "h.0.attn.bias": np.ones((1, 1, 4, 4), dtype=bool),
        "ids": np.arange(4, dtype=np.int64),
    }
    rules = [
        Rule("blocks.0.attention.qkv.kernel", ("h.0.attn.q.weight", "h.0.attn.k.weight", "h.0.attn.v.weight"),
             concat_last),
        Rule("blocks.0.mlp.kernel", ("h.0.mlp.fc.weight",), transpose),
        Rule("ids", ("ids",)),
    ]
    expected = {"blocks.0.attention.qkv.kernel": (4, 12), "blocks.0.mlp.kernel": [4, 8], "ids": (4,)}
    return rules, tensors, expected


def test_convert_applies_rules_and_casts():
    rules, tensors, expected = _gpt2_like()
    out = convert(rules, tensors, expected, ignore=[r"h\.\d+\.attn\.bias"])
    assert sorted(out) == sorted(expected)
    qkv = out["blocks.0.attention.qkv.kernel"]
    assert qkv.dtype == np.float32 and qkv.shape == (4, 12)
    np.testing.assert_array_equal(qkv[:, :4], tensors["h.0.attn.q.weight"].astype(np.float32))
    mlp = out["blocks.0.mlp.kernel"]
    assert mlp.flags.c_contiguous
    np.testing.assert_array_equal(mlp, tensors["h.0.mlp.fc.weight"].T)
    assert out["ids"].dtype == np.int64
    kept = convert(rules, tensors, expected, ignore=[r".*\.bias"], dtype=None)
    assert kept["blocks.0.mlp.kernel"].dtype == np.float32
    half = convert(rules, tensors, expected, ignore=[r".*\.bias"], dtype=np.float16)
    assert half["blocks.0.mlp.kernel"].dtype == np.float16 and half["ids"].dtype == np.int64


def test_ignore_uses_fullmatch():
    rules, tensors, expected = _gpt2_like()
    tensors["h.0.attn.bias_extra"] = np.zeros(1, np.float32)
    with pytest.raises(CheckpointMismatchError) as info:
        convert(rules, tensors, expected, ignore=[r"h\.\d+\.attn\.bias"])
    assert info.value.unexpected == ["h.0.attn.bias_extra"]


def test_convert_reports_every_problem_at_once():
    rules, tensors, expected = _gpt2_like()
    del tensors["h.0.attn.k.weight"]  # missing source
    tensors["h.0.mlp.fc.weight"] = np.zeros((8, 5), np.float32)  # wrong shape
    tensors["lm_head.weight"] = np.zeros((2, 4), np.float32)  # unexpected
    expected["final_norm.gamma"] = (4,)  # no rule
    rules.append(Rule("not.a.variable", ("ids",)))  # unknown target
    rules.append(Rule("ids", ("ids",)))  # duplicate target
    with pytest.raises(CheckpointMismatchError) as info:
        convert(rules, tensors, expected)
    error = info.value
    assert isinstance(error, ValueError)
    assert error.missing == ["h.0.attn.k.weight"]
    assert error.unexpected == ["h.0.attn.bias", "lm_head.weight"]
    assert error.mismatched == [("blocks.0.mlp.kernel", (4, 8), (5, 8), ("h.0.mlp.fc.weight",))]
    assert error.unassigned == ["final_norm.gamma"]
    assert error.unknown_targets == ["not.a.variable"]
    assert error.duplicate_targets == ["ids"]
    message = str(error)
    for text in ["h.0.attn.k.weight", "lm_head.weight", "blocks.0.mlp.kernel: expected (4, 8), got (5, 8)",
                 "final_norm.gamma", "not.a.variable", "missing", "unexpected", "shape mismatches"]:
        assert text in message
    assert message.startswith("checkpoint does not match the model (7 problems)")


def test_failed_transform_is_reported_with_other_problems():
    rules, tensors, expected = _gpt2_like()
    tensors["h.0.attn.v.weight"] = np.zeros((3, 3), np.float32)
    tensors["stray"] = np.zeros(1, np.float32)
    with pytest.raises(CheckpointMismatchError) as info:
        convert(rules, tensors, expected, ignore=[r".*\.bias"])
    error = info.value
    ((target, sources, text),) = error.failed
    assert target == "blocks.0.attention.qkv.kernel" and "concat_last" in text and "h.0.attn.v.weight(3, 3)" in text
    assert error.unexpected == ["stray"]


def test_long_groups_are_truncated():
    tensors = {f"extra.{i:02d}": np.zeros(1, np.float32) for i in range(25)}
    with pytest.raises(CheckpointMismatchError) as info:
        convert([], tensors, {})
    message = str(info.value)
    assert "unexpected HF tensors" in message and "(25)" in message
    assert "extra.19" in message and "extra.20" not in message
    assert "... and 5 more" in message
    assert len(info.value.unexpected) == 25


def test_prefix_helpers():
    tensors = {"transformer.h.0.w": 1, "transformer.wte": 2, "lm_head.weight": 3}
    assert normalize_prefix(tensors, "transformer.") == {"h.0.w": 1, "wte": 2, "lm_head.weight": 3}
    assert normalize_prefix({"h.0.w": 1}, "transformer.") == {"h.0.w": 1}
    with pytest.raises(ValueError, match="both"):
        normalize_prefix({"wte": 1, "transformer.wte": 2}, "transformer.")


def test_real_gpt2_checkpoint_through_convert(tmp_path, tiny_gpt2):
    """read_checkpoint + normalize_prefix + convert on a real transformers save."""
    tiny_gpt2.save_pretrained(tmp_path)
    tensors = normalize_prefix(read_checkpoint(tmp_path), "transformer.")
    rules = [Rule("token_embedding", ("wte.weight",)), Rule("position_embedding", ("wpe.weight",))]
    for i in range(2):
        rules.append(Rule(f"blocks.{i}.attention.query.kernel", (f"h.{i}.attn.c_attn.weight",), split_last(0, 3)))
    expected = {"token_embedding": (128, 32), "position_embedding": (16, 32)}
    expected.update({f"blocks.{i}.attention.query.kernel": (32, 32) for i in range(2)})
    with pytest.raises(CheckpointMismatchError) as info:
        convert(rules, tensors, expected)
    assert "h.1.mlp.c_proj.weight" in info.value.unexpected and not info.value.missing
    out = convert(rules, tensors, expected, ignore=[r"h\.\d+\..*", r"ln_f\..*"])
    query = tiny_gpt2.transformer.h[1].attn.c_attn.weight.detach().numpy()[:, :32]
    np.testing.assert_array_equal(out["blocks.1.attention.query.kernel"], query)
