"""xlagen: XLA-compiled text and speech generation for TensorFlow with the transformers 4.x TF API.

Names are imported lazily (PEP 562), so `from xlagen import AutoTokenizer` does not load TensorFlow.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "AutoTokenizer": "xlagen.text.auto_tokenizer",
    "GPT2TokenizerFast": "xlagen.text.tokenizer",
    "PreTrainedTokenizerFast": "xlagen.text.tokenizer",
    "WhisperTokenizerFast": "xlagen.text.whisper_tokens",
    "WhisperFeatureExtractor": "xlagen.speech.audio",
    "load_audio": "xlagen.speech.audio",
    "AutoFeatureExtractor": "xlagen.speech.processing",
    "AutoProcessor": "xlagen.speech.processing",
    "WhisperProcessor": "xlagen.speech.processing",
    "GenerationConfig": "xlagen.generation.config",
    "GenerateOutput": "xlagen.generation.api",
    "Buckets": "xlagen.generation.compiled",
    "CompiledGenerator": "xlagen.generation.compiled",
    "compile_generate": "xlagen.generation.compiled",
    "GPT2Config": "xlagen.models.gpt2",
    "OPTConfig": "xlagen.models.opt",
    "LlamaConfig": "xlagen.models.llama",
    "T5Config": "xlagen.models.t5",
    "WhisperConfig": "xlagen.models.whisper",
    "TFAutoModelForCausalLM": "xlagen.modeling",
    "TFAutoModelForSeq2SeqLM": "xlagen.modeling",
    "TFGPT2LMHeadModel": "xlagen.modeling",
    "TFOPTForCausalLM": "xlagen.modeling",
    "TFLlamaForCausalLM": "xlagen.modeling",
    "TFMistralForCausalLM": "xlagen.modeling",
    "TFQwen2ForCausalLM": "xlagen.modeling",
    "TFQwen3ForCausalLM": "xlagen.modeling",
    "TFT5ForConditionalGeneration": "xlagen.modeling",
    "TFAutoModelForSpeechSeq2Seq": "xlagen.modeling",
    "TFWhisperForConditionalGeneration": "xlagen.modeling",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'xlagen' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
