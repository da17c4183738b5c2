"""Bad input: clear ValueErrors before anything is traced."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import random_ids
from xlagen import GenerationConfig

IDS = random_ids((1, 4), 64, seed=50)


@pytest.mark.parametrize("options, message", [
    (dict(num_beams=0), "num_beams must be >= 1"),
    (dict(do_sample=True, top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(do_sample=True, top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(do_sample=True, temperature=0.0), "temperature must be > 0"),
    (dict(num_beams=2, num_return_sequences=3), "num_return_sequences"),
    (dict(num_return_sequences=2), "greedy decoding returns one sequence"),
    (dict(max_new_tokens=61), "exceeds the model's 64 positions"),
    (dict(max_length=4), "raise max_length or set max_new_tokens"),
    (dict(early_stopping="sometimes"), "early_stopping"),
    (dict(bogus_option=1), "bogus_option"),
])
def test_bad_options(gpt2_model, options, message):
    with pytest.raises(ValueError, match=message):
        gpt2_model.generate(IDS, **options)


def test_empty_prompt(gpt2_model):
    with pytest.raises(ValueError, match="prompt is empty"):
        gpt2_model.generate(np.zeros((1, 0), np.int32))


def test_mask_shape_mismatch(gpt2_model):
    with pytest.raises(ValueError, match="attention_mask shape"):
        gpt2_model.generate(IDS, attention_mask=np.ones((1, 3), np.int32))


def test_generation_config_object_and_defaults(gpt2_model):
    config = GenerationConfig(max_new_tokens=3, eos_token_id=None, pad_token_id=1)
    assert gpt2_model.generate(IDS, generation_config=config).shape == (1, 7)
    assert gpt2_model.generate(IDS, generation_config=config, max_new_tokens=5).shape == (1, 9)
