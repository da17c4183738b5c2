"""A short, bounded fuzz of checkpoint loading: random mutations and truncations of a valid tiny GPT-2
folder's config.json, tokenizer files and model.safetensors. Only the documented error types may
escape (ValueError, OSError); never a TypeError, a ZeroDivisionError, a safetensors or tokenizers error,
or a panic. Configs are checked up to the point where the model would be built (`_checked_config`)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from conftest import build_bpe_tokenizer
from xlagen import AutoTokenizer, modeling
from xlagen.models.gpt2 import GPT2Config
from xlagen.weights.checkpoint import read_checkpoint, read_checkpoint_shapes

FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
DOCUMENTED = (ValueError, OSError)

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)


def _gpt2_tensors(config: GPT2Config) -> dict[str, np.ndarray]:
    """Random GPT-2 weights with transformers' names and shapes (written without torch)."""
    h, f, rng = config.hidden_size, config.intermediate_size, np.random.default_rng(0)
    shapes = {"wte.weight": (config.vocab_size, h), "wpe.weight": (config.max_positions, h), "ln_f.weight": (h,),
              "ln_f.bias": (h,)}
    for i in range(config.num_layers):
        shapes.update({f"h.{i}.{name}": shape for name, shape in {
            "ln_1.weight": (h,), "ln_1.bias": (h,), "attn.c_attn.weight": (h, 3 * h), "attn.c_attn.bias": (3 * h,),
            "attn.c_proj.weight": (h, h), "attn.c_proj.bias": (h,), "ln_2.weight": (h,), "ln_2.bias": (h,),
            "mlp.c_fc.weight": (h, f), "mlp.c_fc.bias": (f,), "mlp.c_proj.weight": (f, h),
            "mlp.c_proj.bias": (h,)}.items()})
    return {f"transformer.{name}": rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


@pytest.fixture(scope="module")
def valid_folder(tmp_path_factory) -> pathlib.Path:
    """A valid tiny GPT-2 folder: config.json, model.safetensors, tokenizer files."""
    folder = tmp_path_factory.mktemp("fuzz-gpt2")
    vocab = build_bpe_tokenizer(folder, vocab_size=280)
    config = GPT2Config(vocab_size=vocab, hidden_size=16, num_layers=2, num_heads=2, max_positions=32)
    (folder / "config.json").write_text(json.dumps(config.to_hf_config()))
    save_file(_gpt2_tensors(config), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _copy(folder: pathlib.Path) -> pathlib.Path:
    target = pathlib.Path(tempfile.mkdtemp(prefix="xlagen-fuzz-")) / "model"
    shutil.copytree(folder, target)
    return target


def _mutate_json(data, draw_data):
    """Replaces one value somewhere inside `data` (a random path) by a random JSON value."""
    if not isinstance(data, (dict, list)) or not data or draw_data.draw(st.booleans(), label="stop here"):
        return draw_data.draw(JSON_VALUES, label="new value")
    key = draw_data.draw(st.sampled_from(sorted(data) if isinstance(data, dict) else range(len(data))), label="key")
    data[key] = _mutate_json(data[key], draw_data)
    return data


def _mutate_bytes(raw: bytes, data) -> bytes:
    """Truncates `raw`, or overwrites a few of its bytes (mostly near the start, where headers are)."""
    if data.draw(st.booleans(), label="truncate"):
        return raw[:data.draw(st.integers(0, len(raw) - 1), label="length")]
    raw = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4), label="flips")):
        position = data.draw(st.integers(0, min(len(raw) - 1, 400)), label="position")
        raw[position] = data.draw(st.integers(0, 255), label="byte")
    return bytes(raw)


def _load_config(folder: pathlib.Path):
    architecture, hf_config = modeling._read_config(folder, modeling.TFAutoModelForCausalLM.architectures, "test")
    return modeling._checked_config(architecture, folder, hf_config)


def _load_changed(valid_folder: pathlib.Path, name: str, content: bytes, *loaders) -> None:
    """Writes `content` as `name` in a copy of the valid folder and runs each loader on it: only documented
    errors may escape (any other exception fails the test)."""
    folder = _copy(valid_folder)
    try:
        (folder / name).write_bytes(content)
        for load in loaders:
            try:
                load(folder)
            except DOCUMENTED:
                pass
    finally:
        shutil.rmtree(folder.parent)


@FUZZ
@given(data=st.data())
def test_fuzzed_config_json_gives_only_documented_errors(valid_folder, data):
    config = json.loads((valid_folder / "config.json").read_text())
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        key = data.draw(st.sampled_from(sorted(config)) | st.text(max_size=6), label="config key")
        config[key] = data.draw(JSON_VALUES | st.integers(0, 2 ** 40), label="config value")
    _load_changed(valid_folder, "config.json", json.dumps(config).encode(), _load_config)


@FUZZ
@given(data=st.data())
def test_fuzzed_tokenizer_files_give_only_documented_errors(valid_folder, data):
    name = data.draw(st.sampled_from(["tokenizer.json", "tokenizer_config.json"]), label="file")
    text = (valid_folder / name).read_text()
    if data.draw(st.booleans(), label="as JSON"):
        content = json.dumps(_mutate_json(json.loads(text), data)).encode()
    else:
        content = _mutate_bytes(text.encode(), data)
    _load_changed(valid_folder, name, content, AutoTokenizer.from_pretrained)


@FUZZ
@given(data=st.data())
def test_fuzzed_safetensors_give_only_documented_errors(valid_folder, data):
    raw = (valid_folder / "model.safetensors").read_bytes()
    if data.draw(st.booleans(), label="header as JSON"):
        size = int.from_bytes(raw[:8], "little")
        header = _mutate_json(json.loads(raw[8:8 + size]), data)
        text = json.dumps(header).encode()
        content = len(text).to_bytes(8, "little") + text + raw[8 + size:]
    else:
        content = _mutate_bytes(raw, data)
    _load_changed(valid_folder, "model.safetensors", content, read_checkpoint_shapes, read_checkpoint)


def test_fuzz_starts_from_a_valid_folder(valid_folder):
    assert _load_config(valid_folder).num_layers == 2
    assert AutoTokenizer.from_pretrained(valid_folder).encode("hello world")
    assert len(read_checkpoint(valid_folder)) == 4 + 2 * 12
