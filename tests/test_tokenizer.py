"""Tests for xlagen.text.tokenizer against transformers' fast tokenizers, on tiny tokenizers trained here."""

import json
import pathlib

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from conftest import build_t5_tokenizer
from xlagen.text import tokenizer as xtok
from xlagen.text.auto_tokenizer import AutoTokenizer

transformers = pytest.importorskip("transformers")

CORPUS = [
    "TensorFlow is an open source library for machine learning.",
    "XLA compiles TensorFlow graphs into fast kernels for accelerators.",
    "Hello world! Text generation with transformers is fun, isn't it?",
    "The quick brown fox jumps over the lazy dog.",
] * 4
TEXTS = ["Hello world", "TensorFlow is fast, isn't it? XLA compiles graphs for machine learning.", "a", ""]


def _train(special_tokens: list[str]) -> tokenizers.Tokenizer:
    """A byte-level BPE tokenizer as GPT-2 has, trained on CORPUS."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special_tokens, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _train_metaspace() -> tokenizers.Tokenizer:
    """A T5-like tokenizer: Metaspace pre-tokenizer, "</s>" appended."""
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=150, special_tokens=["<pad>", "</s>", "<unk>"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return tok


def _write(folder: pathlib.Path, name: str, content: dict) -> None:
    (folder / name).write_text(json.dumps(content), encoding="utf-8")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, pathlib.Path]:
    """Tokenizer folders in the styles of the GPT-2, OPT and T5 checkpoints on the Hub."""
    gpt2, opt = _train(["<|endoftext|>"]), _train(["<s>", "<pad>", "</s>", "<unk>"])
    names = ("json", "files", "model_type", "opt", "t5", "t5_legacy", "t5_unigram", "prefix_json", "prefix_files")
    out = {name: tmp_path_factory.mktemp(name) for name in names}
    gpt2.save(str(out["json"] / "tokenizer.json"))
    gpt2.model.save(str(out["files"]))
    gpt2.save(str(out["model_type"] / "tokenizer.json"))
    for name in ("json", "files"):
        _write(out[name], "tokenizer_config.json", {"tokenizer_class": "GPT2Tokenizer", "model_max_length": 64})
    # Like openai-community/gpt2: the tokenizer class and special tokens come from config.json's model_type.
    _write(out["model_type"], "tokenizer_config.json", {"model_max_length": 64})
    _write(out["model_type"], "config.json", {"model_type": "gpt2"})
    # Like facebook/opt-125m: vocab+merges, bos "</s>" prepended, dict-valued special tokens.
    opt.model.save(str(out["opt"]))
    _write(out["opt"], "tokenizer_config.json", {
        "tokenizer_class": "GPT2Tokenizer", "add_bos_token": True, "errors": "replace", "truncation_side": "left",
        "bos_token": {"content": "</s>", "lstrip": False, "normalized": True, "rstrip": False, "single_word": False},
        "eos_token": "</s>", "unk_token": "</s>", "pad_token": "<pad>", "model_max_length": 32})
    _write(out["opt"], "special_tokens_map.json", {"bos_token": "</s>", "eos_token": "</s>", "unk_token": "</s>",
                                                   "pad_token": {"content": "<pad>", "special": True}})
    # T5-like tokenizer.json, also with the legacy Metaspace flag that transformers must not override.
    t5 = _train_metaspace()
    state = json.loads(t5.to_str())
    t5.save(str(out["t5"] / "tokenizer.json"))
    state["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "add_prefix_space": True}
    (out["t5_legacy"] / "tokenizer.json").write_text(json.dumps(state), encoding="utf-8")
    for name in ("t5", "t5_legacy"):
        _write(out[name], "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>",
                                                    "unk_token": "<unk>", "pad_token": "<pad>"})
    # A T5 checkpoint's tokenizer: Unigram (SentencePiece-style), "</s>" appended, "<pad>" id 0, class T5Tokenizer.
    build_t5_tokenizer(out["t5_unigram"])
    # ByteLevel add_prefix_space: transformers follows tokenizer_config.json (default False) over tokenizer.json.
    gpt2.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    gpt2.save(str(out["prefix_json"] / "tokenizer.json"))
    gpt2.model.save(str(out["prefix_files"]))
    _write(out["prefix_json"], "tokenizer_config.json", {"tokenizer_class": "GPT2Tokenizer"})
    _write(out["prefix_files"], "tokenizer_config.json",
           {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": True})
    return out


def _pair(folder: pathlib.Path, **kwargs):
    """(xlagen tokenizer, transformers tokenizer) loaded from the same folder with the same arguments."""
    return AutoTokenizer.from_pretrained(folder, **kwargs), transformers.AutoTokenizer.from_pretrained(
        str(folder), **kwargs)


def _assert_same_encoding(ours, theirs, return_tensors) -> None:
    keys = [key for key in ("input_ids", "attention_mask") if key in theirs]
    assert sorted(ours) == sorted(keys)
    for key in keys:
        if return_tensors is None:
            assert ours[key] == theirs[key], key
            continue
        assert isinstance(ours[key], np.ndarray) == (return_tensors == "np")
        assert np.asarray(ours[key]).dtype == np.int32
        np.testing.assert_array_equal(np.asarray(ours[key]), np.asarray(theirs[key]), err_msg=key)


CALLS = [
    {},
    {"padding": True},
    {"padding": "longest", "return_tensors": "np"},
    {"padding": True, "return_tensors": "tf"},
    {"padding": "max_length", "max_length": 48, "return_tensors": "tf"},
    # Ragged: transformers makes an object array or raises; xlagen raises.
    {"padding": "max_length", "max_length": 10, "return_tensors": "np"},
    {"padding": "max_length", "max_length": 10, "return_tensors": "tf"},
    {"padding": "max_length"},
    {"padding": True, "pad_to_multiple_of": 8, "return_tensors": "np"},
    {"padding": "max_length", "max_length": 8, "truncation": True, "return_tensors": "np"},
    {"padding": True, "max_length": 5, "truncation": "longest_first"},
    {"truncation": True, "max_length": 4},
    {"max_length": 4},
    {"truncation": True},
    {"padding": True, "add_special_tokens": False, "return_tensors": "np"},
    {"padding": True, "return_attention_mask": False, "return_tensors": "np"},
]


@pytest.mark.parametrize("kind", ["json", "files", "opt", "t5", "t5_unigram"])
@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("call", CALLS, ids=lambda call: "-".join(f"{k}={v}" for k, v in call.items()) or "plain")
def test_call_matches_transformers(folders, kind, padding_side, call):
    pad = {"pad_token": "<|endoftext|>"} if kind in ("json", "files") else {}
    ours, theirs = _pair(folders[kind], padding_side=padding_side, **pad)
    # transformers 5 has no TensorFlow: its numpy arrays stand for the tensors xlagen returns.
    reference_call = {**call, "return_tensors": "np"} if call.get("return_tensors") == "tf" else call
    for text in (TEXTS, TEXTS[1], [TEXTS[0]]):
        try:
            expected = theirs(text, **reference_call)
        except ValueError:
            expected = None
        if expected is None or (call.get("return_tensors") and expected["input_ids"].dtype == object):
            with pytest.raises(ValueError, match="different lengths"):
                ours(text, **call)
            continue
        _assert_same_encoding(ours(text, **call), expected, call.get("return_tensors"))


@pytest.mark.parametrize(
    "kind", ["json", "files", "model_type", "opt", "t5", "t5_legacy", "t5_unigram", "prefix_json", "prefix_files"])
def test_attributes_match_transformers(folders, kind):
    ours, theirs = _pair(folders[kind])
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id", "unk_token_id",
                 "pad_token_id", "padding_side", "model_max_length", "vocab_size", "all_special_ids"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert len(ours) == len(theirs)
    assert ours.get_vocab() == theirs.get_vocab()
    tokens = ["Ġworld", "</s>", "nope"]
    assert ours.convert_tokens_to_ids(tokens) == theirs.convert_tokens_to_ids(tokens)
    assert ours.convert_ids_to_tokens([5, 100, 2]) == theirs.convert_ids_to_tokens([5, 100, 2])
    assert ours.convert_ids_to_tokens(7) == theirs.convert_ids_to_tokens(7)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)


def test_prefix_space_follows_tokenizer_config(folders):
    with_prefix = AutoTokenizer.from_pretrained(folders["prefix_files"]).encode("Hello")
    assert with_prefix != AutoTokenizer.from_pretrained(folders["prefix_json"]).encode("Hello")
    assert AutoTokenizer.from_pretrained(folders["t5_legacy"]).encode("Hello")[0] == (
        AutoTokenizer.from_pretrained(folders["t5"]).encode("Hello")[0])


def test_guide_call_adds_pad_token(folders):
    ours, theirs = _pair(folders["json"], padding_side="left", pad_token="</s>")
    assert ours.pad_token_id == theirs.pad_token_id == ours.vocab_size == len(ours) - 1
    enc = ours(["TensorFlow is"], pad_to_multiple_of=8, padding=True, return_tensors="tf")
    _assert_same_encoding(enc, theirs(["TensorFlow is"], pad_to_multiple_of=8, padding=True, return_tensors="np"), "tf")
    assert enc.input_ids.shape == (1, 8) and enc.attention_mask is enc["attention_mask"]
    assert ours.decode(enc.input_ids[0], skip_special_tokens=True) == "TensorFlow is"


@pytest.mark.parametrize("kind", ["json", "files", "opt", "t5", "t5_unigram"])
def test_decode_matches_transformers(folders, kind):
    ours, theirs = _pair(folders[kind], padding_side="left", pad_token="<pad>")
    ids = theirs(TEXTS, padding=True, return_tensors="np")["input_ids"]
    for skip in (False, True):
        expected = theirs.batch_decode(ids, skip_special_tokens=skip)
        assert ours.batch_decode(ids, skip_special_tokens=skip) == expected
        assert ours.batch_decode(ids.tolist(), skip_special_tokens=skip) == expected
        tf_ids = ours(TEXTS, padding=True, return_tensors="tf").input_ids
        assert ours.batch_decode(tf_ids, skip_special_tokens=skip) == expected
        assert [ours.decode(row, skip_special_tokens=skip) for row in ids] == expected
        assert [ours.decode(row, skip_special_tokens=skip) for row in tf_ids] == expected
        row = list(ids[1])
        assert ours.decode(row, skip_special_tokens=skip) == theirs.decode(row, skip_special_tokens=skip)
    assert ours.decode([]) == theirs.decode([]) == ""
    assert ours.decode(int(ids[0, -1])) == theirs.decode(int(ids[0, -1]))


def test_clean_up_tokenization_spaces(folders):
    ours = AutoTokenizer.from_pretrained(folders["json"])
    ids = ours.encode("a . b")
    assert ours.decode(ids) == "a . b"
    assert ours.decode(ids, clean_up_tokenization_spaces=True) == "a. b"


def test_missing_files_error_names_folder_and_files(tmp_path):
    with pytest.raises(OSError) as info:
        AutoTokenizer.from_pretrained(tmp_path)
    for part in (str(tmp_path), "tokenizer.json", "vocab.json", "merges.txt"):
        assert part in str(info.value)


def test_padding_without_pad_token_raises(folders):
    ours, theirs = _pair(folders["json"])
    assert ours.pad_token is None
    with pytest.raises(ValueError, match="pad_token"):
        ours(TEXTS, padding=True)
    with pytest.raises(ValueError):
        theirs(TEXTS, padding=True)
    with pytest.raises(ValueError, match="padding=True"):
        ours(TEXTS, return_tensors="np")
    ours.pad_token = ours.eos_token
    assert ours.pad_token_id == ours.eos_token_id
    assert ours(TEXTS, padding=True).input_ids[-1] == [ours.eos_token_id] * len(ours(TEXTS[1]).input_ids)


def test_bad_arguments_raise(folders):
    with pytest.raises(ValueError, match="padding_side"):
        AutoTokenizer.from_pretrained(folders["json"], padding_side="middle")
    with pytest.raises(TypeError, match="padding_sied"):
        AutoTokenizer.from_pretrained(folders["json"], padding_sied="left")
    tok = AutoTokenizer.from_pretrained(folders["json"], pad_token="<|endoftext|>")
    with pytest.raises(ValueError, match="padding_side"):
        tok.padding_side = "up"
    with pytest.raises(ValueError, match="return_tensors"):
        tok("a", return_tensors="pt")
    with pytest.raises(TypeError):
        tok([1, 2])
    with pytest.raises(AttributeError):
        tok("a").token_type_ids
    with pytest.raises(ValueError, match="multiple"):
        tok(TEXTS, padding=True, truncation=True, max_length=5, pad_to_multiple_of=8)


def test_single_string_and_empty_prompt(folders):
    tok = AutoTokenizer.from_pretrained(folders["json"], pad_token="<|endoftext|>")
    assert tok("").input_ids == [] and tok("").attention_mask == []
    assert tok("", return_tensors="np").input_ids.shape == (1, 0)
    enc = tok("Hello world", return_tensors="np")
    assert enc.input_ids.shape == (1, len(tok.encode("Hello world")))
    assert isinstance(enc, dict) and set(dict(**enc)) == {"input_ids", "attention_mask"}
    assert isinstance(xtok.GPT2TokenizerFast.from_pretrained(folders["json"]), xtok.PreTrainedTokenizerFast)


@pytest.mark.parametrize("kind", ["json", "files", "model_type", "opt", "t5", "t5_unigram", "prefix_files"])
def test_save_pretrained_round_trip(folders, kind, tmp_path):
    tok = AutoTokenizer.from_pretrained(folders[kind], padding_side="left", pad_token="[PAD]")
    written = tok.save_pretrained(tmp_path)
    assert sorted(pathlib.Path(p).name for p in written) == [
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    ours, theirs = _pair(tmp_path)
    for loaded in (ours, theirs):
        assert (loaded.pad_token, loaded.pad_token_id, loaded.padding_side) == ("[PAD]", tok.pad_token_id, "left")
        assert (loaded.eos_token_id, loaded.bos_token_id, len(loaded)) == (tok.eos_token_id, tok.bos_token_id, len(tok))
        enc = loaded(TEXTS, padding=True, truncation=True, max_length=16)
        assert enc["input_ids"] == tok(TEXTS, padding=True, truncation=True, max_length=16).input_ids
