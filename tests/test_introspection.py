"""HLO introspection, and TensorFlow's own XLA switches working with xlagen models."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from xlagen.cli.__main__ import main
from xlagen.generation.introspect import generate_ir


def test_generate_is_one_program_with_one_while_loop(gpt2_model):
    hlo = generate_ir(gpt2_model, max_new_tokens=6, pad_token_id=1)
    assert hlo.startswith("HloModule")
    assert hlo.count(" while(") == 1  # the whole decode is one loop inside one module
    optimized = generate_ir(gpt2_model, max_new_tokens=6, pad_token_id=1, stage="optimized_hlo")
    assert "dynamic-update-slice" in optimized  # the static cache is written in place, never concatenated


def _loop_body(hlo: str) -> str:
    """The text of the computation that is the (single) while loop's body in an HLO module."""
    body = re.search(r" while\(.*?body=(%[\w.\-]+)", hlo).group(1)
    start = hlo.index(f"\n{body} ") + 1
    return hlo[start:hlo.index("\n}", start)]


@pytest.mark.parametrize(("batch_size", "num_beams"), [(1, 1), (3, 1), (1, 2), (2, 3)])
def test_decoding_step_updates_the_cache_in_place(gpt2_model, batch_size, num_beams):
    # A decoding step must neither copy nor transpose the key/value cache (XLA used to copy each layer's
    # cache buffers every step, and beam search gathered every layer's cache rows: costs that grow with
    # the cache length); the only cache-sized work left is the in-place write. Beam search keeps its
    # cache in the beam layout [B, H, K, S, D] and reorders only the slots table.
    config = gpt2_model.config
    beams = f"{num_beams}," if num_beams > 1 else ""
    shape = f"f32[{batch_size},{config.num_heads},{beams}{8 + 20},{config.hidden_size // config.num_heads}]"
    hlo = generate_ir(gpt2_model, batch_size=batch_size, max_new_tokens=20, pad_token_id=1, num_beams=num_beams,
                      stage="optimized_hlo")
    cache_ops = [line for line in _loop_body(hlo).splitlines()
                 if f"= {shape}" in line and "get-tuple-element(" not in line]
    assert cache_ops, "the cache shape was not found in the loop body"
    assert not [line for line in cache_ops if " copy(" in line or "transpose" in line.split("=")[0]
                or "gather" in line.split("=")[0]], cache_ops
    assert sum("dynamic-update-slice" in line.split("=")[0] for line in cache_ops) == 2 * config.num_layers


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
