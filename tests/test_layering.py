"""The import rules of STYLE.md: numpy-only modules stay numpy-only; imports point down the layers."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "xlagen"
NUMPY_ONLY = ["xlagen.text.tokenizer", "xlagen.text.auto_tokenizer", "xlagen.text.tokenizer_files",
              "xlagen.text.whisper_tokens", "xlagen.text.chat_template", "xlagen.hub",
              "xlagen.weights.checkpoint", "xlagen.weights.atomic_save", "xlagen.weights.loader",
              "xlagen.weights.gpt2", "xlagen.weights.llama", "xlagen.weights.opt", "xlagen.weights.t5",
              "xlagen.weights.whisper",
              "xlagen.speech.audio", "xlagen.speech.audio.decoding", "xlagen.speech.audio.features",
              "xlagen.speech.processing", "xlagen.buffers"]
# Packages (relative to src/xlagen) allowed to import tensorflow / keras.
TF_ALLOWED = ("layers", "models", "generation", "cli", "deploy", "cache.py", "modeling.py",
              "text/graph_tokenizer.py", "speech/transcribe.py", "speech/whisper_decoding.py")
# module prefix -> xlagen modules it must not import (they sit above it).
UPWARD = {
    "layers": ("xlagen.models", "xlagen.generation", "xlagen.modeling", "xlagen.cli"),
    "models": ("xlagen.generation", "xlagen.modeling", "xlagen.cli"),
    # Generation names no model family: models plug in through GenerationMixin's hooks.
    # (the contract's types in models/base.py are the one part of models/ it uses).
    "generation": ("xlagen.modeling", "xlagen.cli", "xlagen.models.gpt2", "xlagen.models.opt", "xlagen.models.t5",
                   "xlagen.models.whisper", "xlagen.models.registry", "xlagen.speech", "xlagen.deploy",
                   "xlagen.text.whisper_tokens", "xlagen.serving", "xlagen.beam"),
    # Tokenizers sit below everything that uses them; speech (audio, Whisper's processing, decoding rules and
    # transcription) sits below deployment and the front ends.
    "text": ("xlagen.speech", "xlagen.deploy", "xlagen.models", "xlagen.layers", "xlagen.generation",
             "xlagen.modeling", "xlagen.serving", "xlagen.beam", "xlagen.cli"),
    "speech": ("xlagen.deploy", "xlagen.serving", "xlagen.beam", "xlagen.cli"),
    "deploy": ("xlagen.serving", "xlagen.beam", "xlagen.cli"),
    "weights": ("xlagen.models", "xlagen.layers", "xlagen.generation", "xlagen.modeling", "xlagen.cli"),
    # The native kernels sit below the layers that call them.
    "native": ("xlagen.models", "xlagen.layers", "xlagen.generation", "xlagen.modeling", "xlagen.cli",
               "xlagen.weights"),
}


def _imports(path: pathlib.Path, module_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in (tree.body if module_level_only else ast.walk(tree)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("module", NUMPY_ONLY)
def test_numpy_only_modules_do_not_load_tensorflow(module):
    code = f"import sys, {module}; assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bench_measurement_loads_with_the_standard_library_only():
    # benchmarks/peer/compare.py loads these in the reference's environment, which has no xlagen dependencies.
    code = ("import sys, xlagen.cli.bench_timing, xlagen.cli.bench_report, xlagen.cli.bench; "
            "assert not {'tensorflow', 'keras', 'numpy'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_tokenizer_import_does_not_load_tensorflow():
    code = "import sys; from xlagen import AutoTokenizer; assert 'tensorflow' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tensorflow_only_where_allowed():
    offenders = []
    for path in SRC.rglob("*.py"):
        relative = path.relative_to(SRC).as_posix()
        if relative.startswith(TF_ALLOWED):
            continue
        # A function-level import (the tokenizer's return_tensors="tf") loads TensorFlow only on demand.
        if any(name.split(".")[0] in ("tensorflow", "keras") for name in _imports(path, module_level_only=True)):
            offenders.append(relative)
    assert not offenders


def test_imports_point_down():
    offenders = []
    for path in SRC.rglob("*.py"):
        relative = path.relative_to(SRC).as_posix()
        forbidden = UPWARD.get(relative.split("/")[0], ())
        bad = [name for name in _imports(path) if name.startswith(forbidden)]
        if bad:
            offenders.append((relative, bad))
    assert not offenders
