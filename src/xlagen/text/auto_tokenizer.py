"""`AutoTokenizer`: the tokenizer class a checkpoint names, above the classes it picks from (numpy only)."""

from __future__ import annotations

from xlagen.text.tokenizer import PreTrainedTokenizerFast
from xlagen.text.whisper_tokens import WhisperTokenizerFast

# A checkpoint's tokenizer_class (without "Fast") -> xlagen's class; every other name is the generic class.
TOKENIZER_CLASSES = {"WhisperTokenizer": WhisperTokenizerFast}


class AutoTokenizer(PreTrainedTokenizerFast):
    """transformers' entry point: `AutoTokenizer.from_pretrained(...)` returns the tokenizer the checkpoint
    names: a `WhisperTokenizerFast` for Whisper, else a `PreTrainedTokenizerFast`."""

    def __init__(self, *args, **kwargs):
        raise TypeError("use AutoTokenizer.from_pretrained(name_or_path)")

    @classmethod
    def _class_for(cls, tokenizer_class: str) -> type:
        return TOKENIZER_CLASSES.get(tokenizer_class, PreTrainedTokenizerFast)
