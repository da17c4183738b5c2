"""Whisper processor folders and transcription options that must be refused with a message naming the culprit."""

from __future__ import annotations

import json

import pytest

from models.test_whisper import save_tiny_whisper
from xlagen import AutoFeatureExtractor, TFWhisperForConditionalGeneration, WhisperFeatureExtractor
from xlagen.speech.transcribe import Transcriber


def _folder(tmp_path, files: dict):
    for name, value in files.items():
        (tmp_path / name).write_text(value if isinstance(value, str) else json.dumps(value))
    return tmp_path


@pytest.mark.parametrize("files, error, message", [
    ({}, FileNotFoundError, "neither preprocessor_config.json .*nor processor_config.json"),
    ({"processor_config.json": {"processor_class": "WhisperProcessor"}}, ValueError,
     "processor_config.json' has no \"feature_extractor\" object"),
    ({"processor_config.json": {"feature_extractor": [80]}}, ValueError, "no \"feature_extractor\" object"),
    ({"processor_config.json": "{not json"}, ValueError, "processor_config.json' is not valid JSON"),
    ({"processor_config.json": {"feature_extractor": {"feature_extractor_type": "ViTImageProcessor"}}}, ValueError,
     "for a ViTImageProcessor"),
])
def test_bad_processor_folders(tmp_path, files, error, message):
    with pytest.raises(error, match=message):
        WhisperFeatureExtractor.from_pretrained(_folder(tmp_path, files))


def test_transformers_5_processor_config_loads(tmp_path):
    folder = _folder(tmp_path, {"processor_config.json": {"processor_class": "WhisperProcessor", "feature_extractor": {
        "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128, "chunk_length": 30}}})
    extractor = AutoFeatureExtractor.from_pretrained(folder)
    assert extractor.feature_size == 128 and extractor.extra == {"processor_class": "WhisperProcessor"}


@pytest.fixture(scope="module")
def english_only_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("whisper_en_bad")
    save_tiny_whisper(folder, seed=5, multilingual=False)
    return TFWhisperForConditionalGeneration.from_pretrained(folder)


@pytest.mark.parametrize("options", [dict(language="en"), dict(task="translate"), dict(task="transcribe")])
def test_english_only_model_refuses_language_and_task(english_only_model, tmp_path, options):
    transcriber = Transcriber(english_only_model, processor=None)
    with pytest.raises(ValueError, match="English-only Whisper model: it takes no language or task"):
        transcriber(str(tmp_path / "not_read.wav"), **options)  # refused before the file is looked at
