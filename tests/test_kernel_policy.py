"""The kernel policy (`xlagen.native.Kernels`): one frozen value decides where the native kernels run.

These tests check the decisions themselves, which need no kernel: `native.library.ready` is replaced so
that the policy answers as on a machine that can run them (the programs are traced, never compiled with a
custom call). tests/test_native.py checks the compiled programs where the kernels run.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from conftest import random_ids
from xlagen import native
from xlagen.native import build, policy
from xlagen.generation.compiled import CompiledGenerator


@pytest.fixture
def kernels_ready(monkeypatch):
    """The policy's answers as on a machine that runs the kernels (no kernel is built or called)."""
    monkeypatch.setattr(native.library, "ready", lambda: True)
    monkeypatch.setattr(native.library, "constant", {"step_attention_max_head_dim": 256}.__getitem__)


def _under_xla(function):
    """What `function()` returns when traced by XLA (`jit_compile=True`): in a decoding step, a generation's
    prompt pass, or neither."""
    seen = {}

    def traced():
        seen["outside a step"] = function()
        with native.decoding_step():
            seen["in a step"] = function()
        with native.prefill():
            seen["in a prefill"] = function()

        def undeclared(i):
            seen["in a loop that is no step"] = function()
            return (i + 1,)

        tf.while_loop(lambda i: i < 1, undeclared, (tf.constant(0),))
        return tf.zeros(())

    tf.function(traced, jit_compile=True).get_concrete_function()
    return seen


# ----------------------------------------------------------------------------- the value

def test_a_policy_is_a_checked_frozen_hashable_value():
    assert native.Kernels() == native.Kernels.DEFAULT and native.Kernels.OFF.enabled is False
    assert len({native.Kernels(), native.Kernels(), native.Kernels.OFF}) == 2  # usable in a program's key
    with pytest.raises(dataclasses.FrozenInstanceError):
        native.Kernels().float32_max_rows = 3
    with pytest.raises(ValueError, match="Kernels.float32_max_rows must be >= 0, got -1"):
        native.Kernels(float32_max_rows=-1)
    with pytest.raises(TypeError, match="Kernels.float32 must be a bool, got 'no'"):
        native.Kernels(float32="no")
    with pytest.raises(TypeError, match="Kernels.attention_min_keys must be an int, got 2.5"):
        native.Kernels(attention_min_keys=2.5)
    with pytest.raises(TypeError, match="Kernels.packed_max_rows must be an int, got None"):
        native.Kernels(packed_max_rows=None)
    assert native.Kernels(float32_max_columns=None).float32_max_columns is None
    assert native.Kernels().replace(float32_max_rows=8) == native.Kernels(float32_max_rows=8)
    with pytest.raises(ValueError, match="step_attention_min_rows"):
        native.Kernels().replace(step_attention_min_rows=-2)


def test_a_policy_says_what_differs_from_the_default():
    assert str(native.Kernels()) == "default kernels"
    assert str(native.Kernels.OFF) == "kernels off"
    assert str(native.Kernels(float32=False, float32_max_rows=8)) == "kernels (float32=False, float32_max_rows=8)"


def test_the_environment_is_read_by_from_env_only():
    assert native.Kernels.from_env({}) == native.Kernels()
    assert native.Kernels.from_env({"XLAGEN_FLOAT32_KERNEL": "0"}) == native.Kernels(float32=False)
    with pytest.raises(ValueError, match="XLAGEN_FLOAT32_KERNEL must be 0 or 1, got 'off'"):
        native.Kernels.from_env({"XLAGEN_FLOAT32_KERNEL": "off"})
    assert native.PoolSettings.from_env({}) == native.PoolSettings()
    assert native.PoolSettings.from_env({"XLAGEN_NATIVE_THREADS": "3", "XLAGEN_NATIVE_SPIN_US": "0",
                                         "XLAGEN_NATIVE_LOOKAHEAD_KB": "128"}) == native.PoolSettings(3, 0, 128)
    for variable, value in (("XLAGEN_NATIVE_THREADS", "four"), ("XLAGEN_NATIVE_THREADS", "0"),
                            ("XLAGEN_NATIVE_SPIN_US", "-5"), ("XLAGEN_NATIVE_LOOKAHEAD_KB", "1.5")):
        with pytest.raises(ValueError, match=f"{variable}='{value}' is not valid"):
            native.PoolSettings.from_env({variable: value})


def test_tracing_sets_the_policy_in_force_and_restores_it(monkeypatch):
    monkeypatch.delenv("XLAGEN_FLOAT32_KERNEL", raising=False)
    assert native.current() == native.Kernels()
    with native.tracing(native.Kernels.OFF):
        assert native.current() == native.Kernels.OFF
        with native.tracing(None):  # None keeps the policy in force
            assert native.current() == native.Kernels.OFF
        with native.tracing(native.Kernels(float32=False)):
            assert native.current() == native.Kernels(float32=False)
        assert native.current() == native.Kernels.OFF
    assert native.current() == native.Kernels()
    monkeypatch.setenv("XLAGEN_FLOAT32_KERNEL", "0")
    assert native.current() == native.Kernels(float32=False)
    with pytest.raises(TypeError, match="kernels must be a xlagen.native.Kernels policy, got str"):
        with native.tracing("off"):
            pass


# ----------------------------------------------------------------------------- the decisions

def test_float32_products_use_the_kernel_in_compiled_decoding_steps_of_few_rows(kernels_ready):
    def ask(kernels, rows=2, k=64, n=96):
        with native.tracing(kernels):
            return _under_xla(lambda: native.use_float32_kernel(tf.zeros((rows, k)), tf.zeros((k, n))))

    assert ask(native.Kernels()) == {"outside a step": False, "in a step": True, "in a prefill": True,
                                     "in a loop that is no step": False}
    # A prompt of many rows: XLA's dot unless the many-row product takes it (`float32_many_rows`).
    assert not ask(native.Kernels(float32_many_rows=False), rows=17)["in a prefill"]
    assert ask(native.Kernels(float32_prefill=False))["in a step"]
    assert not ask(native.Kernels(float32_prefill=False))["in a prefill"]
    assert not any(ask(native.Kernels.OFF).values())
    assert not any(ask(native.Kernels(float32=False)).values())
    assert ask(native.Kernels(), rows=16)["in a step"] and not ask(native.Kernels(), rows=17)["in a step"]
    assert ask(native.Kernels(float32_max_rows=17), rows=17)["in a step"]
    assert not ask(native.Kernels(float32_min_bytes=64 * 96 * 4 + 1))["in a step"]
    assert not ask(native.Kernels(float32_max_columns=95), rows=1)["in a step"]
    assert ask(native.Kernels(float32_max_columns=95), rows=2)["in a step"]  # one row only
    with native.decoding_step(), native.prefill():
        assert not native.use_float32_kernel(tf.zeros((2, 64)), tf.zeros((64, 96)))  # eager: no XLA


def test_a_prompts_many_float32_rows_use_the_kernel_with_avx512_or_where_xla_has_one_thread(kernels_ready,
                                                                                             monkeypatch):
    # float32_many_rows=None (the default): with AVX-512 kernels; else it follows TensorFlow's intra-op pool:
    # with one thread there, XLA's dot would use one core, so a prompt's products of many rows go to the
    # kernels' pool.
    from xlagen.native import library

    def ask(kernels, rows=17):
        with native.tracing(kernels):
            return _under_xla(lambda: native.use_float32_kernel(tf.zeros((rows, 64)), tf.zeros((64, 96))))

    assert native.Kernels().float32_many_rows is None
    assert native.Kernels().many_float32_rows() == library.isa().startswith("avx512")
    assert ask(native.Kernels())["in a prefill"] == library.isa().startswith("avx512")
    monkeypatch.setattr(library, "isa", lambda: "avx2")
    assert not native.Kernels().many_float32_rows()
    assert not ask(native.Kernels())["in a prefill"]
    assert ask(native.Kernels(float32_many_rows=True))["in a prefill"]
    monkeypatch.setattr(tf.config.threading, "get_intra_op_parallelism_threads", lambda: 1)
    assert native.Kernels().many_float32_rows()
    assert ask(native.Kernels()) == {"outside a step": False, "in a step": False, "in a prefill": True,
                                     "in a loop that is no step": False}
    assert not ask(native.Kernels(float32_many_rows=False))["in a prefill"]
    assert str(native.Kernels(float32_many_rows=False)) == "kernels (float32_many_rows=False)"
    with pytest.raises(TypeError, match="Kernels.float32_many_rows must be a bool or None, got 1"):
        native.Kernels(float32_many_rows=1)


def test_packed_products_use_the_kernel_in_steps_and_for_few_rows(kernels_ready):
    def ask(kernels, rows):
        with native.tracing(kernels):
            return _under_xla(lambda: kernels.use_packed_product(tf.zeros((rows, 64))))

    most = native.Kernels().packed_max_rows
    assert ask(native.Kernels(), most) == {"outside a step": True, "in a step": True, "in a prefill": True,
                                           "in a loop that is no step": True}
    # More rows: the many-row product outside a step (`ops.matmul` picks it), or with many_rows off unpacked
    # weights for XLA's dot.
    assert all(ask(native.Kernels(), most + 1).values())
    assert ask(native.Kernels(many_rows=False), most + 1) == {
        "outside a step": False, "in a step": True, "in a prefill": False, "in a loop that is no step": False}
    assert not any(ask(native.Kernels.OFF, 1).values())


def test_prompt_attention_only_in_a_prompt_pass_from_its_token_count(kernels_ready):
    query, key = tf.zeros((1, 2, 256, 16)), tf.zeros((1, 2, 300, 16))  # 2 groups of 128 queries per head

    def ask(kernels, tokens=128, mask_shape=None, **changes):
        mask = tf.ones(mask_shape or (1, 1, tokens, 300), tf.bool)
        args = {"query": query, "key": key, "mask": mask, **changes}
        with native.tracing(kernels):
            return _under_xla(lambda: kernels.use_prompt_attention(**args))

    most = native.Kernels().prompt_attention_min_tokens
    assert most == 128
    assert ask(native.Kernels()) == {"outside a step": False, "in a step": False, "in a prefill": True,
                                     "in a loop that is no step": False}
    assert not any(ask(native.Kernels(), tokens=64).values())  # 64 tokens (4 groups): fewer than 128
    assert ask(native.Kernels(prompt_attention_min_tokens=64), tokens=64)["in a prefill"]
    assert not any(ask(native.Kernels(prompt_attention_min_tokens=None)).values())
    assert not any(ask(native.Kernels.OFF).values())
    assert not any(ask(native.Kernels(float32=False)).values())
    assert not any(ask(native.Kernels(), bias=tf.zeros((1, 2, 128, 300))).values())  # a bias of grouped queries
    assert not any(ask(native.Kernels(), dropout=True).values())
    assert not any(ask(native.Kernels(), mask_shape=(1, 2, 128, 300)).values())  # a mask per head
    # An encoder's: a padding mask of one row, T5's position bias per head (shared by the batch or not).
    ungrouped = tf.zeros((2, 2, 128, 16))
    for bias in (None, tf.zeros((1, 2, 128, 300)), tf.zeros((2, 2, 128, 300))):
        assert ask(native.Kernels(), mask_shape=(2, 1, 1, 300), query=ungrouped, key=tf.zeros((2, 2, 300, 16)),
                   bias=bias)["in a prefill"]
    assert not any(ask(native.Kernels(), mask_shape=(2, 1, 1, 300), query=ungrouped, key=tf.zeros((2, 2, 300, 16)),
                       bias=tf.zeros((1, 2, 1, 300))).values())  # a bias to broadcast
    # A decoder's cross-attention from one query row: no prompt.
    assert not any(ask(native.Kernels(prompt_attention_min_tokens=1), mask_shape=(1, 1, 1, 300),
                       query=tf.zeros((1, 2, 1, 16))).values())
    assert not any(ask(native.Kernels(), key=tf.zeros((1, 2, 300, 24)), query=tf.zeros((1, 2, 256, 24))).values())


def test_a_fresh_cache_is_written_natively_only_in_a_prompt_pass_from_its_token_count(kernels_ready):
    def ask(kernels, tokens=64, projection=None, cache=None, heads=2, head_dim=16):
        projection = tf.zeros((2, tokens, 96)) if projection is None else projection
        cache = tf.zeros((2, 2, 80, 16)) if cache is None else cache
        with native.tracing(kernels):
            return _under_xla(lambda: kernels.use_fresh_cache(native.Heads(projection, 32, heads, head_dim), cache))

    assert native.Kernels().prompt_cache_min_tokens == 64
    assert ask(native.Kernels()) == {"outside a step": False, "in a step": False, "in a prefill": True,
                                     "in a loop that is no step": False}
    assert not any(ask(native.Kernels(), tokens=63).values())
    assert ask(native.Kernels(prompt_cache_min_tokens=8), tokens=8)["in a prefill"]
    assert not any(ask(native.Kernels(prompt_cache_min_tokens=None)).values())
    assert not any(ask(native.Kernels.OFF).values())
    assert not any(ask(native.Kernels(float32=False)).values())
    assert not any(ask(native.Kernels(), tokens=81).values())  # more tokens than the cache holds
    assert not any(ask(native.Kernels(), cache=tf.zeros((1, 2, 80, 16))).values())  # another batch
    assert not any(ask(native.Kernels(), cache=tf.zeros((2, 2, 80, 16), tf.bfloat16)).values())
    assert not any(ask(native.Kernels(), cache=tf.zeros((2, 2, 2, 80, 16))).values())  # the beam layout
    assert not any(ask(native.Kernels(), projection=tf.zeros((2, 64, 96), tf.bfloat16)).values())
    assert not any(ask(native.Kernels(), heads=3, head_dim=16).values())  # heads the cache does not have
    assert not any(ask(native.Kernels(), heads=4, head_dim=8).values())


def test_int8_products_run_in_integers_from_their_min_rows(kernels_ready):
    def ask(kernels, rows):
        with native.tracing(kernels):
            return _under_xla(lambda: kernels.use_integer_product(tf.zeros((rows, 64))))

    least = native.Kernels().int8_integer_min_rows
    assert least is not None and least > 1  # batch-1 decoding keeps the float32-compute kernel
    everywhere = {"outside a step": True, "in a step": True, "in a prefill": True, "in a loop that is no step": True}
    assert ask(native.Kernels(), least) == ask(native.Kernels(), 600) == everywhere
    assert not any(ask(native.Kernels(), least - 1).values())
    assert not any(ask(native.Kernels(int8_integer_min_rows=None), 600).values())
    assert not any(ask(native.Kernels.OFF, 600).values())
    assert native.Kernels(int8_integer_min_rows=0).use_integer_product(tf.zeros((1, 8))) is False  # eager
    with pytest.raises(TypeError, match="Kernels.int8_integer_min_rows must be an int, got 'x'"):
        native.Kernels(int8_integer_min_rows="x")


def test_int8_products_of_many_rows_run_in_7_bit_integers_from_their_min_rows(kernels_ready):
    def ask(kernels, rows):
        with native.tracing(kernels):
            return _under_xla(lambda: kernels.use_many_integer_product(tf.zeros((rows, 64))))

    least = native.Kernels().int8_many_integer_min_rows
    # With vectors, a decoding step of 2 beams over a batch of 8 keeps 8 bits; on AMX's tiles 7 bits from 8 rows.
    assert least == (8 if build.tiles_granted() else 24)
    everywhere = {"outside a step": True, "in a step": True, "in a prefill": True, "in a loop that is no step": True}
    assert ask(native.Kernels(), least) == ask(native.Kernels(int8_integer_min_rows=None), 600) == everywhere
    assert not any(ask(native.Kernels(), least - 1).values())
    assert not any(ask(native.Kernels(int8_many_integer_min_rows=None), 600).values())
    assert not any(ask(native.Kernels.OFF, 600).values())
    assert native.Kernels(int8_many_integer_min_rows=0).use_many_integer_product(tf.zeros((1, 8))) is False  # eager
    with pytest.raises(ValueError, match="Kernels.int8_many_integer_min_rows must be >= 0, got -1"):
        native.Kernels(int8_many_integer_min_rows=-1)


def test_attention_argmax_and_folded_memory_follow_their_fields(kernels_ready):
    q, k = tf.zeros((1, 2, 4, 64)), tf.zeros((1, 2, 256, 64))
    kt = tf.transpose(k, (0, 1, 3, 2))
    states = tf.zeros((2, 256, 128))  # 256 KiB

    def ask(kernels):
        with native.tracing(kernels):
            return _under_xla(lambda: (native.use_attention_kernel(q, k), native.use_attention_kernel(
                q, kt, key_transposed=True), native.use_argmax(tf.zeros((2, 50))),
                native.use_memory_attention(states, None, 64), native.use_step_attention(q, k)))["in a step"]

    assert ask(native.Kernels()) == (True, True, True, False, True)
    assert ask(native.Kernels(memory_attention_min_bytes=256 * 1024)) == (True, True, True, True, True)
    assert ask(native.Kernels(attention_min_keys=257)) == (False, False, True, False, True)
    assert ask(native.Kernels(cross_attention=False)) == (True, False, True, False, True)
    assert ask(native.Kernels(argmax=False)) == (True, True, False, False, True)
    assert ask(native.Kernels(step_attention_min_rows=5)) == (True, True, True, False, False)
    assert ask(native.Kernels.OFF) == (False,) * 5
    assert ask(native.Kernels(float32=False)) == (False,) * 5


def test_decoding_loops_declare_their_steps(monkeypatch, gpt2_model):
    """generate's loops trace `decode_step` inside `native.decoding_step()` and the prefill outside it, in
    `native.prefill()`: the products' questions say where they were asked."""
    asked = []

    def spy(x, kernel):
        assert native.policy.in_decoding_step() != native.policy.in_prefill()  # a product is in one of them
        asked.append((x.shape[:-1].num_elements(), native.policy.in_decoding_step()))
        return False

    monkeypatch.setattr(native, "use_float32_kernel", spy)
    ids = tf.constant(random_ids((2, 5), 300, seed=4))
    for options, step_rows in (({}, 2), ({"num_beams": 3}, 6)):
        asked.clear()
        tf.function(lambda ids: gpt2_model.generate(ids, max_new_tokens=3, **options),
                    jit_compile=True).get_concrete_function(ids)
        assert {in_step for _, in_step in asked} == {False, True}
        assert {rows for rows, in_step in asked if in_step} == {step_rows}
        assert all(rows >= 2 * 5 or rows == 2 for rows, in_step in asked if not in_step)  # the prefill


def test_generate_and_compiled_generator_take_a_policy(gpt2_model, caplog):
    ids = random_ids((1, 5), 300, seed=5)
    expected = gpt2_model.generate(ids, max_new_tokens=4).numpy()
    generator = CompiledGenerator(gpt2_model, kernels=native.Kernels.OFF)
    with caplog.at_level("INFO", logger="xlagen.generation.compiled"):
        np.testing.assert_array_equal(generator.generate(ids, max_new_tokens=4).numpy(), expected)
    assert generator.kernels == native.Kernels.OFF and generator.trace_log[0].key.kernels == native.Kernels.OFF
    assert "(kernels off): first call" in caplog.text  # the trace log names the policy
    with native.tracing(native.Kernels(float32=False)):  # the policy in force when it is made
        assert CompiledGenerator(gpt2_model).kernels == native.Kernels(float32=False)
    with pytest.raises(TypeError, match="kernels must be a xlagen.native.Kernels policy, got str"):
        CompiledGenerator(gpt2_model, kernels="off")
    with pytest.raises(TypeError, match="kernels must be a xlagen.native.Kernels policy, got bool"):
        gpt2_model.generate(ids, max_new_tokens=2, kernels=False)


@pytest.mark.parametrize("isa, granted, rows", [("avx512amx", True, 8), ("avx512amx", False, 24), ("avx512vnni", False, 24),
                                                ("avx2", False, 24), (None, False, 24)])
def test_the_7_bit_product_starts_at_fewer_rows_on_amx_tiles(monkeypatch, isa, granted, rows):
    # Only where Linux grants the tiles: refused, the 7-bit product runs on vectors, slower than 8 bits below 24.
    monkeypatch.setattr(build, "host_isa", lambda: isa)
    monkeypatch.setattr(build.ctypes, "CDLL", lambda name: type("Libc", (), {"syscall": lambda *a: 0 if granted else -1}))
    policy.many_integer_min_rows.cache_clear()
    try:
        assert native.Kernels().int8_many_integer_min_rows == rows
        assert str(native.Kernels()) == "default kernels"
        assert str(native.Kernels(int8_many_integer_min_rows=rows + 1)) == f"kernels (int8_many_integer_min_rows={rows + 1})"
    finally:
        policy.many_integer_min_rows.cache_clear()


def test_bfloat16_tiles_follow_the_process_and_refuse_where_it_has_none(monkeypatch):
    from xlagen.native import library

    def unavailable():
        raise native.NativeUnavailable("no compiler here")

    for has, default in ((lambda: True, True), (lambda: False, False), (unavailable, False)):
        monkeypatch.setattr(library, "amx_tiles", has)
        assert native.Kernels().use_bfloat16_tiles() is default
        assert native.Kernels(bfloat16_tiles=False).use_bfloat16_tiles() is False
    monkeypatch.setattr(library, "amx_tiles", lambda: True)
    assert native.Kernels(bfloat16_tiles=True).use_bfloat16_tiles() is True
    assert native.Kernels(bfloat16_tiles=np.False_).use_bfloat16_tiles() is False
    monkeypatch.setattr(library, "amx_tiles", lambda: False)
    with pytest.raises(native.NativeUnavailable, match=r"bfloat16_tiles=True needs AMX's bfloat16 tiles"):
        native.Kernels(bfloat16_tiles=True).use_bfloat16_tiles()
    monkeypatch.setattr(library, "amx_tiles", unavailable)
    with pytest.raises(native.NativeUnavailable, match="no compiler here"):
        native.Kernels(bfloat16_tiles=True).use_bfloat16_tiles()
    with pytest.raises(TypeError, match="Kernels.bfloat16_tiles must be a bool or None"):
        native.Kernels(bfloat16_tiles=1)
