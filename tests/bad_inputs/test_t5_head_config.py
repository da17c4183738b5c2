"""Bad T5 head settings in config.json: each is refused with a ValueError naming the key or tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from xlagen import TFAutoModelForSeq2SeqLM

FIXTURES = Path(__file__).parent.parent / "data" / "compat"


def _folder(tmp_path, fixture: str, changes: dict, drop_head: bool = False) -> Path:
    """A copy of a compat fixture with config.json changed (and `lm_head.weight` dropped if asked)."""
    folder = tmp_path / "model"
    shutil.copytree(FIXTURES / fixture, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    if drop_head:
        from safetensors.numpy import load_file, save_file

        tensors = load_file(folder / "model.safetensors")
        del tensors["lm_head.weight"]
        save_file(tensors, folder / "model.safetensors")
    return folder


@pytest.mark.parametrize("fixture, changes, drop_head, match", [
    ("5.24.0/t5_v1_1", {"scale_decoder_outputs": "no"}, False, "scale_decoder_outputs='no' must be true or false"),
    ("5.24.0/t5_v1_1", {"scale_decoder_outputs": None}, False, "scale_decoder_outputs=None must be true or false"),
    ("5.24.0/t5_v1_0", {"scale_decoder_outputs": 1}, False, "scale_decoder_outputs=1 must be true or false"),
    ("4.57.6/t5_v1_0", {"tie_word_embeddings": "true"}, False, "tie_word_embeddings='true' must be true or false"),
    # transformers 4.57 would leave the head random, transformers 5 would tie it: xlagen asks for the tensor.
    ("4.57.6/t5_v1_1", {}, True, r"missing from the checkpoint \(1\):\n    lm_head.weight"),
], ids=["scale-string", "scale-null", "scale-int", "tie-string", "untied-without-head"])
def test_bad_t5_head_config_is_refused(tmp_path, fixture, changes, drop_head, match):
    folder = _folder(tmp_path, fixture, changes, drop_head)
    with pytest.raises(ValueError, match=match):
        TFAutoModelForSeq2SeqLM.from_pretrained(folder)
