"""What a tokenizer folder holds: the special tokens and settings of `tokenizer_config.json` and
`special_tokens_map.json` (`TokenizerConfig`, layered as transformers does) and the `tokenizers`
backend (`tokenizer.json`, or GPT-2's `vocab.json` + `merges.txt`). Used by `xlagen.tokenizer`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from xlagen.weights.checkpoint import read_json

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_NO_MAX_LENGTH = int(1e30)  # transformers' VERY_LARGE_INTEGER: the checkpoint sets no limit.
LARGE_LENGTH = int(1e20)  # transformers' LARGE_INTEGER: above this, model_max_length counts as unset.
# Special tokens that transformers' tokenizer classes supply when a checkpoint leaves them out
# (openai-community/gpt2's tokenizer_config.json holds nothing but model_max_length).
_ENDOFTEXT = {name: "<|endoftext|>" for name in ("bos_token", "eos_token", "unk_token")}
_CLASS_DEFAULTS = {"GPT2Tokenizer": _ENDOFTEXT, "WhisperTokenizer": _ENDOFTEXT,
                   "T5Tokenizer": {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}}
# The tokenizer class of a checkpoint whose tokenizer_config.json names none, by config.json model_type.
_MODEL_TYPE_CLASSES = {"gpt2": "GPT2Tokenizer", "opt": "GPT2Tokenizer", "t5": "T5Tokenizer",
                       "whisper": "WhisperTokenizer"}
# tokenizer_config.json keys that change the output in ways this module does not implement.
_UNSUPPORTED_FLAGS = ("add_eos_token", "split_special_tokens")
# Keys not copied to a saved tokenizer_config.json: stored in tokenizer.json, or stale once saved.
_NOT_PASSED_THROUGH = frozenset({"added_tokens_decoder", "tokenizer_file", "vocab_file", "merges_file",
                                 "name_or_path", "special_tokens_map_file"})

@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    """Special tokens and settings of a tokenizer (tokenizer_config.json + special_tokens_map.json).

    Special tokens are strings, or None when the checkpoint has none. `model_max_length` 1e30 means
    no limit. `tokenizer_class` is transformers' class name, saved so that transformers can load the
    folder; `passthrough` holds the other tokenizer_config.json keys, saved back unchanged.
    """

    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    sep_token: str | None = None
    pad_token: str | None = None
    cls_token: str | None = None
    mask_token: str | None = None
    additional_special_tokens: tuple[str, ...] = ()
    padding_side: str = "right"
    truncation_side: str = "right"
    model_max_length: int = _NO_MAX_LENGTH
    clean_up_tokenization_spaces: bool = False
    tokenizer_class: str = "PreTrainedTokenizerFast"
    passthrough: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for name in ("padding_side", "truncation_side"):
            if getattr(self, name) not in ("left", "right"):
                raise ValueError(f"{name} must be 'left' or 'right', got {getattr(self, name)!r}.")

    @classmethod
    def from_hf_config(cls, values: dict[str, Any]) -> TokenizerConfig:
        """Builds the config from merged tokenizer files; raises ValueError on unsupported settings."""
        for key in _UNSUPPORTED_FLAGS:
            if values.get(key):
                raise ValueError(f"tokenizer_config.json sets {key}=true, which xlagen does not support.")
        fields = {field.name for field in dataclasses.fields(cls)}
        return cls(
            **{name: token_content(values.get(name)) for name in SPECIAL_TOKEN_NAMES},
            additional_special_tokens=tuple(token_content(t) for t in values.get("additional_special_tokens") or ()),
            padding_side=values.get("padding_side") or "right",
            truncation_side=values.get("truncation_side") or "right",
            model_max_length=int(values.get("model_max_length") or _NO_MAX_LENGTH),
            clean_up_tokenization_spaces=bool(values.get("clean_up_tokenization_spaces", False)),
            tokenizer_class=values.get("tokenizer_class") or "PreTrainedTokenizerFast",
            passthrough={k: v for k, v in values.items() if k not in fields and k not in _NOT_PASSED_THROUGH},
        )


def read_json_or_empty(path: pathlib.Path) -> dict[str, Any]:
    """Reads a JSON object file, or returns {} when it does not exist."""
    return read_json(path.parent, path.name, required=False) or {}


def token_content(value: Any) -> Any:
    """The string of a special-token value, which checkpoints store as a string or {"content": ...}."""
    return value["content"] if isinstance(value, dict) else value


def added_token(entry: str | dict[str, Any]) -> tokenizers.AddedToken:
    """Builds a special AddedToken from a string or a transformers added-token dict."""
    if isinstance(entry, str):
        return tokenizers.AddedToken(entry, special=True)
    flags = {key: entry[key] for key in ("single_word", "lstrip", "rstrip", "normalized") if key in entry}
    return tokenizers.AddedToken(entry["content"], special=entry.get("special", True), **flags)


def merge_settings(hf_config: dict, special_map: dict, model_type: str | None, overrides: dict) -> dict:
    """Layers settings as transformers does: class defaults < tokenizer_config < special_tokens_map < arguments."""
    tokenizer_class = hf_config.get("tokenizer_class") or _MODEL_TYPE_CLASSES.get(model_type) or ""
    tokenizer_class = tokenizer_class.removesuffix("Fast")
    values = {**_CLASS_DEFAULTS.get(tokenizer_class, {}), **hf_config, "tokenizer_class": tokenizer_class}
    additional = list(values.get("additional_special_tokens") or ())
    if isinstance(values.get("extra_special_tokens"), list):  # transformers 5's name for the same list
        additional += [t for t in values.pop("extra_special_tokens") if t not in additional]
    contents = {token_content(token) for token in additional}
    additional += [t for t in special_map.get("additional_special_tokens") or () if token_content(t) not in contents]
    values.update(special_map, additional_special_tokens=additional)
    values.update(overrides)
    return values


def load_backend(folder: pathlib.Path, hf_config: dict[str, Any], bos_token: str | None) -> tokenizers.Tokenizer:
    """Reads tokenizer.json, or builds GPT-2's byte-level BPE tokenizer from vocab.json + merges.txt."""
    add_prefix_space = bool(hf_config.get("add_prefix_space", False))
    if (folder / "tokenizer.json").is_file():
        backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        # transformers makes a pre-tokenizer that has this flag (ByteLevel; not Metaspace, whose
        # legacy flag is re-serialized as prepend_scheme) follow tokenizer_config.json, default False.
        state = json.loads(backend.to_str())
        if (state.get("pre_tokenizer") or {}).get("add_prefix_space", add_prefix_space) != add_prefix_space:
            state["pre_tokenizer"]["add_prefix_space"] = add_prefix_space
            backend = tokenizers.Tokenizer.from_str(json.dumps(state))
        return backend
    vocab, merges = folder / "vocab.json", folder / "merges.txt"
    if not (vocab.is_file() and merges.is_file()):
        raise OSError(f"No tokenizer files in '{folder}': looked for tokenizer.json, or for vocab.json "
                      "together with merges.txt.")
    backend = tokenizers.Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    backend.decoder = decoders.ByteLevel()
    if hf_config.get("add_bos_token") and bos_token is not None:  # OPT prepends its bos, "</s>".
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos_token}:0 $A:0", pair=f"{bos_token}:0 $A:0 $B:1",
            special_tokens=[(bos_token, backend.token_to_id(bos_token))])
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return backend
