"""What XLA makes of `generate`: the HLO of the whole generation program, before and after optimisation."""

from __future__ import annotations

from pathlib import Path

import tensorflow as tf

STAGES = ("hlo", "optimized_hlo", "optimized_hlo_dot")


def generate_ir(model, batch_size: int = 1, prompt_length: int = 8, stage: str = "hlo", **options) -> str:
    """The compiler IR of `tf.function(model.generate, jit_compile=True)` for one input shape.

    Args:
        model: A model with `generate`.
        batch_size: B of the dummy prompt.
        prompt_length: P of the dummy prompt.
        stage: "hlo" (as lowered from TensorFlow), "optimized_hlo" (after XLA's passes, what runs) or
            "optimized_hlo_dot" (a Graphviz graph).
        **options: `generate` options (max_new_tokens, num_beams, ...).

    Returns:
        The IR text.

    Raises:
        ValueError: for an unknown stage or invalid options.
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    ids = tf.ones([batch_size, prompt_length], tf.int32)
    program = tf.function(lambda ids, mask: model.generate(ids, attention_mask=mask, **options), jit_compile=True)
    return program.experimental_get_compiler_ir(ids, tf.ones_like(ids))(stage=stage)


def write_generate_ir(model, directory: str | Path, stages=("hlo", "optimized_hlo"), **kwargs) -> list[Path]:
    """Writes `generate.<stage>.txt` for each stage into `directory`; returns the paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for stage in stages:
        path = directory / f"generate.{stage}.txt"
        path.write_text(generate_ir(model, stage=stage, **kwargs))
        paths.append(path)
    return paths
