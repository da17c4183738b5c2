"""xlagen: XLA-compiled text generation for TensorFlow with the transformers 4.x TF API."""

from xlagen.generation.api import GenerateOutput
from xlagen.generation.config import GenerationConfig
from xlagen.modeling import TFAutoModelForCausalLM, TFGPT2LMHeadModel
from xlagen.models.gpt2 import GPT2Config
from xlagen.tokenizer import AutoTokenizer, GPT2TokenizerFast, PreTrainedTokenizerFast

__version__ = "0.1.0"

__all__ = ["AutoTokenizer", "GPT2Config", "GPT2TokenizerFast", "GenerateOutput", "GenerationConfig",
           "PreTrainedTokenizerFast", "TFAutoModelForCausalLM", "TFGPT2LMHeadModel", "__version__"]
