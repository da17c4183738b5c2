"""Fast tokenizers with the transformers 4.x API, as a thin layer over the `tokenizers` library.

Reference: transformers' `PreTrainedTokenizerFast` / `GPT2TokenizerFast` (4.57). A checkpoint folder
is read from `tokenizer.json`, or else from GPT-2-style `vocab.json` + `merges.txt`, with the special
tokens and settings of `tokenizer_config.json` and `special_tokens_map.json`.

Known divergences from transformers:
  * Tensors (`return_tensors="np"` or `"tf"`) are int32; transformers gives int64 for "np".
  * Tensors of unequal lengths raise a ValueError for "np" too (transformers builds an object array).
  * Only `input_ids` and `attention_mask` are returned (never `token_type_ids`); text pairs and
    `return_tensors="pt"` are not supported.
  * Setting a special token missing from the vocabulary (`tok.pad_token = "<pad>"`) adds it, as
    `from_pretrained(pad_token=...)` does; transformers' setter does not (its id becomes unk's).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import tokenizers

from xlagen.text.tokenizer_files import (LARGE_LENGTH, SPECIAL_TOKEN_NAMES, TokenizerConfig, added_token, load_backend,
                                    merge_settings, read_json_or_empty, token_content)
from xlagen.weights.checkpoint import write_files

logger = logging.getLogger(__name__)

# Settings that a tokenizer class takes as from_pretrained keywords; stored in tokenizer_config.json.
_CLASS_KEYWORDS = {"WhisperTokenizer": ("language", "task", "predict_timestamps")}
_ALL_CLASS_KEYWORDS = frozenset(key for keys in _CLASS_KEYWORDS.values() for key in keys)
# transformers' `clean_up_tokenization` (decode, when the checkpoint asks for it).
_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
             (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class BatchEncoding(dict):
    """The output of a tokenizer call: a dict that also allows `enc.input_ids` (`model.generate(**enc)`)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _special_properties(name: str) -> tuple[property, property]:
    """The `<name>` attribute (settable; a new token is registered as special) and `<name>_id` (read-only)."""
    def get_id(self):
        token = getattr(self.config, name)
        return None if token is None else self.convert_tokens_to_ids(token)
    words = name.replace("_", " ")
    return (property(lambda self: getattr(self.config, name), lambda self, value: self._set_special(name, value),
                     doc=f"The {words} (None if there is none)."),
            property(get_id, doc=f"The id of the {words} (None if there is none)."))


class PreTrainedTokenizerFast:
    """A `tokenizers.Tokenizer` with transformers' fast-tokenizer API for generation.

    Args:
        backend: The tokenizer doing the work. Its own padding and truncation are switched off (this
            class does both) and the special tokens are registered on it.
        config: Special tokens and settings.
        added_tokens: Tokens to register first, in order (e.g. with the checkpoint's lstrip/rstrip).
    """

    def __init__(self, backend: tokenizers.Tokenizer, config: TokenizerConfig,
                 added_tokens: Sequence[tokenizers.AddedToken] = ()):
        self._backend = backend
        self._backend.no_padding()
        self._backend.no_truncation()
        self.config = config
        self._register(list(added_tokens) + self.all_special_tokens)

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike[str], *, padding_side: str | None = None,
                        pad_token: str | None = None, revision: str | None = None,
                        cache_dir: str | os.PathLike[str] | None = None, local_files_only: bool = False,
                        use_fast: bool = True, **special_token_overrides: Any) -> PreTrainedTokenizerFast:
        """Loads the tokenizer of a local folder or Hub repo.

        Args:
            name_or_path: A local folder, or a Hub repo id such as "gpt2".
            padding_side: "left" (for batched generation) or "right"; default: the checkpoint's.
            pad_token: Padding token, e.g. "</s>"; if missing from the vocabulary it is added as a
                special token with the next free id (so its id is >= `vocab_size`).
            revision: Branch, tag or commit of a Hub repo.
            cache_dir: Hugging Face cache folder.
            local_files_only: Never touch the network.
            use_fast: Accepted for transformers compatibility; only the fast (`tokenizers`) path exists,
                so `use_fast=False` raises.
            **special_token_overrides: Any of `bos_token`, `eos_token`, `unk_token`, `sep_token`,
                `cls_token`, `mask_token`, `additional_special_tokens`; for a Whisper tokenizer also
                `language`, `task` and `predict_timestamps` (see `xlagen.text.whisper_tokens`).

        Returns:
            A `PreTrainedTokenizerFast`; a `WhisperTokenizerFast` when the checkpoint's tokenizer
            class is WhisperTokenizer.

        Raises:
            OSError: If the folder cannot be resolved or holds no tokenizer files; PermissionError
                for an unreadable file.
            TypeError: If an unknown keyword argument is given.
            ValueError: If `padding_side` is invalid, the checkpoint needs something unsupported, or
                a tokenizer file is corrupt or holds a setting of the wrong type (the message names
                the file, and the key).
        """
        from xlagen.hub import resolve_model_dir  # Lazy: it imports huggingface_hub.

        if not use_fast:
            raise ValueError("xlagen only has fast tokenizers (the `tokenizers` library): drop use_fast=False")
        unknown = set(special_token_overrides) - {*SPECIAL_TOKEN_NAMES, "additional_special_tokens",
                                                  *_ALL_CLASS_KEYWORDS}
        if unknown:
            raise TypeError(f"Unexpected keyword arguments {sorted(unknown)}; the special tokens accepted are "
                            f"{[*SPECIAL_TOKEN_NAMES, 'additional_special_tokens']}.")
        folder = resolve_model_dir(name_or_path, revision=revision, cache_dir=cache_dir,
                                   local_files_only=local_files_only)
        hf_config = read_json_or_empty(folder / "tokenizer_config.json")
        overrides = dict(special_token_overrides, pad_token=pad_token, padding_side=padding_side)
        values = merge_settings(hf_config, read_json_or_empty(folder / "special_tokens_map.json"),
                                read_json_or_empty(folder / "config.json").get("model_type"),
                                {key: value for key, value in overrides.items() if value is not None})
        template_file = folder / "chat_template.jinja"  # transformers 5 saves the chat template there
        if not values.get("chat_template") and template_file.is_file():
            values["chat_template"] = template_file.read_text(encoding="utf-8")
        given = {key for key, value in special_token_overrides.items() if value is not None}
        misplaced = given & _ALL_CLASS_KEYWORDS - set(_CLASS_KEYWORDS.get(values["tokenizer_class"], ()))
        if misplaced:
            raise TypeError(f"Unexpected keyword arguments {sorted(misplaced)} for a {values['tokenizer_class']} "
                            "tokenizer.")
        backend = load_backend(folder, hf_config, token_content(values.get("bos_token")))
        decoder = sorted(hf_config.get("added_tokens_decoder", {}).items(), key=lambda item: int(item[0]))
        tokens = [values.get(name) for name in SPECIAL_TOKEN_NAMES] + values["additional_special_tokens"]
        try:
            added = [added_token(entry) for _, entry in decoder]
            added += [added_token(token) for token in tokens if isinstance(token, dict)]
        except TypeError as e:  # a flag such as "lstrip" that is not a boolean
            raise ValueError(f"An added token of '{folder / 'tokenizer_config.json'}' or "
                             f"'{folder / 'special_tokens_map.json'}' is malformed: {e}") from e
        return cls._class_for(values["tokenizer_class"])(backend, TokenizerConfig.from_hf_config(values), added)

    @classmethod
    def _class_for(cls, tokenizer_class: str) -> type:
        """The class `from_pretrained` builds for a checkpoint whose tokenizer class is `tokenizer_class`: this
        one (`xlagen.text.auto_tokenizer.AutoTokenizer` picks by the name)."""
        return cls

    bos_token, bos_token_id = _special_properties("bos_token")
    eos_token, eos_token_id = _special_properties("eos_token")
    unk_token, unk_token_id = _special_properties("unk_token")
    sep_token, sep_token_id = _special_properties("sep_token")
    pad_token, pad_token_id = _special_properties("pad_token")
    cls_token, cls_token_id = _special_properties("cls_token")
    mask_token, mask_token_id = _special_properties("mask_token")

    @property
    def padding_side(self) -> str:
        """Where padding goes: "left" or "right" (settable)."""
        return self.config.padding_side

    @padding_side.setter
    def padding_side(self, value: str) -> None:
        self.config = dataclasses.replace(self.config, padding_side=value)

    @property
    def model_max_length(self) -> int:
        """Longest input the model accepts; 1e30 when the checkpoint sets no limit."""
        return self.config.model_max_length

    @property
    def vocab_size(self) -> int:
        """Size of the base vocabulary, without added tokens (as in transformers)."""
        return self._backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        """Size of the full vocabulary, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_tokens(self) -> list[str]:
        """The special tokens without repeats: bos, eos, unk, sep, pad, cls, mask, then the additional ones."""
        tokens = [getattr(self.config, name) for name in SPECIAL_TOKEN_NAMES]
        tokens += self.config.additional_special_tokens
        return list(dict.fromkeys(token for token in tokens if token is not None))

    @property
    def all_special_ids(self) -> list[int]:
        """The ids of `all_special_tokens`."""
        return self.convert_tokens_to_ids(self.all_special_tokens)

    @property
    def chat_template(self) -> str | None:
        """The checkpoint's Jinja chat template (its "default" one when it names several), or None."""
        template = self.config.passthrough.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                            None)
        return template if isinstance(template, str) and template else None

    def apply_chat_template(self, conversation: Sequence[dict], *, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = True,
                            chat_template: str | None = None, **variables: Any):
        """Renders a conversation with the chat template (transformers' `apply_chat_template`, see
        `xlagen.text.chat_template`; needs jinja2).

        Args:
            conversation: `{"role": ..., "content": ...}` messages.
            add_generation_prompt: End with the start of an assistant turn.
            continue_final_message: End inside the last message, an assistant one, without the tokens that
                close its turn, so that the model continues it (not with `add_generation_prompt`).
            tokenize: Return ids (encoded without adding special tokens) instead of the text.
            chat_template: A template to use instead of the checkpoint's.
            **variables: Further template variables.

        Returns:
            The ids (a list of ints), or the text with `tokenize=False`.

        Raises:
            ValueError: If there is no chat template, or it fails on the conversation; with
                `continue_final_message`, if `add_generation_prompt` is set too or the last message is not an
                assistant one.
        """
        from xlagen.text.chat_template import render

        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json 'chat_template' or "
                             "chat_template.jinja): pass chat_template=")
        special = {name: getattr(self.config, name) for name in SPECIAL_TOKEN_NAMES}
        text = render(template, conversation, add_generation_prompt=add_generation_prompt,
                      continue_final_message=continue_final_message, special_tokens=special,
                      additional_special_tokens=list(self.config.additional_special_tokens), **variables)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def get_vocab(self) -> dict[str, int]:
        """Returns the token -> id mapping, added tokens included."""
        return self._backend.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> int | None | list[int | None]:
        """Maps a token (or a list of tokens) to ids; unknown tokens map to `unk_token_id`."""
        if isinstance(tokens, str):
            token_id = self._backend.token_to_id(tokens)
            if token_id is None and self.config.unk_token is not None:
                return self._backend.token_to_id(self.config.unk_token)
            return token_id
        return [self.convert_tokens_to_ids(token) for token in tokens]

    def convert_ids_to_tokens(self, ids: int | Iterable[int],
                              skip_special_tokens: bool = False) -> str | None | list[str | None]:
        """Maps an id (or a sequence of ids) to tokens, optionally dropping special tokens from a sequence."""
        if isinstance(ids, (int, np.integer)):
            return self._backend.id_to_token(int(ids))
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(i) for i in _to_id_list(ids) if i not in skip]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Returns the ids of one text, without padding or truncation."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str | Sequence[str], *, padding: bool | str = False,
                 truncation: bool | str | None = None, max_length: int | None = None,
                 pad_to_multiple_of: int | None = None, return_tensors: str | None = None,
                 return_attention_mask: bool = True, add_special_tokens: bool = True) -> BatchEncoding:
        """Tokenizes one text or a batch (the keyword arguments are transformers').

        Args:
            text: A string, or a list of strings (a batch).
            padding: True or "longest" pads to the longest sequence of the batch, "max_length" to
                `max_length` (or `model_max_length`); False or "do_not_pad" does not pad.
            truncation: True, "longest_first" or "only_first" cuts sequences (special tokens
                included) to `max_length` or `model_max_length`. None (the default) truncates only
                when `max_length` is given and `padding` is False, as in transformers.
            max_length: Length to pad and/or truncate to.
            pad_to_multiple_of: Round the padded length up to a multiple of this.
            return_tensors: None for Python lists, "np" for numpy arrays, "tf" for `tf.Tensor`s.
            return_attention_mask: Whether to return `attention_mask` (1 for tokens, 0 for padding).
            add_special_tokens: Whether to add the checkpoint's special tokens (e.g. OPT's bos).

        Returns:
            A `BatchEncoding` with `input_ids` and `attention_mask`: a list of ints for a single
            string, a list of lists for a batch, or int32 tensors [B, T] ([1, T] for a string).

        Raises:
            ValueError: On padding without a pad token, tensors of unequal lengths, or bad values.
            TypeError: If `text` is not a string or a list of strings.
        """
        if return_tensors not in (None, "np", "tf"):
            raise ValueError(f"return_tensors must be None, 'np' or 'tf', got {return_tensors!r}.")
        texts = [text] if isinstance(text, str) else list(text)
        if not all(isinstance(t, str) for t in texts):
            raise TypeError("text must be a string or a list of strings (text pairs are not supported).")
        pad_mode, truncate, max_length = self._strategies(padding, truncation, max_length, pad_to_multiple_of)
        rows = self._encode_batch(texts, add_special_tokens, max_length if truncate else None)
        masks = [[1] * len(row) for row in rows]
        if pad_mode is not None:
            target = max(map(len, rows), default=0) if pad_mode == "longest" else max_length
            if pad_to_multiple_of:
                target = -(-target // pad_to_multiple_of) * pad_to_multiple_of
            left = self.config.padding_side == "left"
            rows = [_pad(row, target, self.pad_token_id, left) for row in rows]
            masks = [_pad(mask, target, 0, left) for mask in masks]
        outputs = {"input_ids": rows, "attention_mask": masks} if return_attention_mask else {"input_ids": rows}
        return BatchEncoding({key: _format(value, return_tensors, unbatched=isinstance(text, str))
                              for key, value in outputs.items()})

    def decode(self, token_ids: Any, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        """Turns one sequence of ids back into text.

        Args:
            token_ids: An int, a list, a numpy array or a `tf.Tensor` of shape [T].
            skip_special_tokens: Drop special tokens (padding, eos, ...) from the text.
            clean_up_tokenization_spaces: Remove spaces before punctuation; defaults to the checkpoint's.

        Returns:
            The text.
        """
        return self.batch_decode([token_ids], skip_special_tokens, clean_up_tokenization_spaces)[0]

    def batch_decode(self, sequences: Any, skip_special_tokens: bool = False,
                     clean_up_tokenization_spaces: bool | None = None) -> list[str]:
        """Turns a batch of sequences ([B, T] array or tensor, or a list of lists) into texts; see `decode`."""
        if hasattr(sequences, "numpy"):
            sequences = sequences.numpy()
        texts = self._backend.decode_batch([_to_id_list(sequence) for sequence in sequences],
                                           skip_special_tokens=skip_special_tokens)
        if clean_up_tokenization_spaces is None:
            clean_up_tokenization_spaces = self.config.clean_up_tokenization_spaces
        for before, after in _CLEANUPS if clean_up_tokenization_spaces else ():
            texts = [text.replace(before, after) for text in texts]
        return texts

    def save_pretrained(self, save_directory: str | os.PathLike[str], overwrite: bool = False) -> tuple[str, ...]:
        """Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json (transformers' format).

        Args:
            save_directory: Folder to write to; created if needed. It may hold the model's files.
            overwrite: Replace existing tokenizer files.

        Returns:
            The paths of the written files.

        Raises:
            FileExistsError: if tokenizer files exist and `overwrite` is False (nothing is written).
            OSError: if the files cannot be written (a full disk, no permission), naming the folder; the
                folder keeps its previous files (all-or-nothing, as `xlagen.weights.atomic_save` writes).
        """
        special = {name: getattr(self.config, name) for name in SPECIAL_TOKEN_NAMES
                   if getattr(self.config, name) is not None}
        if self.config.additional_special_tokens:
            special["additional_special_tokens"] = list(self.config.additional_special_tokens)
        settings = {name: getattr(self.config, name) for name in (
            "padding_side", "truncation_side", "model_max_length", "clean_up_tokenization_spaces", "tokenizer_class")}
        def json_writer(content):
            return lambda path: path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n",
                                                encoding="utf-8")

        return write_files(save_directory, {
            "tokenizer.json": lambda path: self._backend.save(str(path)),
            "tokenizer_config.json": json_writer({**self.config.passthrough, **special, **settings}),
            "special_tokens_map.json": json_writer(special)}, overwrite)

    def _set_special(self, name: str, value: str | None) -> None:
        """Sets a special token, adding it to the backend if it is new."""
        self.config = dataclasses.replace(self.config, **{name: token_content(value)})
        self._register([getattr(self.config, name)] if value is not None else [])

    def _register(self, tokens: Iterable[str | tokenizers.AddedToken]) -> None:
        """Adds tokens that are not added tokens of the backend yet as special tokens (new ones get the next ids)."""
        known = {token.content for token in self._backend.get_added_tokens_decoder().values()}
        for token in tokens:
            token = tokenizers.AddedToken(token, special=True) if isinstance(token, str) else token
            if token.content not in known:
                self._backend.add_special_tokens([token])
                known.add(token.content)

    def _strategies(self, padding, truncation, max_length, pad_to_multiple_of):
        """Resolves `__call__` arguments as transformers does: (pad mode or None, truncate?, max_length)."""
        if padding not in (False, None, True, "do_not_pad", "longest", "max_length"):
            raise ValueError(f"padding must be True, False, 'longest', 'max_length' or 'do_not_pad', got {padding!r}.")
        if truncation not in (None, False, True, "do_not_truncate", "longest_first", "only_first"):
            raise ValueError(f"truncation must be True, False or 'longest_first', got {truncation!r}.")
        if max_length is not None and padding is False and truncation is None:
            logger.warning("max_length is given without truncation=True: truncating, as transformers does.")
            truncation = True
        pad_mode = {True: "longest", "longest": "longest", "max_length": "max_length"}.get(padding)
        truncate = truncation in (True, "longest_first", "only_first")
        if max_length is None and (pad_mode == "max_length" or truncate):
            if self.config.model_max_length > LARGE_LENGTH:
                logger.warning("No max_length given and the checkpoint sets no model_max_length: "
                               "not padding to a maximum length and not truncating.")
                pad_mode, truncate = (None if pad_mode == "max_length" else pad_mode), False
            else:
                max_length = self.config.model_max_length
        if pad_mode is not None and self.pad_token is None:
            raise ValueError("Asking to pad, but the tokenizer has no pad token. Load it with "
                             "AutoTokenizer.from_pretrained(..., pad_token=...) (e.g. pad_token=\"</s>\"), "
                             "or set tokenizer.pad_token = tokenizer.eos_token.")
        if truncate and pad_mode and pad_to_multiple_of and max_length % pad_to_multiple_of:
            raise ValueError(f"Truncation and padding are both on, but the truncation length ({max_length}) "
                             f"is not a multiple of pad_to_multiple_of ({pad_to_multiple_of}).")
        return pad_mode, truncate, max_length

    def _encode_batch(self, texts: list[str], add_special_tokens: bool, length: int | None) -> list[list[int]]:
        """Encodes texts, each cut to `length` ids special tokens included (on the truncation side)."""
        if length is None:
            return [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=add_special_tokens)]
        budget = length - (self._backend.num_special_tokens_to_add(False) if add_special_tokens else 0)
        if budget < 0:
            raise ValueError(f"max_length={length} leaves no room for the special tokens.")
        encodings = self._backend.encode_batch(texts, add_special_tokens=False)
        for encoding in encodings:
            encoding.truncate(budget, direction=self.config.truncation_side)
        return [self._backend.post_process(e, None, add_special_tokens).ids for e in encodings]


GPT2TokenizerFast = PreTrainedTokenizerFast


def _pad(row: list[int], length: int, value: int, left: bool) -> list[int]:
    """Pads `row` with `value` up to `length` on the left or the right."""
    padding = [value] * max(length - len(row), 0)
    return padding + row if left else row + padding


def _to_id_list(token_ids: Any) -> list[int]:
    """Converts one id sequence (int, list, numpy array, tf.Tensor) to a list of Python ints."""
    if hasattr(token_ids, "numpy"):
        token_ids = token_ids.numpy()
    array = np.asarray(token_ids)
    if array.size == 0:
        return []
    if array.ndim > 1 or not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"Expected one sequence of integer ids, got shape {array.shape} and dtype {array.dtype}.")
    return array.reshape(-1).tolist()


def _format(rows: list[list[int]], return_tensors: str | None, unbatched: bool) -> Any:
    """Packs rows as lists (one list for a single string) or as an int32 [B, T] tensor."""
    if return_tensors is None:
        return rows[0] if unbatched else rows
    if len({len(row) for row in rows}) > 1:
        raise ValueError("Unable to create tensors from sequences of different lengths; pass padding=True "
                         "(and/or truncation=True) to make them the same length.")
    array = np.array(rows, dtype=np.int32).reshape(len(rows), len(rows[0]) if rows else 0)
    if return_tensors == "np":
        return array
    import tensorflow as tf  # Lazy: this module must stay importable (and testable) without TensorFlow.

    return tf.constant(array)
