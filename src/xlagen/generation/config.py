"""`GenerationConfig`: how to decode, separate from the model's architecture.

Defaults are transformers 4.x's, so `max_length=20` counts the (padded) prompt as transformers 4.x does.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
from dataclasses import dataclass
from pathlib import Path

from xlagen.weights.checkpoint import read_json


_OPTIONAL_INTS = ("pad_token_id", "bos_token_id", "decoder_start_token_id", "no_timestamps_token_id",
              "max_initial_timestamp_index")
_INT_FIELDS = ("max_length", "max_new_tokens", "min_length", "min_new_tokens", "top_k", "num_beams",
               "num_return_sequences", "no_repeat_ngram_size", *_OPTIONAL_INTS)
_FLOAT_FIELDS = ("temperature", "top_p", "length_penalty", "repetition_penalty", "max_memory_gb")
_OPTIONAL = ("max_new_tokens", "min_new_tokens", "max_memory_gb", *_OPTIONAL_INTS)
_ID_LISTS = ("suppress_tokens", "begin_suppress_tokens")


def checked_int(name: str, value) -> int:
    """`value` as an int (numpy integers too); a bool, float, string or None is a TypeError naming `name`."""
    if isinstance(value, (bool, float, str)) or value is None:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    try:
        return operator.index(value)
    except TypeError as error:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from error


def checked_float(name: str, value) -> float:
    """`value` as a finite float; a bool, string or None is a TypeError, inf / nan a ValueError naming `name`."""
    if isinstance(value, (bool, str)) or value is None:
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}") from error
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {number}")
    return number


def _token_ids(name: str, value, allow_single: bool = False):
    """`value`, a list or tuple of token ids (or with `allow_single` one id), with Python ints for ids; anything
    else is a TypeError naming `name`."""
    many = isinstance(value, (list, tuple))
    try:
        if not (many or allow_single):
            raise TypeError(name)
        ids = [checked_int(name, i) for i in (value if many else [value])]
    except TypeError:
        expected = "a token id (an int) or a list of them" if allow_single else "a list of token ids (ints)"
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}") from None
    return type(value)(ids) if many else ids[0]


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding options with transformers 4.x names and defaults.

    Attributes:
        max_length: Total length (prompt + new tokens); ignored when `max_new_tokens` is set.
        max_new_tokens: Number of tokens to generate.
        min_length: EOS is suppressed until the sequence (prompt included) is this long.
        min_new_tokens: EOS is suppressed until this many tokens were generated.
        do_sample: Sample instead of greedy / beam search.
        temperature, top_k, top_p: Sampling warpers (top_k=0 disables top-k).
        num_beams: Beams for beam search (1 = greedy or sampling).
        num_return_sequences: Sequences returned per prompt.
        length_penalty: Exponent of the length normalisation of beam scores.
        early_stopping: Beam search stopping: False (heuristic), True, or "never".
        eos_token_id: An id or a list of ids that end a sequence.
        pad_token_id: Filler after EOS (defaults to the first EOS id).
        bos_token_id: Beginning-of-sequence id (informational for decoder-only models).
        decoder_start_token_id: First decoder token of encoder-decoder models.
        repetition_penalty: CTRL-style penalty of already present tokens (1.0 = off).
        no_repeat_ngram_size: Forbid repeating any n-gram of this size (0 = off).
        output_scores: Return the processed scores of every step.
        output_logprobs: xlagen's own: return each new token's log-probability and the log-probabilities after
            the prompt's first token (`GenerateOutput.logprobs`, `first_logprobs`), without keeping the
            `[B, N, V]` scores.
        return_dict_in_generate: Return a `GenerateOutput` rather than the token tensor.
        suppress_tokens: Ids that are never generated.
        begin_suppress_tokens: Ids that are not generated as the first new token.
        max_memory_gb: `generate` refuses a call whose estimated memory exceeds this many GB (None: the
            machine's physical memory); not a decoding option, never part of a compiled program.

    Speech recognition (Whisper; the keys of its generation_config.json):
        language: Language of the audio (a code "fr", a name "french" or a token "<|fr|>"), or one per
            row; None detects it (multilingual models).
        task: "transcribe" or "translate" (to English).
        return_timestamps: Predict timestamp tokens (and leave <|notimestamps|> out of the prompt).
        lang_to_id, task_to_id: Token -> id of the language tokens, task name -> id.
        no_timestamps_token_id: Id of <|notimestamps|>; the timestamp tokens follow it.
        is_multilingual: Whether the model takes a language and a task.
        max_initial_timestamp_index: The first timestamp is at most this many steps (0.02 s) in.
        forced_decoder_ids: Legacy `[[position, id], ...]` decoder prompt after the start token, used
            when neither language nor task is given (a None id means: detect the language).
    """

    max_length: int = 20
    max_new_tokens: int | None = None
    min_length: int = 0
    min_new_tokens: int | None = None
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    num_beams: int = 1
    num_return_sequences: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    decoder_start_token_id: int | None = None
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    output_scores: bool = False
    output_logprobs: bool = False
    return_dict_in_generate: bool = False
    suppress_tokens: tuple[int, ...] | None = None
    begin_suppress_tokens: tuple[int, ...] | None = None
    language: str | tuple[str, ...] | None = None
    task: str | None = None
    return_timestamps: bool = False
    lang_to_id: dict | None = dataclasses.field(default=None, hash=False)
    task_to_id: dict | None = dataclasses.field(default=None, hash=False)
    no_timestamps_token_id: int | None = None
    is_multilingual: bool | None = None
    max_initial_timestamp_index: int | None = None
    forced_decoder_ids: tuple | None = None
    max_memory_gb: float | None = None

    def __post_init__(self):
        self._check_types()
        for name in _ID_LISTS:  # lists from JSON -> hashable tuples
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(_token_ids(name, value)))
        if isinstance(self.language, list):
            object.__setattr__(self, "language", tuple(self.language))
        if self.forced_decoder_ids is not None:
            object.__setattr__(self, "forced_decoder_ids", tuple(tuple(pair) for pair in self.forced_decoder_ids))
        if self.task is not None and self.task not in ("transcribe", "translate"):
            raise ValueError(f"task must be 'transcribe' or 'translate', got {self.task!r}")
        self._check_decoding()

    def _check_types(self):
        """Sizes must be ints and numeric options finite numbers (numpy scalars are converted)."""
        for names, convert in ((_INT_FIELDS, checked_int), (_FLOAT_FIELDS, checked_float)):
            for name in names:
                value = getattr(self, name)
                if value is None and name in _OPTIONAL:
                    continue
                object.__setattr__(self, name, convert(name, value))
        if self.eos_token_id is not None:  # an id, or a list of ids (any of them ends a row)
            object.__setattr__(self, "eos_token_id", _token_ids("eos_token_id", self.eos_token_id, allow_single=True))
        if self.max_memory_gb is not None and self.max_memory_gb <= 0:
            raise ValueError(f"max_memory_gb must be > 0, got {self.max_memory_gb}")

    def _check_decoding(self):
        if self.num_beams < 1:
            raise ValueError(f"num_beams must be >= 1, got {self.num_beams}")
        if self.num_return_sequences < 1:
            raise ValueError(f"num_return_sequences must be >= 1, got {self.num_return_sequences}")
        if self.num_beams == 1 and not self.do_sample and self.num_return_sequences > 1:
            raise ValueError("greedy decoding returns one sequence per prompt: use num_beams >= "
                             f"num_return_sequences ({self.num_return_sequences}) or do_sample=True")
        if self.num_beams > 1 and self.num_return_sequences > self.num_beams:
            raise ValueError(f"num_return_sequences ({self.num_return_sequences}) must be <= num_beams "
                             f"({self.num_beams}) in beam search")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.do_sample and not self.temperature > 0.0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.no_repeat_ngram_size < 0:
            raise ValueError(f"no_repeat_ngram_size must be >= 0, got {self.no_repeat_ngram_size}")
        if self.max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {self.max_length}")
        for name in ("min_length", "min_new_tokens"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if self.num_beams > 1 and self.do_sample:
            raise ValueError("beam sampling (num_beams > 1 with do_sample=True) is not supported; "
                             "use num_beams=1 to sample or do_sample=False for beam search")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The EOS ids as a tuple (empty when there is none)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(int(i) for i in self.eos_token_id)

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, values: dict) -> "GenerationConfig":
        """Builds a config from a dict, ignoring keys xlagen does not use (e.g. `transformers_version`) and
        nulls of options that have a default (transformers' "unset")."""
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items()
                      if k in defaults and not (v is None and defaults[k] not in (None, dataclasses.MISSING))})

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "GenerationConfig":
        """Reads `generation_config.json` from a local folder.

        Raises:
            OSError: if the file is missing or unreadable.
            ValueError: if it is malformed or holds an invalid value (the message names the file).
        """
        values = read_json(folder, "generation_config.json")
        try:
            return cls.from_dict(values)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{Path(folder, 'generation_config.json')}: {error}") from error

    @classmethod
    def from_model_config(cls, model_config) -> "GenerationConfig":
        """The special ids of a model config as a generation config (transformers' fallback)."""
        return cls(eos_token_id=model_config.eos_token_id, pad_token_id=model_config.pad_token_id,
                   bos_token_id=model_config.bos_token_id,
                   decoder_start_token_id=getattr(model_config, "decoder_start_token_id", None))

    def new_tokens(self, prompt_length: int, max_positions: int | None = None) -> int:
        """The number of new tokens after a (decoder) prompt of `prompt_length` tokens, padding included.

        Args:
            prompt_length: The prompt's length.
            max_positions: The model's positions (None: no learned positions, no limit).

        Raises:
            ValueError: If `max_length` leaves no room after the prompt, or the prompt and the new tokens
                exceed `max_positions`.
        """
        new_tokens = self.max_new_tokens
        if new_tokens is None:
            new_tokens = self.max_length - prompt_length
            if new_tokens < 1:
                raise ValueError(f"the prompt has {prompt_length} tokens (with padding) but max_length is "
                                 f"{self.max_length}: raise max_length or set max_new_tokens")
        if max_positions is not None and prompt_length + new_tokens > max_positions:
            raise ValueError(f"prompt length {prompt_length} + {new_tokens} new tokens exceeds the model's "
                             f"{max_positions} positions: shorten the prompt or lower max_new_tokens/max_length")
        return new_tokens

    def update(self, **changes) -> "GenerationConfig":
        """Returns a copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save_pretrained(self, folder: str | Path, file_name: str = "generation_config.json") -> None:
        """Writes `generation_config.json` (values that differ from the defaults, and the special ids)."""
        defaults = GenerationConfig().to_dict()
        special = {"bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"}
        values = {k: v for k, v in self.to_dict().items() if v != defaults[k] or (k in special and v is not None)}
        values = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
        Path(folder, file_name).write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
