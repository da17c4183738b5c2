"""The built-in default model: shipped in the package, loads offline, generates text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from xlagen.cli.generate import default_model_path

FOLDER = Path(default_model_path() or "")
REPORT = Path(__file__).resolve().parents[1] / "docs" / "default-model"


def test_default_model_is_package_data_and_small():
    assert default_model_path() is not None, "src/xlagen/default_model is missing"
    files = {p.name for p in FOLDER.iterdir()}
    # What loading needs, and the model card; the training log and plot stay in the repository (REPORT).
    assert files == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json", "special_tokens_map.json", "README.md"}
    assert sum(p.stat().st_size for p in FOLDER.iterdir()) <= 30 * 2**20
    card = (FOLDER / "README.md").read_text()
    for needed in ("King James", "public domain", "perplexity", "train_default_model.py"):
        assert needed in card


def test_cli_uses_default_model_offline():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}
    result = subprocess.run([sys.executable, "-m", "xlagen.cli", "generate", "In the beginning",
                             "--max-new-tokens", "12", "--seed", "1"], capture_output=True, text=True, env=env,
                            check=True)
    text = result.stdout.strip()
    assert text.startswith("In the beginning")
    assert len(text.split()) > 5


def test_default_model_greedy_continuation_is_language_not_noise():
    from xlagen import AutoTokenizer, TFAutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(FOLDER)
    model = TFAutoModelForCausalLM.from_pretrained(FOLDER)
    encoded = tokenizer(["And God said"], return_tensors="tf")
    tokens = model.generate(**encoded, max_new_tokens=20, do_sample=False, repetition_penalty=1.0)
    words = tokenizer.decode(tokens[0], skip_special_tokens=True).split()
    vocabulary = set(" ".join(json.loads((REPORT / "training_log.json").read_text())["samples"]).split())
    common = {"the", "and", "of", "unto", "that", "he", "to", "in", "shall", "LORD", "God", "said", "I", "his"}
    assert len(words) >= 10
    assert sum(word.strip(",.;:") in common for word in words) >= 3, words
    assert vocabulary  # the training log records samples
