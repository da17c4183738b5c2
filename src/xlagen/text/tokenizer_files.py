"""What a tokenizer folder holds: the special tokens and settings of `tokenizer_config.json` and
`special_tokens_map.json` (`TokenizerConfig`, layered as transformers does) and the `tokenizers`
backend (`tokenizer.json`, or GPT-2's `vocab.json` + `merges.txt`). Used by `xlagen.text.tokenizer`.
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
                                 "name_or_path", "special_tokens_map_file", "extra_special_tokens"})

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
    """Reads a JSON object file, or returns {} when it does not exist.

    Raises:
        ValueError: If the file is not a JSON object, or a setting xlagen reads has the wrong type
            (the message names the file, the key and the expected type).
    """
    values = read_json(path.parent, path.name, required=False) or {}
    for key, value in values.items():
        expected = _setting_problem(key, value)
        if expected:
            raise ValueError(f"'{path}': {key} must be {expected}, got {_short(value)} ({type(value).__name__}).")
    return values


def _short(value: Any) -> str:
    """The start of a value's repr, for a message."""
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_token(value: Any) -> bool:
    """A special-token value: a string, or an added-token dict with a string "content"."""
    return isinstance(value, str) or (isinstance(value, dict) and isinstance(value.get("content"), str))


def _setting_problem(key: str, value: Any) -> str | None:
    """What a tokenizer setting must be, when `value` is not that; None when it is fine (or not read)."""
    if key in SPECIAL_TOKEN_NAMES:
        ok = value is None or _is_token(value)
        return None if ok else 'a token string, an added-token object with a "content" string, or null'
    if key == "additional_special_tokens":
        ok = value is None or (isinstance(value, list) and all(_is_token(t) for t in value))
        return None if ok else "a list of token strings or added-token objects"
    if key == "added_tokens_decoder":
        ok = isinstance(value, dict) and all(k.isascii() and k.isdigit() and _is_token(v) for k, v in value.items())
        return None if ok else 'an object mapping token ids ("50256") to added-token objects'
    if key == "model_max_length":
        ok = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                               and 0 < value < float("inf"))
        return None if ok else "a positive finite number or null"
    if key in ("padding_side", "truncation_side"):
        return None if value in (None, "left", "right") else '"left" or "right"'
    if key in ("tokenizer_class", "model_type"):  # model_type: config.json, read for the tokenizer class
        return None if value is None or isinstance(value, str) else "a string"
    if key in ("add_prefix_space", "add_bos_token", "add_eos_token", "clean_up_tokenization_spaces",
               "split_special_tokens"):
        return None if value is None or isinstance(value, bool) else "true, false or null"
    return None


def backend_call(path: pathlib.Path | str, function, *args) -> Any:
    """Calls into the `tokenizers` library on the contents of `path`, making its errors ValueErrors naming the file.

    The library raises a bare `Exception` for a malformed file, and for some inconsistent ones panics:
    `pyo3_runtime.PanicException` derives from BaseException, so `except Exception` would not stop it.

    Raises:
        ValueError: naming `path`, chained to the library's error.
    """
    try:
        return function(*args)
    except Exception as e:
        raise ValueError(f"'{path}' could not be loaded by the tokenizers library: {e}. The file is corrupt or "
                         "not in the tokenizers format; re-download it or save the tokenizer again.") from e
    except BaseException as e:
        if type(e).__name__ != "PanicException":  # KeyboardInterrupt, SystemExit, ...: never swallowed
            raise
        raise ValueError(f"'{path}' is inconsistent: the tokenizers library failed on it ({e}). Re-download the "
                         "file or save the tokenizer again.") from e


def token_content(value: Any) -> Any:
    """The string of a special-token value, which checkpoints store as a string or {"content": ...}."""
    return value["content"] if isinstance(value, dict) else value


def added_token(entry: str | dict[str, Any]) -> tokenizers.AddedToken:
    """Builds a special AddedToken from a string or a transformers added-token dict."""
    if isinstance(entry, str):
        return tokenizers.AddedToken(entry, special=True)
    flags = {key: entry[key] for key in ("single_word", "lstrip", "rstrip", "normalized") if key in entry}
    return tokenizers.AddedToken(entry["content"], special=entry.get("special", True), **flags)


def _additional_special_tokens(settings: dict) -> list:
    """A settings file's additional special tokens: transformers 4 writes `additional_special_tokens`,
    transformers 5 `extra_special_tokens` (a list, or names -> tokens)."""
    extra = settings.get("extra_special_tokens") or ()
    return [*(settings.get("additional_special_tokens") or ()), *(extra.values() if isinstance(extra, dict) else extra)]


def merge_settings(hf_config: dict, special_map: dict, model_type: str | None, overrides: dict) -> dict:
    """Layers settings as transformers does: class defaults < tokenizer_config < special_tokens_map < arguments."""
    tokenizer_class = hf_config.get("tokenizer_class") or _MODEL_TYPE_CLASSES.get(model_type) or ""
    tokenizer_class = tokenizer_class.removesuffix("Fast")
    values = {**_CLASS_DEFAULTS.get(tokenizer_class, {}), **hf_config, "tokenizer_class": tokenizer_class}
    additional = []
    for token in _additional_special_tokens(values) + _additional_special_tokens(special_map):
        if token_content(token) not in {token_content(t) for t in additional}:
            additional.append(token)
    values.update(special_map, additional_special_tokens=additional)
    values.update(overrides)
    return values


def load_backend(folder: pathlib.Path, hf_config: dict[str, Any], bos_token: str | None) -> tokenizers.Tokenizer:
    """Reads tokenizer.json, or builds GPT-2's byte-level BPE tokenizer from vocab.json + merges.txt.

    Raises:
        OSError: If there are no tokenizer files; PermissionError for an unreadable one.
        ValueError: If a file is corrupt or inconsistent (naming it; also when the `tokenizers`
            library panics on it).
    """
    add_prefix_space = bool(hf_config.get("add_prefix_space", False))
    path = folder / "tokenizer.json"
    if path.is_file():
        open(path, "rb").close()  # an unreadable file is a PermissionError naming it
        backend = backend_call(path, tokenizers.Tokenizer.from_file, str(path))
        # transformers makes a pre-tokenizer that has this flag (ByteLevel; not Metaspace, whose
        # legacy flag is re-serialized as prepend_scheme) follow tokenizer_config.json, default False.
        state = json.loads(backend.to_str())
        if (state.get("pre_tokenizer") or {}).get("add_prefix_space", add_prefix_space) != add_prefix_space:
            state["pre_tokenizer"]["add_prefix_space"] = add_prefix_space
            backend = backend_call(path, tokenizers.Tokenizer.from_str, json.dumps(state))
        return backend
    vocab, merges = folder / "vocab.json", folder / "merges.txt"
    if not (vocab.is_file() and merges.is_file()):
        raise OSError(f"No tokenizer files in '{folder}': looked for tokenizer.json, or for vocab.json "
                      "together with merges.txt.")
    for file in (vocab, merges):
        open(file, "rb").close()
    model = backend_call(f"{vocab}' + '{merges}", models.BPE.from_file, str(vocab), str(merges))
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    backend.decoder = decoders.ByteLevel()
    if hf_config.get("add_bos_token") and bos_token is not None:  # OPT prepends its bos, "</s>".
        if backend.token_to_id(bos_token) is None:
            raise ValueError(f"'{vocab}' has no entry for the bos_token {bos_token!r} that tokenizer_config.json's "
                             "add_bos_token=true prepends.")
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos_token}:0 $A:0", pair=f"{bos_token}:0 $A:0 $B:1",
            special_tokens=[(bos_token, backend.token_to_id(bos_token))])
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return backend
