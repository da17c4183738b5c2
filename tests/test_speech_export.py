"""Whisper SavedModel: features or raw audio in, the transcript's tokens and text out, TensorFlow alone."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from models.test_whisper import save_tiny_whisper
from whisper_fixtures import build_whisper_tokenizer, save_feature_extractor, synthetic_audio
from xlagen import TFWhisperForConditionalGeneration, WhisperProcessor
from xlagen.cli.__main__ import main
from xlagen.deploy.export import ExportConfig
from xlagen.deploy.speech_export import export_whisper, log_mel

NEW = 6

# A fresh interpreter that imports TensorFlow only: runs each signature on the given inputs.
SERVE = r"""
import json, sys
import numpy as np
import tensorflow as tf

saved = tf.saved_model.load(sys.argv[1])
inputs = np.load(sys.argv[2])
results = {}
for name in ("greedy", "greedy_audio", "beam", "beam_audio"):
    for rows in (1, 3):
        key = "audio" if name.endswith("_audio") else "input_features"
        out = getattr(saved, name)(**{key: tf.constant(inputs[key][:rows])})
        results[f"{name}/{rows}"] = {"sequences": out["sequences"].numpy().tolist(),
                                     "text": [t.decode("utf-8") for t in out["text"].numpy()]}
results["xlagen_modules"] = sorted(name for name in sys.modules if name.startswith("xlagen"))
print(json.dumps(results))
"""


def _audio(rows: int) -> np.ndarray:
    """Synthetic clips of different lengths and loudness, zero-padded to 12 s."""
    clips = np.zeros((rows, 12 * 16000), np.float32)
    for i in range(rows):
        clip = synthetic_audio(4.0 + 3 * i, seed=i) * (0.2 + 0.4 * i)
        clips[i, :len(clip)] = clip
    return clips


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("whisper_export")
    save_tiny_whisper(folder, seed=2)
    build_whisper_tokenizer(folder)
    save_feature_extractor(folder, 80)
    return folder


@pytest.fixture(scope="module")
def served(checkpoint):
    folder = checkpoint
    model = TFWhisperForConditionalGeneration.from_pretrained(folder)
    processor = WhisperProcessor.from_pretrained(folder)
    export_dir = folder / "saved"
    export_whisper(model, export_dir, processor, language="en",
                   export=ExportConfig(strategies=("greedy", "beam"), max_new_tokens=NEW, batch_sizes=(1, 4),
                                       num_beams=2))
    audio = _audio(3)
    features = processor.feature_extractor(list(audio), sampling_rate=16000, return_tensors="np")["input_features"]
    inputs = folder / "inputs.npz"
    np.savez(inputs, audio=audio, input_features=features)
    script = folder / "serve.py"
    script.write_text(SERVE)
    result = subprocess.run([sys.executable, str(script), str(export_dir), str(inputs)], capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return model, processor, features, audio, json.loads(result.stdout.strip().splitlines()[-1])


def test_log_mel_in_tensorflow_matches_the_feature_extractor(served):
    _, processor, features, audio, _ = served
    ours = log_mel(tf.constant(audio), processor.feature_extractor).numpy()
    assert np.abs(ours - features).max() <= 1e-4


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_served_tokens_and_text_equal_generate(served, strategy):
    model, processor, features, _, results = served
    assert results["xlagen_modules"] == []
    options = dict(language="en", max_new_tokens=NEW, num_beams=2 if strategy == "beam" else 1)
    for rows in (1, 3):
        expected = model.generate(features[:rows], **options).numpy()
        texts = processor.batch_decode(expected, skip_special_tokens=True)
        for name in (strategy, f"{strategy}_audio"):
            got = results[f"{name}/{rows}"]
            np.testing.assert_array_equal(got["sequences"], expected, err_msg=name)
            assert got["text"] == texts, name
    assert len({tuple(row) for row in expected.tolist()}) > 1


def test_cli_exports_a_whisper_checkpoint(checkpoint, tmp_path, capsys):
    out = tmp_path / "saved"
    assert main(["export", str(checkpoint), str(out), "--strategies", "greedy", "--max-new-tokens", "4",
                 "--batch-sizes", "1", "--task", "translate", "--timestamps"]) == 0
    printed = capsys.readouterr().out
    assert "greedy:" in printed and "greedy_audio:" in printed and "input  audio: float32 [-1, -1]" in printed
    audio = _audio(1)
    loaded = tf.saved_model.load(str(out))
    served = loaded.greedy_audio(audio=tf.constant(audio))
    model = TFWhisperForConditionalGeneration.from_pretrained(checkpoint)
    features = WhisperProcessor.from_pretrained(checkpoint)(audio[0], sampling_rate=16000).input_features
    expected = model.generate(features, task="translate", return_timestamps=True, max_new_tokens=4).numpy()
    np.testing.assert_array_equal(served["sequences"].numpy(), expected)
    assert main(["export", str(checkpoint), str(tmp_path / "other"), "--strategies", "sample"]) == 2


def test_sampling_is_declined(tmp_path):
    with pytest.raises(ValueError, match="greedy' and 'beam"):
        export_whisper(None, tmp_path, None, export=ExportConfig(strategies=("sample",)))
