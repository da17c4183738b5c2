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
