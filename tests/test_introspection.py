"""HLO introspection, and TensorFlow's own XLA switches working with xlagen models."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from xlagen.cli.__main__ import main
from xlagen.generation.introspect import generate_ir


def test_generate_is_one_program_with_one_while_loop(gpt2_model):
    hlo = generate_ir(gpt2_model, max_new_tokens=6, pad_token_id=1)
    assert hlo.startswith("HloModule")
    assert hlo.count(" while(") == 1  # the whole decode is one loop inside one module
    optimized = generate_ir(gpt2_model, max_new_tokens=6, pad_token_id=1, stage="optimized_hlo")
    assert "dynamic-update-slice" in optimized  # the static cache is written in place, never concatenated


def test_hlo_command_writes_both_stages(gpt2_checkpoint, tmp_path, capsys):
    assert main(["hlo", "--model", gpt2_checkpoint[0], "--output", str(tmp_path), "--max-new-tokens", "4",
                 "--num-beams", "2"]) == 0
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["generate.hlo.txt", "generate.optimized_hlo.txt"]
    assert "HloModule" in (tmp_path / "generate.optimized_hlo.txt").read_text()


def _run(script: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          env={**os.environ, **env}, check=True)


def test_auto_jit_and_dump_flags(gpt2_checkpoint, tmp_path):
    # A plain tf.function (no jit_compile) is clustered and compiled by TensorFlow's auto-jit, and
    # XLA_FLAGS=--xla_dump_to still dumps what XLA compiles.
    dump = tmp_path / "dump"
    _run(f"""
        import numpy as np, tensorflow as tf
        from xlagen import TFAutoModelForCausalLM
        model = TFAutoModelForCausalLM.from_pretrained({gpt2_checkpoint[0]!r})
        forward = tf.function(lambda ids: model(ids).logits)
        out = forward(tf.constant(np.full((1, 5), 3, np.int32)))
        assert out.shape == (1, 5, model.config.vocab_size)
    """, TF_XLA_FLAGS="--tf_xla_auto_jit=2 --tf_xla_cpu_global_jit", XLA_FLAGS=f"--xla_dump_to={dump}")
    assert any(name.endswith(".txt") for name in os.listdir(dump)), "auto-jit compiled nothing"


def test_persistent_compilation_cache_is_written(gpt2_checkpoint, tmp_path):
    cache = tmp_path / "cache"
    script = f"""
        import numpy as np, tensorflow as tf
        from xlagen import TFAutoModelForCausalLM
        model = TFAutoModelForCausalLM.from_pretrained({gpt2_checkpoint[0]!r})
        tf.function(model.generate, jit_compile=True)(tf.ones([1, 4], tf.int32), max_new_tokens=3, pad_token_id=1)
    """
    _run(script, TF_XLA_FLAGS=f"--tf_xla_persistent_cache_directory={cache}")
    assert any(name.startswith("xla_compile_cache") for name in os.listdir(cache))
