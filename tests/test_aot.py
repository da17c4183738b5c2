"""`xlagen aot`: tfcompile's C++ program, built with g++, generates xlagen's tokens (tiny GPT-2)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess

import numpy as np
import pytest

from conftest import random_ids
from xlagen.cli.__main__ import main

BATCH, PROMPT, NEW = 2, 6, 5
# CI (.ci/run sets XLAGEN_CI=1 and installs g++/make) never skips these; elsewhere they need the toolchain.
_NO_TOOLCHAIN = not os.environ.get("XLAGEN_CI") and (
    shutil.which("g++") is None or shutil.which("make") is None or platform.machine() != "x86_64"
    or platform.system() != "Linux")
needs_toolchain = pytest.mark.skipif(_NO_TOOLCHAIN, reason="needs g++ and make on x86-64 Linux")


@pytest.fixture(scope="module")
def aot_dir(gpt2_checkpoint, tmp_path_factory):
    """The tiny GPT-2 compiled and built by `xlagen aot --build` (about a minute, mostly g++)."""
    if _NO_TOOLCHAIN:
        pytest.skip("needs g++ and make on x86-64 Linux")
    out_dir = tmp_path_factory.mktemp("aot")
    code = main(["aot", gpt2_checkpoint[0], str(out_dir), "--batch-size", str(BATCH), "--prompt-length",
                 str(PROMPT), "--max-new-tokens", str(NEW), "--build"])
    assert code == 0
    return out_dir


def run_binary(out_dir, ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    command = [str(out_dir / "generate"), *map(str, ids.ravel())]
    if mask is not None:
        command += ["--attention-mask", ",".join(map(str, mask.ravel()))]
    result = subprocess.run(command, capture_output=True, text=True, check=True, timeout=60)
    return np.array([[int(t) for t in line.split()] for line in result.stdout.splitlines()])


@needs_toolchain
def test_binary_generates_xlagen_tokens(aot_dir, gpt2_model):
    ids = random_ids((BATCH, PROMPT), gpt2_model.config.vocab_size, seed=3)
    mask = np.ones_like(ids)
    ids[1, :2], mask[1, :2] = 1, 0  # row 1: a 4-token prompt, left-padded
    expected = gpt2_model.generate(ids, attention_mask=mask, max_new_tokens=NEW).numpy()
    assert expected.shape == (BATCH, PROMPT + NEW)
    np.testing.assert_array_equal(run_binary(aot_dir, ids, mask), expected)
    np.testing.assert_array_equal(run_binary(aot_dir, ids[::-1], mask[::-1]), expected[::-1])


@needs_toolchain
def test_binary_needs_no_tensorflow_library(aot_dir):
    linked = subprocess.run(["ldd", str(aot_dir / "generate")], capture_output=True, text=True).stdout
    assert "libstdc++" in linked and "tensorflow" not in linked


@needs_toolchain
def test_output_folder(aot_dir):
    names = {p.name for p in aot_dir.iterdir()}
    assert {"generate.h", "generate.o", "generate_constants.o", "generate_metadata.o", "main.cpp",
            "xlagen_aot_config.h", "Makefile", "README.md", "absl_shim"} <= names
    assert "class GreedyGenerate" in (aot_dir / "generate.h").read_text()
    assert "dot_lib_f32.cc" in (aot_dir / "Makefile").read_text()


@needs_toolchain
def test_binary_rejects_wrong_number_of_ids(aot_dir):
    result = subprocess.run([str(aot_dir / "generate"), "1", "2"], capture_output=True, text=True)
    assert result.returncode == 2
    assert f"expected {BATCH * PROMPT} prompt ids" in result.stderr


@pytest.mark.parametrize("options, message", [
    ({"do_sample": True}, "do_sample=True"),
    ({"num_beams": 2}, "beam search"),
    ({"output_scores": True}, "sequences only"),
])
def test_rejects_options_a_fixed_greedy_program_cannot_have(gpt2_model, tmp_path, options, message):
    from xlagen.deploy.aot import aot_compile

    with pytest.raises(ValueError, match=message):
        aot_compile(gpt2_model, tmp_path, prompt_length=4, max_new_tokens=2, **options)
    assert not any(tmp_path.iterdir())  # checked before anything is traced or written


def test_cli_rejects_sampling(capsys, tmp_path):
    assert main(["aot", "unused", str(tmp_path), "--do-sample"]) == 2
    assert "greedy decoding only" in capsys.readouterr().err


def test_saved_model_cli_errors_are_surfaced(tmp_path):
    from xlagen.deploy.aot import run_tfcompile

    with pytest.raises(ChildProcessError, match="saved_model_cli aot_compile_cpu failed") as error:
        run_tfcompile(tmp_path / "missing", tmp_path)
    assert "SavedModel file does not exist" in str(error.value)


def test_missing_compiler_is_reported(tmp_path):
    from xlagen.deploy.aot import build_example

    with pytest.raises(FileNotFoundError, match="g\\+\\+-xlagen-missing"):
        build_example(tmp_path, compiler="g++-xlagen-missing")
