"""RequestOptions: every option validated at construction, errors naming the option and its value."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from xlagen.serving.options import RequestOptions


def test_defaults():
    options = RequestOptions()
    assert (options.max_new_tokens, options.do_sample, options.temperature, options.top_p, options.top_k) == (
        16, False, 1.0, 1.0, 0)
    assert (options.seed, options.repetition_penalty, options.stop_token_ids, options.stop) == (None, 1.0, (), ())
    assert (options.logprobs, options.num_beams, options.deadline) == (False, 1, None)


def test_from_kwargs_converts_lists_and_numpy_scalars():
    options = RequestOptions.from_kwargs(max_new_tokens=np.int64(5), temperature=np.float32(0.5), top_k=3,
                                         stop_token_ids=[7, np.int32(9)], stop=["\n\n", "END"], seed=12,
                                         do_sample=True, deadline=2)
    assert options.max_new_tokens == 5 and type(options.max_new_tokens) is int
    assert options.temperature == 0.5 and type(options.temperature) is float
    assert options.stop_token_ids == (7, 9) and options.stop == ("\n\n", "END")
    assert options.deadline == 2.0
    hash(options)  # frozen and hashable


@pytest.mark.parametrize("name, value, error, words", [
    ("max_new_tokens", 0, ValueError, "max_new_tokens must be >= 1, got 0"),
    ("max_new_tokens", 2.5, TypeError, "max_new_tokens must be an int, got float 2.5"),
    ("max_new_tokens", True, TypeError, "max_new_tokens must be an int, got bool True"),
    ("max_new_tokens", "8", TypeError, "max_new_tokens must be an int, got str '8'"),
    ("temperature", -0.5, ValueError, "temperature must be >= 0, got -0.5"),
    ("temperature", float("nan"), ValueError, "temperature must be a finite number, got nan"),
    ("temperature", "hot", TypeError, "temperature must be a number, got str 'hot'"),
    ("top_p", 0.0, ValueError, "top_p must be in (0, 1], got 0.0"),
    ("top_p", 1.5, ValueError, "top_p must be in (0, 1], got 1.5"),
    ("top_k", -1, ValueError, "top_k must be >= 0 (0 = off), got -1"),
    ("seed", -3, ValueError, "seed must be in [0, 2**63 - 1], got -3"),
    ("seed", 2**64, ValueError, "seed must be in [0, 2**63 - 1]"),
    ("seed", 1.0, TypeError, "seed must be an int, got float 1.0"),
    ("repetition_penalty", 0.0, ValueError, "repetition_penalty must be > 0, got 0.0"),
    ("stop_token_ids", 5, TypeError, "stop_token_ids must be a list or tuple, got int 5"),
    ("stop_token_ids", [1, -2], ValueError, "stop_token_ids must hold ids >= 0, got -2"),
    ("stop_token_ids", [1, "2"], TypeError, "stop_token_ids must be an int, got str '2'"),
    ("stop", "END", TypeError, "stop must be a list or tuple, got str 'END'"),
    ("stop", ["a", 3], TypeError, "stop must hold strings, got int 3"),
    ("stop", [""], ValueError, "stop must not hold an empty string"),
    ("do_sample", 1, TypeError, "do_sample must be True or False, got int 1"),
    ("logprobs", "yes", TypeError, "logprobs must be True or False, got str 'yes'"),
    ("num_beams", 0, ValueError, "num_beams must be >= 1, got 0"),
    ("deadline", 0, ValueError, "deadline must be > 0 seconds, got 0.0"),
    ("deadline", float("inf"), ValueError, "deadline must be a finite number, got inf"),
])
def test_bad_values_name_the_option(name, value, error, words):
    with pytest.raises(error) as raised:
        RequestOptions.from_kwargs(**{name: value})
    assert words in str(raised.value)


def test_sampling_needs_a_positive_temperature_greedy_does_not():
    assert RequestOptions(temperature=0.0).temperature == 0.0
    with pytest.raises(ValueError, match=r"temperature must be > 0 when sampling, got 0.0"):
        RequestOptions(do_sample=True, temperature=0.0)


def test_unknown_options_are_named():
    with pytest.raises(TypeError, match=r"unknown request option\(s\) 'best_of', 'max_tokens'; known: .*deadline"):
        RequestOptions.from_kwargs(max_tokens=3, best_of=2)


def test_update_validates_again():
    options = RequestOptions(max_new_tokens=4)
    assert options.update(top_k=5) == RequestOptions(max_new_tokens=4, top_k=5)
    with pytest.raises(ValueError, match="top_k"):
        options.update(top_k=-1)
    with pytest.raises(TypeError, match="unknown request option"):
        options.update(n=2)


def test_importing_the_options_does_not_load_tensorflow():
    code = "import sys; from xlagen.serving import RequestOptions; assert 'tensorflow' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
