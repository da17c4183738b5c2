"""Shared fixtures: tiny Hugging Face checkpoints built here (no downloads), and the PyTorch reference."""

from __future__ import annotations

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest

CORPUS = [
    "TensorFlow is an open source platform for machine learning.",
    "XLA compiles the whole generation loop into one program.",
    "The quick brown fox jumps over the lazy dog.",
    "In the beginning God created the heaven and the earth.",
    "Hello world, hello tokens, hello language models.",
] * 4

GPT2_BASE = dict(n_embd=32, n_layer=2, n_head=4, n_positions=64)


# The slow tier: tests that take about a minute or more on two busy cores, whole modules where their fixtures are
# the cost. `-m "not slow"` leaves the fast tier, for the edit-and-test loop (a few minutes); CI runs both.
SLOW_MODULES = frozenset({
    "tests/test_aot.py", "tests/test_export.py", "tests/test_speech_export.py", "tests/serving/test_restart.py",
    "tests/serving/test_deploy.py", "tests/test_native_build.py", "tests/test_bench.py", "tests/test_shared_trace.py",
    "tests/models/test_training.py", "tests/test_introspection.py", "tests/serving/test_transcription_server.py"})
SLOW_TESTS = frozenset(f"tests/{name}" for name in """
    test_native.py::test_whisper_with_packed_weights_generates_as_float32_with_rounded_weights
    test_native.py::test_gpt2_with_packed_weights_generates_as_float32_with_rounded_weights
    test_native.py::test_other_models_generate_the_same_with_the_float32_kernel
    test_native.py::test_cli_generate_with_packed_weights_matches_the_api
    test_native.py::test_t5_with_packed_weights_generates_as_float32_with_rounded_weights
    test_native.py::test_opt_with_packed_weights_generates_as_float32_with_rounded_weights
    test_native.py::test_bench_measures_packed_weights_beside_float32
    test_native.py::test_float32_kernel_only_in_decoding_loops_of_few_rows
    test_native.py::test_gpt2_generates_the_same_with_the_float32_kernel
    test_native.py::test_float32_kernel_limits_by_size_and_width
    test_native.py::test_the_kernel_library_builds_into_the_cache_folder_once
    test_native_prompts.py::test_prompt_attention_generates_as_xla_attention
    test_native_prompts.py::test_a_long_encoder_outputs_cross_attention_memory_is_laid_out_in_heads_natively
    test_native_prompts.py::test_long_prompts_keys_and_values_are_written_into_the_fresh_cache_natively
    test_native_prompts.py::test_long_prompts_with_packed_weights_generate_as_float32_with_rounded_weights
    test_native_prompts.py::test_long_prompts_rms_norms_run_natively_close_to_xla
    models/test_opt.py::test_generate_matches_transformers
    models/test_opt.py::test_left_padded_rows_equal_rows_alone
    models/test_opt.py::test_logits_match_transformers
    models/test_whisper.py::test_generate_matches_transformers
    models/test_whisper.py::test_fused_attention_matches_transformers
    models/test_whisper.py::test_training_through_the_fused_encoder_attention
    models/test_whisper.py::test_folded_cross_attention_matches_transformers
    models/test_whisper.py::test_xla_equals_eager
    models/test_whisper.py::test_compiled_generator_matches_generate
    models/test_whisper.py::test_generate_128_mels_matches_transformers
    models/test_t5.py::test_loss_matches_transformers_and_fit_learns
    models/test_t5.py::test_generate_matches_transformers
    models/test_llama.py::test_generate_matches_transformers
    test_transcribe.py::test_segment_measures_match_transformers
    test_transcribe.py::test_cli_formats
    test_transcribe.py::test_long_form_matches_transformers
    generation/test_compiled.py::test_varied_workload_compiles_once_per_bucket
    generation/test_compiled.py::test_compiled_equals_uncompiled
    generation/test_compiled.py::test_numeric_options_do_not_recompile_and_reasons_are_logged
    serving/test_engine.py::test_other_families_equal_generate
    serving/test_engine.py::test_a_narrow_step_reads_its_rows_of_the_whole_cache
    serving/test_engine.py::test_default_buckets_take_every_prompt_that_fits
    serving/test_engine.py::test_whisper_equals_generate
    serving/test_engine.py::test_a_seed_gives_the_same_tokens_on_the_engine_and_the_request_batcher
    serving/test_server.py::test_a_request_whose_prompts_partly_fail_cancels_the_others
    test_cli.py::test_generate_prints_prompt_and_continuation_xla_equals_eager
""".split())


def pytest_collection_modifyitems(config, items):
    """Marks the tests of `SLOW_MODULES` and `SLOW_TESTS` slow."""
    for item in items:
        module, _, name = item.nodeid.partition("::")
        if module in SLOW_MODULES or f"{module}::{name.split('[')[0]}" in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


def kernels_expected() -> bool:
    """Whether the tests of xlagen's native kernels must run here: wherever the kernels can run, and in CI
    (XLAGEN_CI=1, set by .ci/run, which installs the compiler) also where they cannot for a missing install,
    which then fails them instead of skipping. Only a machine that cannot run them at all (not Linux on
    x86-64, or a CPU with neither AVX-512 nor AVX2 and FMA) skips them, with that reason in the summary."""
    from xlagen import native

    if native.unavailable_reason() is None:
        return True
    return bool(os.environ.get("XLAGEN_CI")) and native.hardware_reason() is None


def _kernels_skip_reason() -> str:
    from xlagen import native

    return f"native kernels: {native.unavailable_reason()}"


requires_kernels = pytest.mark.skipif(not kernels_expected(), reason=_kernels_skip_reason())


def require_extra(*modules: str) -> None:
    """Imports an optional extra's modules (e.g. the `serve` extra's fastapi): a missing one skips the calling
    test module, except in CI (XLAGEN_CI=1), where it fails it."""
    import importlib

    for module in modules:
        if os.environ.get("XLAGEN_CI"):
            importlib.import_module(module)
        else:
            pytest.importorskip(module)


def build_bpe_tokenizer(folder, vocab_size: int = 320) -> int:
    """Trains a byte-level BPE on CORPUS (256 byte symbols + merges), writes tokenizer.json +
    tokenizer_config.json; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    special = "<|endoftext|>"
    config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": special, "eos_token": special,
              "unk_token": special, "model_max_length": GPT2_BASE["n_positions"], "add_prefix_space": False}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return tokenizer.get_vocab_size()


def build_t5_tokenizer(folder) -> int:
    """Trains a T5-style tokenizer on CORPUS (Unigram, Metaspace, "</s>" appended, "<pad>" id 0,
    "</s>" id 1, "<unk>" id 2), writes tokenizer.json + tokenizer_config.json; returns its size (64)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.Replace(Regex(" {2,}"), " ")
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=64, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>",
                                      show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                             special_tokens=[("</s>", 1)])
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    config = {"tokenizer_class": "T5Tokenizer", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
              "model_max_length": 512, "extra_ids": 0}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return tokenizer.get_vocab_size()


def save_tiny_gpt2(folder, seed: int = 0, **overrides):
    """A random transformers GPT2LMHeadModel saved as safetensors; returns the torch model (eval mode)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    # The "eager" attention is transformers' reference math: its SDPA path silently ignores
    # scale_attn_weights=False and scale_attn_by_inverse_layer_idx.
    values = {"vocab_size": 64, "bos_token_id": 0, "eos_token_id": 0, **GPT2_BASE, **overrides}
    config = transformers.GPT2Config(attn_implementation="eager", **values)
    model = transformers.GPT2LMHeadModel(config).eval()
    # Larger-than-default weights make the random model's distributions peaked, so greedy and beam
    # choices are far from ties and EOS and repetitions actually happen.
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.mul_(6.0)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="session")
def gpt2_checkpoint(tmp_path_factory):
    """(folder, torch model) of a tiny GPT-2 with a matching BPE tokenizer in the same folder."""
    folder = tmp_path_factory.mktemp("gpt2")
    vocab = build_bpe_tokenizer(folder)
    torch_model = save_tiny_gpt2(folder, vocab_size=vocab, bos_token_id=0, eos_token_id=0)
    return str(folder), torch_model


@pytest.fixture(scope="session")
def gpt2_model(gpt2_checkpoint):
    """The xlagen model loaded from `gpt2_checkpoint`."""
    from xlagen import TFAutoModelForCausalLM

    return TFAutoModelForCausalLM.from_pretrained(gpt2_checkpoint[0])


def random_ids(shape, vocab: int, seed: int = 0) -> np.ndarray:
    # Ids >= 2: a prompt never contains the tiny models' EOS id 0 or the tests' pad id 1 by accident.
    return np.random.RandomState(seed).randint(2, vocab, shape).astype(np.int32)


def tiny_family_model(folder, family: str):
    """(a tiny random "opt" / "mistral" / "t5" / "whisper" model saved to `folder` and loaded by xlagen,
    generate inputs for it): OPT with a projected pre-norm stack, Mistral with 4 queries per key/value head and
    a window of 4, T5 v1.1, Whisper on 30 s of random features."""
    from xlagen import TFAutoModelForCausalLM, TFAutoModelForSeq2SeqLM, TFWhisperForConditionalGeneration

    if family == "opt":
        from models.test_opt import VARIANTS, save_tiny_opt

        save_tiny_opt(folder, **VARIANTS["projected_pre_norm"])
        model, ids = TFAutoModelForCausalLM.from_pretrained(folder), random_ids((2, 6), 50, seed=4)
        return model, {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    if family == "mistral":  # the Llama family with grouped-query attention and a sliding window
        from models.test_llama import save_tiny

        save_tiny(folder, "mistral")
        model, ids = TFAutoModelForCausalLM.from_pretrained(folder), random_ids((2, 6), 50, seed=4)
        return model, {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    if family == "t5":
        from models.test_t5 import save_tiny_t5

        save_tiny_t5(folder, "v1_1")
        model, ids = TFAutoModelForSeq2SeqLM.from_pretrained(folder), random_ids((2, 6), 50, seed=5)
        return model, {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    from models.test_whisper import save_tiny_whisper

    save_tiny_whisper(folder)
    model = TFWhisperForConditionalGeneration.from_pretrained(folder)
    features = np.random.default_rng(6).standard_normal((1, model.config.num_mel_bins, 3000)).astype(np.float32)
    return model, {"input_features": features}
