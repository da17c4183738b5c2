"""Compatibility with folders saved by transformers 4.57 and 5.x: tiny checkpoints, tokenizers and Whisper
processors of every family, with the answers the saving version computed (tests/data/compat/, made by
tests/data/compat/make_fixtures.py; no transformers 4.57 needed here).

xlagen must reproduce each folder's logits, token ids and features, and its own `save_pretrained` of each
must load in the installed transformers (the PyTorch reference) with the same logits.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from xlagen import AutoTokenizer, T5Config, TFAutoModelForSpeechSeq2Seq
from xlagen.modeling import TFAutoModelForGeneration
from xlagen.weights import t5 as t5_weights
from xlagen.weights.checkpoint import read_checkpoint

ROOT = Path(__file__).parent / "data" / "compat"
FIXTURES = sorted(path.parent for path in ROOT.glob("*/*/reference.json"))
IDS = [f"{folder.parent.name}/{folder.name}" for folder in FIXTURES]

# T5 fixture -> (tie_word_embeddings, scale_decoder_outputs) of the model each folder describes.
T5_HEADS = {"4.57.6/t5_v1_0": (True, True), "4.57.6/t5_v1_1": (False, False),
            "5.24.0/t5_v1_0": (True, True), "5.24.0/t5_v1_1": (True, False),  # tied but not rescaled
            "5.24.0/t5_v1_1_own_head": (False, False)}  # config says tied; the stored head wins


def reference(folder: Path) -> dict:
    return json.loads((folder / "reference.json").read_text())


@functools.cache
def xlagen_model(folder: Path):
    model_class = TFAutoModelForSpeechSeq2Seq if reference(folder)["uses_features"] else TFAutoModelForGeneration
    return model_class.from_pretrained(folder)


def xlagen_logits(model, folder: Path) -> np.ndarray:
    """The logits of the fixture's inputs (and features) by an xlagen model."""
    inputs = {name: np.asarray(value, np.int32) for name, value in reference(folder)["inputs"].items()}
    first = np.load(folder / "features.npy") if reference(folder)["uses_features"] else inputs.pop("input_ids")
    return model(first, **inputs).logits.numpy()


def test_every_family_and_version_has_fixtures():
    assert set(IDS) >= {f"{version}/{family}" for version in ("4.57.6", "5.24.0")
                        for family in ("gpt2", "opt", "t5_v1_0", "t5_v1_1", "whisper")}
    assert "5.24.0/t5_v1_1_own_head" in IDS
    assert sum(path.stat().st_size for path in ROOT.rglob("*") if path.is_file()) < 2_000_000


@pytest.mark.parametrize("folder", FIXTURES, ids=IDS)
def test_logits_match_the_saving_version(folder):
    expected = np.load(folder / "logits.npy")
    np.testing.assert_allclose(xlagen_logits(xlagen_model(folder), folder), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("folder", FIXTURES, ids=IDS)
def test_tokenizer_matches_the_saving_version(folder):
    expected = reference(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(expected["text"])["input_ids"]
    assert list(np.asarray(ids).ravel()) == expected["token_ids"]
    assert tokenizer.decode(expected["token_ids"]) == expected["decoded"]
    assert tokenizer.decode(expected["token_ids"], skip_special_tokens=True) == expected["decoded_skip_special"]


@pytest.mark.parametrize("folder", [f for f in FIXTURES if f.name == "whisper"],
                         ids=[i for i in IDS if i.endswith("whisper")])
def test_whisper_processor_folder_matches_the_saving_version(folder):
    from xlagen import AutoProcessor

    # transformers >= 5 writes the feature extractor's settings into processor_config.json, 4.x into
    # preprocessor_config.json.
    processor = AutoProcessor.from_pretrained(folder)
    features = processor(np.load(folder / "audio.npy"), sampling_rate=16000)["input_features"]
    np.testing.assert_allclose(features, np.load(folder / "features.npy"), atol=1e-4, rtol=0)
    assert list(processor.tokenizer(reference(folder)["text"])["input_ids"]) == reference(folder)["token_ids"]


@pytest.mark.parametrize("name", sorted(T5_HEADS))
def test_t5_head_and_scaling_follow_the_saving_version(name):
    folder = ROOT / name
    config = T5Config.from_hf_config(json.loads((folder / "config.json").read_text()))
    config = t5_weights.resolve_config(config, read_checkpoint(folder))
    assert (config.tie_word_embeddings, config.scale_decoder_outputs) == T5_HEADS[name]


@pytest.mark.parametrize("folder", FIXTURES, ids=IDS)
def test_save_pretrained_loads_in_transformers_with_the_same_logits(folder, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("make_fixtures", ROOT / "make_fixtures.py")
    make_fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_fixtures)
    model = xlagen_model(folder)
    model.save_pretrained(tmp_path)
    assert make_fixtures.check(tmp_path, folder) <= 1e-4
    again = type(model).from_pretrained(tmp_path)  # and xlagen reads its own folder back the same
    np.testing.assert_allclose(xlagen_logits(again, folder), np.load(folder / "logits.npy"), atol=1e-4, rtol=0)
