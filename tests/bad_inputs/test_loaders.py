"""Bad checkpoint folders: every broken config.json, weight file, shard index or tokenizer file gives a
documented error (ValueError / OSError) whose message names the culprit, before a model is built."""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import shutil
import struct
import time

import pytest
import safetensors.numpy

from xlagen import AutoTokenizer, TFAutoModelForCausalLM, modeling
from xlagen.hub import NotCachedError, resolve_model_dir
from xlagen.models.gpt2 import GPT2Config
from xlagen.models.opt import OPTConfig
from xlagen.models.llama import LlamaConfig
from xlagen.models.t5 import T5Config
from xlagen.models.whisper import WhisperConfig
from xlagen.text.tokenizer_files import backend_call
from xlagen.weights import checkpoint
from xlagen.weights.checkpoint import read_checkpoint, read_checkpoint_shapes


@pytest.fixture
def folder(gpt2_checkpoint, tmp_path) -> pathlib.Path:
    """A writable copy of the tiny GPT-2 folder (config, weights, tokenizer)."""
    return pathlib.Path(shutil.copytree(gpt2_checkpoint[0], tmp_path / "model"))


def _edit_config(**changes):
    def edit(folder):
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return edit


def _write(name: str, content: str | bytes):
    def write(folder):
        (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return write


def _truncate_weights(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _edit_header(change):
    """Rewrites the safetensors header of model.safetensors through `change(header)`, keeping the data."""
    def edit(folder):
        path = folder / "model.safetensors"
        raw = path.read_bytes()
        (size,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + size])
        change(header)
        text = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + size:])
    return edit


def _huge_shape(header):
    name = next(n for n in header if n != "__metadata__")
    header[name]["shape"] = [10 ** 12, 32]


def _huge_offsets(header):
    name = next(n for n in header if n != "__metadata__")
    header[name]["data_offsets"] = [0, 10 ** 15]


def _poison(values: dict[str, float]):
    """Sets one value of each named tensor of model.safetensors (e.g. to NaN) and rewrites the file."""
    def edit(folder):
        path = folder / "model.safetensors"
        tensors = safetensors.numpy.load_file(path)
        for name, value in values.items():
            tensors[name].flat[3] = value
        safetensors.numpy.save_file(tensors, path)
    return edit


def _shard(shard_name: str, link_outside: bool = False):
    """Replaces model.safetensors by an index whose one shard is `shard_name`."""
    def edit(folder):
        names = read_checkpoint_shapes(folder)
        outside = folder.parent / "outside.safetensors"
        shutil.move(folder / "model.safetensors", outside)
        if link_outside:
            (folder / shard_name).symlink_to(outside)
        index = {"metadata": {}, "weight_map": {name: shard_name for name in names}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return edit


def _index(text: str):
    """Replaces model.safetensors by the index `text`."""
    def edit(folder):
        (folder / "model.safetensors").unlink()
        (folder / "model.safetensors.index.json").write_text(text)
    return edit


def _absolute_shard(folder):
    _shard(str(folder.parent / "outside.safetensors"))(folder)


def _deep_json(folder):
    (folder / "config.json").write_text("[" * 100_000 + "]" * 100_000)


# A BPE whose merge "a b" makes a token missing from the vocabulary: `tokenizers` panics on it.
_PANICKING_TOKENIZER = json.dumps({
    "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
    "pre_tokenizer": None, "post_processor": None, "decoder": None,
    "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
              "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
              "vocab": {"a": 0, "b": 1}, "merges": ["a b"]}})


def _vocab_and_merges(vocab: str, merges: str):
    def edit(folder):
        (folder / "tokenizer.json").unlink()
        (folder / "vocab.json").write_text(vocab)
        (folder / "merges.txt").write_text(merges)
    return edit


def _edit_tokenizer_config(**changes):
    def edit(folder):
        path = folder / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return edit


MODEL, TOKENIZER, WEIGHTS = "model", "tokenizer", "weights"

# (id, how to break the folder, what loads it, error type, regex naming the culprit)
CASES = [
    # config.json: sizes never bounded up front, checked against the safetensors headers.
    ("n_layer_huge", _edit_config(n_layer=1_000_000), MODEL, ValueError, r"n_layer=1000000, but the checkpoint has 2"),
    ("n_embd_huge", _edit_config(n_embd=2 ** 20), MODEL, ValueError, r"n_embd=1048576.*'wte.weight' has shape"),
    ("vocab_size_huge", _edit_config(vocab_size=10 ** 10), MODEL, ValueError, r"vocab_size=10000000000.*wte.weight"),
    ("n_positions_larger", _edit_config(n_positions=4096), MODEL, ValueError, r"n_positions=4096.*wpe.weight"),
    ("n_inner_other", _edit_config(n_inner=7), MODEL, ValueError, r"n_inner=7.*c_fc.weight"),
    # config.json: wrong types and ranges name the key and the expected type.
    ("vocab_size_float", _edit_config(vocab_size=1e10), MODEL, ValueError,
     r"config.json: vocab_size must be a positive integer, got 10000000000.0 \(float\)"),
    ("n_head_zero", _edit_config(n_head=0), MODEL, ValueError, r"n_head must be a positive integer, got 0"),
    ("n_head_string", _edit_config(n_head="4"), MODEL, ValueError, r"n_head must be a positive integer, got '4' \(str\)"),
    ("n_layer_null", _edit_config(n_layer=None), MODEL, ValueError, r"n_layer must be a positive integer, got None"),
    ("n_layer_bool", _edit_config(n_layer=True), MODEL, ValueError, r"n_layer must be a positive integer, got True"),
    ("n_embd_nested", _edit_config(n_embd=[[[[[[32]]]]]]), MODEL, ValueError, r"n_embd must be a positive integer"),
    ("n_embd_indivisible", _edit_config(n_embd=30), MODEL, ValueError, r"n_embd 30 is not divisible by n_head 4"),
    ("epsilon_negative", _edit_config(layer_norm_epsilon=-1), MODEL, ValueError,
     r"layer_norm_epsilon must be a finite number > 0"),
    ("activation_number", _edit_config(activation_function=5), MODEL, ValueError,
     r"activation_function must be a string"),
    ("eos_token_string", _edit_config(eos_token_id="x"), MODEL, ValueError, r"eos_token_id must be"),
    ("dropout_above_one", _edit_config(resid_pdrop=2), MODEL, ValueError, r"resid_pdrop must be a number in \[0, 1\]"),
    ("model_type_list", _edit_config(model_type=["gpt2"]), MODEL, ValueError, r"model_type must be a string"),
    ("config_deeply_nested", _deep_json, MODEL, ValueError, r"config.json' nests its JSON too deeply"),
    ("config_not_object", _write("config.json", "[]"), MODEL, ValueError, r"config.json' must hold a JSON object"),
    # model.safetensors: corrupt files name the file.
    ("weights_truncated", _truncate_weights, MODEL, ValueError, r"model.safetensors' is not a valid safetensors file"),
    ("weights_garbage", _write("model.safetensors", os.urandom(4096)), MODEL, ValueError,
     r"model.safetensors' is not a valid safetensors file"),
    ("weights_empty", _write("model.safetensors", b""), MODEL, ValueError, r"model.safetensors' is not a safetensors"),
    ("weights_header_not_json", _write("model.safetensors", struct.pack("<Q", 4) + b"{{{{" + b"0" * 64), WEIGHTS,
     ValueError, r"model.safetensors' .*header is not JSON"),
    ("weights_header_huge_shape", _edit_header(_huge_shape), WEIGHTS, ValueError,
     r"model.safetensors' .*shape \[1000000000000, 32\]"),
    ("weights_header_huge_offsets", _edit_header(_huge_offsets), WEIGHTS, ValueError,
     r"model.safetensors' .*ends at byte 1000000000000000"),
    # model.safetensors: NaN or infinite weights name their tensors.
    ("weights_nan", _poison({"transformer.h.1.mlp.c_fc.weight": math.nan}), MODEL, ValueError,
     r"model.safetensors' holds NaN or infinite weights in 1 tensor\(s\): transformer.h.1.mlp.c_fc.weight "
     r"\(1 NaN, 0 infinite of 4096\)"),
    ("weights_inf", _poison({"transformer.wte.weight": math.inf, "transformer.ln_f.bias": -math.inf}), WEIGHTS,
     ValueError,
     r"in 2 tensor\(s\): transformer.ln_f.bias \(0 NaN, 1 infinite of 32\), transformer.wte.weight"),
    # Sharded index: shards stay inside the model folder.
    ("shard_absolute", _absolute_shard, MODEL, ValueError, r"weight_map entry '.*' names the shard '/"),
    ("shard_dotdot", _shard("../outside.safetensors"), MODEL, ValueError, r"names the shard '\.\./outside"),
    ("shard_symlink_outside", _shard("model-1.safetensors", link_outside=True), MODEL, ValueError,
     r"\('model-1.safetensors'\) leads to .*outside.safetensors', outside the model folder"),
    ("shard_name_not_string", _index('{"weight_map": {"wte.weight": 3}}'), WEIGHTS,
     ValueError, r"weight_map entry 'wte.weight' must be a shard file name"),
    # Tokenizer files: errors name the file (and the key).
    ("tokenizer_json_garbage", _write("tokenizer.json", "{not json"), TOKENIZER, ValueError,
     r"tokenizer.json' could not be loaded by the tokenizers library"),
    ("tokenizer_json_panics", _write("tokenizer.json", _PANICKING_TOKENIZER), TOKENIZER, ValueError,
     r"tokenizer.json' is inconsistent: the tokenizers library failed"),
    ("vocab_json_garbage", _vocab_and_merges("[1, 2]", "#version: 0.2\n"), TOKENIZER, ValueError,
     r"vocab.json' \+ '.*merges.txt' could not be loaded"),
    ("bos_token_number", _edit_tokenizer_config(bos_token=5), TOKENIZER, ValueError,
     r"tokenizer_config.json': bos_token must be a token string"),
    ("model_max_length_string", _edit_tokenizer_config(model_max_length="abc"), TOKENIZER, ValueError,
     r"tokenizer_config.json': model_max_length must be a positive finite number"),
    ("added_tokens_decoder_list", _edit_tokenizer_config(added_tokens_decoder=[1]), TOKENIZER, ValueError,
     r"tokenizer_config.json': added_tokens_decoder must be"),
    ("added_token_flag_string", _edit_tokenizer_config(
        added_tokens_decoder={"0": {"content": "<|endoftext|>", "lstrip": "yes"}}), TOKENIZER, ValueError,
     r"added token of '.*tokenizer_config.json'.* is malformed"),
    ("padding_side_up", _edit_tokenizer_config(padding_side="up"), TOKENIZER, ValueError,
     r"tokenizer_config.json': padding_side must be \"left\" or \"right\""),
    ("special_tokens_map_number", _write("special_tokens_map.json", '{"additional_special_tokens": 3}'), TOKENIZER,
     ValueError, r"special_tokens_map.json': additional_special_tokens must be a list"),
    ("added_token_id_not_ascii", _edit_tokenizer_config(added_tokens_decoder={"\u00b2": {"content": "x"}}), TOKENIZER,
     ValueError, r"tokenizer_config.json': added_tokens_decoder must be"),
    ("config_model_type_list_for_tokenizer", _edit_config(model_type=["gpt2"]), TOKENIZER, ValueError,
     r"config.json': model_type must be a string"),
    ("tokenizer_config_invalid_json", _write("tokenizer_config.json", "{"), TOKENIZER, ValueError,
     r"tokenizer_config.json' is not valid JSON"),
]


def _load(what: str, folder: pathlib.Path):
    if what == MODEL:
        return TFAutoModelForCausalLM.from_pretrained(folder)
    if what == TOKENIZER:
        return AutoTokenizer.from_pretrained(folder)
    return read_checkpoint(folder)


@pytest.mark.parametrize("case_id, breaks, what, error, message", CASES, ids=[case[0] for case in CASES])
def test_bad_checkpoint_folder(folder, case_id, breaks, what, error, message):
    breaks(folder)
    start = time.perf_counter()
    with pytest.raises(error, match=message):
        _load(what, folder)
    # Refused before a model is built or a large buffer allocated.
    assert time.perf_counter() - start < (1.0 if what != TOKENIZER else 5.0), case_id


def _rename_tensors(folder):
    """Renames every tensor (the config's size checks then find none of theirs)."""
    _edit_header(lambda header: header.update({f"other.{name}": header.pop(name) for name in list(header)
                                               if name != "__metadata__"}))(folder)


def test_config_much_larger_than_its_checkpoint_is_refused_before_building(folder):
    _rename_tensors(folder)
    _edit_config(n_layer=1_000_000)(folder)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"about 1.*e\+1\d parameters \(.*n_layer=1000000.*hold only 3.*e\+04 values"):
        TFAutoModelForCausalLM.from_pretrained(folder)
    assert time.perf_counter() - start < 1.0


def test_model_too_big_for_memory_is_refused_before_building(folder, monkeypatch):
    monkeypatch.setattr(modeling, "physical_memory", lambda: 4096)
    with pytest.raises(ValueError, match=r"about 3.*e\+04 parameters .*n_layer=2.*more than this machine's"):
        TFAutoModelForCausalLM.from_pretrained(folder)


def test_unreadable_weights_are_a_permission_error_naming_the_file(folder, monkeypatch):
    real_open = open

    def guarded(path, *args, **kwargs):
        if str(path).endswith("model.safetensors"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    # Root reads any file, so a chmod cannot make it unreadable here.
    monkeypatch.setattr(checkpoint, "open", guarded, raising=False)
    with pytest.raises(PermissionError, match=r"Permission denied: '.*model.safetensors'"):
        TFAutoModelForCausalLM.from_pretrained(folder)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_files_chmod(folder):
    for name in ("model.safetensors", "tokenizer.json"):
        os.chmod(folder / name, 0)
    with pytest.raises(PermissionError, match="model.safetensors"):
        TFAutoModelForCausalLM.from_pretrained(folder)
    with pytest.raises(PermissionError, match="tokenizer.json"):
        AutoTokenizer.from_pretrained(folder)


def test_interrupts_are_not_swallowed_by_the_tokenizer_wrapper():
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        backend_call("tokenizer.json", interrupted)


def test_panic_like_base_exceptions_become_value_errors():
    PanicException = type("PanicException", (BaseException,), {})

    def panics():
        raise PanicException("index out of range")

    with pytest.raises(ValueError, match=r"'x/tokenizer.json' is inconsistent.*index out of range"):
        backend_call("x/tokenizer.json", panics)


def test_hub_miss_offline_is_a_not_cached_error_with_its_reason(tmp_path):
    with pytest.raises(NotCachedError, match=r"'nobody/absent' \(revision 'main'\).*local_files_only=True") as info:
        resolve_model_dir("nobody/absent", cache_dir=tmp_path, local_files_only=True)
    assert (info.value.repo_id, info.value.reason) == ("nobody/absent", "local_files_only")


# Other families: config.json values checked by key, without any weights.
FAMILY_CASES = [
    (OPTConfig, {"num_attention_heads": 0}, r"num_attention_heads must be a positive integer, got 0"),
    (OPTConfig, {"hidden_size": 30, "num_attention_heads": 4}, r"hidden_size 30 is not divisible by num_attention_heads 4"),
    (OPTConfig, {"ffn_dim": "big"}, r"ffn_dim must be a positive integer, got 'big' \(str\)"),
    (OPTConfig, {"do_layer_norm_before": "yes"}, r"do_layer_norm_before must be true or false"),
    (T5Config, {"d_kv": 1.5}, r"d_kv must be a positive integer, got 1.5 \(float\)"),
    (T5Config, {"feed_forward_proj": ["gated"]}, r"feed_forward_proj must be a string"),
    (T5Config, {"relative_attention_max_distance": 10 ** 12}, r"relative_attention_max_distance must be more than"),
    (T5Config, {"relative_attention_num_buckets": 32, "relative_attention_max_distance": 16},
     r"relative_attention_max_distance must be more than relative_attention_num_buckets // 2 \(16\)"),
    (T5Config, {"layer_norm_epsilon": float("nan")}, r"layer_norm_epsilon must be a finite number > 0"),
    (WhisperConfig, {"decoder_attention_heads": 0}, r"decoder_attention_heads must be a positive integer"),
    (WhisperConfig, {"d_model": 30, "encoder_attention_heads": 4}, r"d_model 30 is not divisible by "
                                                                    r"encoder_attention_heads 4"),
    (WhisperConfig, {"max_source_positions": None}, r"max_source_positions must be a positive integer, got None"),
    (GPT2Config, {"n_inner": -1}, r"n_inner must be a positive integer, got -1"),
    (GPT2Config, {"pad_token_id": -5}, r"pad_token_id must be a non-negative integer token id or null"),
    (LlamaConfig, {"num_attention_heads": 4, "num_key_value_heads": 3}, r"num_attention_heads 4 is not a multiple "
                                                                        r"of num_key_value_heads 3"),
    (LlamaConfig, {"rms_norm_eps": 0}, r"rms_norm_eps must be a finite number > 0"),
    (LlamaConfig, {"rope_scaling": {"rope_type": "longrope"}}, r"rope_scaling.rope_type 'longrope' is not implemented"),
    (LlamaConfig, {"rope_parameters": {"rope_type": "linear"}}, r"rope_parameters: rope_type 'linear' needs factor"),
    (LlamaConfig, {"rope_parameters": {"rope_type": "linear", "factor": -2}},
     r"rope_parameters.factor: factor must be a finite number > 0"),
    (LlamaConfig, {"rope_scaling": {"type": "dynamic", "factor": 2.0, "extra_knob": 1}},
     r"rope_scaling keys \['extra_knob'\] are not implemented"),
    (LlamaConfig, {"partial_rotary_factor": 0.5, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
     r"partial_rotary_factor=0.5 with rope_type 'linear' is not supported"),
    (LlamaConfig, {"model_type": "qwen2", "use_sliding_window": "yes"}, r"use_sliding_window must be true or false"),
    (LlamaConfig, {"model_type": "qwen3", "num_hidden_layers": 1, "layer_types": ["sliding_attention"]},
     r"layer_types names sliding_attention layers but there is no window"),
    (LlamaConfig, {"model_type": "qwen3", "layer_types": ["full_attention"]}, r"layer_types must list 32 of"),
    (LlamaConfig, {"model_type": "mistral", "sliding_window": 0}, r"sliding_window must be a positive integer"),
    (LlamaConfig, {"hidden_act": "made_up"}, r"hidden_act: unsupported .* 'made_up'"),
]


@pytest.mark.parametrize("config_class, values, message", FAMILY_CASES,
                         ids=[f"{c.__name__}-{'-'.join(v)}" for c, v, _ in FAMILY_CASES])
def test_bad_config_values_name_the_key(config_class, values, message):
    with pytest.raises(ValueError, match=r"config.json: " + message):
        config_class.from_hf_config(values)


def test_shards_linked_into_the_hub_cache_blobs_are_read(gpt2_checkpoint, tmp_path):
    # The Hugging Face cache links snapshots/<rev>/<file> to ../../blobs/<hash>: not an escape.
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / "abc123"
    blobs = tmp_path / "models--org--tiny" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    shutil.copy(pathlib.Path(gpt2_checkpoint[0]) / "model.safetensors", blobs / "f00d")
    (snapshot / "model-1.safetensors").symlink_to(blobs / "f00d")
    names = read_checkpoint_shapes(gpt2_checkpoint[0])
    (snapshot / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: "model-1.safetensors"
                                                                                       for n in names}}))
    assert read_checkpoint_shapes(snapshot) == names


TINY_FAMILIES = [
    ("gpt2", GPT2Config(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, max_positions=32)),
    ("opt", OPTConfig(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=24, max_positions=32,
                      embedding_size=8)),
    ("t5", T5Config(vocab_size=64, hidden_size=16, num_layers=2, num_decoder_layers=3, num_heads=2, head_dim=4,
                    intermediate_size=24, relative_attention_buckets=8, relative_attention_max_distance=20, gated=True)),
    ("whisper", WhisperConfig(vocab_size=64, num_mel_bins=8, hidden_size=16, encoder_layers=1, encoder_heads=2,
                              encoder_ffn_dim=24, decoder_layers=2, decoder_heads=2, decoder_ffn_dim=32,
                              max_source_positions=16, max_positions=16)),
    ("llama", LlamaConfig(vocab_size=64, hidden_size=16, num_layers=2, num_heads=4, num_key_value_heads=2,
                          intermediate_size=24, attention_bias=True, attention_output_bias=True, mlp_bias=True)),
    ("qwen3", LlamaConfig(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, num_key_value_heads=1,
                          head_dim=12, intermediate_size=24, head_norm=True, tie_word_embeddings=True,
                          model_type="qwen3")),
]


@pytest.mark.parametrize("family, config", TINY_FAMILIES, ids=[family for family, _ in TINY_FAMILIES])
def test_size_checks_and_parameter_estimate_agree_with_each_family(family, config):
    """The size checks name real tensors and pass on a model's own tensors; each wrong size is caught;
    the parameter estimate is the model's parameter count (within 2%)."""
    import dataclasses

    import numpy as np

    from xlagen.models import registry
    from xlagen.weights.loader import check_sizes, export

    architecture = {**registry.CAUSAL_LM, **registry.SEQ2SEQ_LM, **registry.SPEECH_SEQ2SEQ}[family]
    model = modeling._PUBLIC[family](config)
    values = {v.path: np.asarray(v.numpy()) for v in model.weights}
    shapes = {name: value.shape for name, value in export(architecture.weights.rules(config), values).items()}
    sizes = architecture.weights.sizes(config)
    check_sizes(sizes, shapes, family)
    for size in sizes:
        if size.axis is not None:
            assert size.tensor in shapes, size
        with pytest.raises(ValueError, match=re.escape(f"{size.key}={size.value + 1}, but")):
            check_sizes([dataclasses.replace(size, value=size.value + 1)], shapes, family)
    count = sum(value.size for value in values.values())
    assert architecture.weights.parameter_count(config) == pytest.approx(count, rel=0.02)
