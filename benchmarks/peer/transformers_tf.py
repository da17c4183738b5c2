"""The reference of the comparison: transformers 4.57's TensorFlow models (Keras 2, `TF_USE_LEGACY_KERAS=1`),
under the model names of `xlagen bench`, with random weights.

transformers 4.57 is the last release with TensorFlow models; `setup_transformers_tf.sh` makes its
environment. `compare.py` runs this system's workers with that environment's python.
"""

from __future__ import annotations

import os
from typing import ClassVar

from xlagen.cli import bench_timing  # the standard library only: importable without xlagen's dependencies

NAME = "transformers-tf"
TITLE = "TF 4.57"  # the column heading of its figures in the reports
DESCRIPTION = "transformers 4.57 TensorFlow"
SETUP = "setup_transformers_tf.sh"
COMPILES = True  # tf.function(jit_compile=True), as xlagen
VENV = ".peer-venv"
WORKER_ENV = {"TF_USE_LEGACY_KERAS": "1"}  # transformers' TF models need Keras 2 (tf-keras)

MODELS = {
    "gpt2": ("TFGPT2LMHeadModel", "GPT2Config", {}),
    "opt": ("TFOPTForCausalLM", "OPTConfig", {}),
    "t5": ("TFT5ForConditionalGeneration", "T5Config", {"decoder_start_token_id": 0}),  # as t5-small's config
    "whisper": ("TFWhisperForConditionalGeneration", "WhisperConfig", {}),
    "tiny-gpt2": ("TFGPT2LMHeadModel", "GPT2Config",
                  {"vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}),
}


def _random_model(model_class: str, config_class: str, dtype: str, **config):
    """A transformers TF model with random weights; EOS cleared so generation never stops early.

    Args:
        model_class, config_class: transformers class names (imported here, in the reference environment).
        dtype: Only "float32": the reference is measured in float32.
        **config: Config values; the config class's defaults are the smallest public checkpoint's shapes
            (gpt2, opt-125m, t5-small, whisper-tiny).
    """
    os.environ.update({k: os.environ.get(k, v) for k, v in WORKER_ENV.items()})
    import transformers

    if dtype != "float32":
        raise ValueError(f"transformers 4.57 TensorFlow is measured in float32 only, not {dtype}")
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**config))
    model.build_in_name_scope()
    # TF generate falls back to generation_config.eos_token_id when eos_token_id=None is passed.
    model.generation_config.eos_token_id = None
    return model


class TransformersTF(bench_timing.TFSystem):
    """transformers 4.57 TensorFlow, under xlagen's benchmark model names."""

    name = NAME
    models: ClassVar[dict] = {
        name: (lambda dtype, spec=spec: _random_model(spec[0], spec[1], dtype, **spec[2])) for name, spec in MODELS.items()}
    distributions: ClassVar[tuple[str, ...]] = ("tensorflow-cpu", "tensorflow", "tf-keras", "transformers", "numpy")


def paired_dtypes(dtype: str, compute_types: list[str] | None) -> list[str]:
    """The dtype this reference runs beside xlagen's `dtype`: float32 beside packed weights (it has none)."""
    del compute_types  # TensorFlow's dtypes are the same on every CPU
    return ["float32"] if dtype in bench_timing.PACKED_DTYPES else [dtype]


SYSTEM = TransformersTF
