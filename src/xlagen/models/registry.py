"""model_type (from config.json) -> the architecture classes and their weight table."""

from __future__ import annotations

from typing import NamedTuple

from xlagen.models import gpt2, llama, opt, t5, whisper
from xlagen.weights import gpt2 as gpt2_weights
from xlagen.weights import llama as llama_weights
from xlagen.weights import opt as opt_weights
from xlagen.weights import t5 as t5_weights
from xlagen.weights import whisper as whisper_weights


class Architecture(NamedTuple):
    """Everything xlagen needs to build and load one model_type."""

    config_class: type
    model_class: type
    weights: object  # module with rules(config), ignore(config), PREFIX, saved_name(name); optionally
    # resolve_config(config, tensors) (the config a checkpoint's tensors make) and
    # saved_tensors(config, tensors) (what save_pretrained writes)


CAUSAL_LM = {"gpt2": Architecture(gpt2.GPT2Config, gpt2.GPT2LMHead, gpt2_weights),
             "opt": Architecture(opt.OPTConfig, opt.OPTLM, opt_weights),
             # One implementation for the Llama family; the config's model_type sets its flags.
             **{family: Architecture(llama.LlamaConfig, llama.LlamaLM, llama_weights) for family in llama.FAMILIES}}

SEQ2SEQ_LM = {"t5": Architecture(t5.T5Config, t5.T5LM, t5_weights)}

SPEECH_SEQ2SEQ = {"whisper": Architecture(whisper.WhisperConfig, whisper.WhisperLM, whisper_weights)}


def lookup(model_type: str | None, table: dict[str, Architecture], task: str) -> Architecture:
    """The architecture for `model_type`, or a ValueError naming the supported ones."""
    if model_type not in table:
        raise ValueError(f"model_type {model_type!r} is not supported for {task}; xlagen supports: "
                         f"{', '.join(sorted(table))}")
    return table[model_type]
