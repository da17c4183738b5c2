"""`RequestOptions`: the decoding options of one request to the serving engine, validated once.

The names follow `GenerationConfig` (and so transformers) where they exist; `stop` (strings matched on the
decoded text), `logprobs` and `deadline` are serving options. Validation happens at construction, so a
request that reaches the engine's queue is well formed; the engine itself checks what depends on the model
(token ids below the vocabulary size, a prompt that fits).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from xlagen.generation.config import checked_float, checked_int

_INT64_MAX = 2**63 - 1
MAX_TOP_LOGPROBS = 20  # as OpenAI's chat completions


def _bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def _sequence(name: str, value) -> tuple:
    """A list or tuple as a tuple; a single string or int would be ambiguous here, so it is a TypeError."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple, got {type(value).__name__} {value!r}")
    return tuple(value)


def seed_words(seed: int) -> list[int]:
    """A request's seed (an int in [0, 2**63 - 1]) as the two int32 words of the sampling hash: the low and the
    high 32 bits. The engine and the request batcher both use it, so a seed gives the same tokens through either."""
    low, high = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    return [word - (1 << 32) if word >= 1 << 31 else word for word in (low, high)]


@dataclass(frozen=True)
class RequestOptions:
    """How one request is decoded on the engine's slots.

    Attributes:
        max_new_tokens: Tokens to generate at most (>= 1), or None for as many as fit: the request ends
            with finish reason "length" when it reaches them. A prompt whose tokens plus `max_new_tokens`
            exceed what a request may use (the engine's `max_length`) is refused (`ContextTooLong`).
        do_sample: Sample from the processed distribution instead of taking the argmax (greedy).
        temperature: Divides the logits when sampling (> 0 when `do_sample`; ignored by greedy decoding).
        top_p: Nucleus sampling: keep the smallest set of tokens whose probability reaches this, in (0, 1].
        top_k: Keep only the `top_k` most likely tokens when sampling (0 = off).
        seed: Seed of the request's random stream (None: the engine draws one); the same seed and options
            give the same tokens whatever else the engine runs at the time.
        repetition_penalty: CTRL-style penalty of tokens already in the prompt or output (1.0 = off).
        stop_token_ids: Ids that end the request (finish reason "stop"), in addition to the model's EOS.
            The stop token is reported but its text is not added to the completion.
        stop: Strings that end the request when they appear in the decoded text (finish reason "stop");
            the text from the stop string on is left out of the output.
        logprobs: Report the log-probability of each generated token (after temperature, top-k and top-p,
            the distribution it was drawn from; log-softmax of the penalised logits for greedy decoding).
        top_logprobs: With `logprobs`, also report the `top_logprobs` most likely tokens of each step's
            distribution with their log-probabilities (0 to 20).
        num_beams: Beam search width; the slot engine decodes 1 beam only and refuses more (beam search
            runs on the request-level path, `CompiledGenerator`).
        deadline: Seconds the request may take from submission (None: no limit); a request still queued
            or running then ends with finish reason "deadline".

    Raises:
        TypeError: if an option has the wrong type (the message names it and its value).
        ValueError: if an option's value is out of range (the message names it and its value).
    """

    max_new_tokens: int | None = 16
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    num_beams: int = 1
    deadline: float | None = None

    def __post_init__(self):
        def set_(name, value):
            object.__setattr__(self, name, value)

        for name in ("max_new_tokens", "top_k", "top_logprobs", "num_beams"):
            if name != "max_new_tokens" or self.max_new_tokens is not None:
                set_(name, checked_int(name, getattr(self, name)))
        for name in ("temperature", "top_p", "repetition_penalty"):
            set_(name, checked_float(name, getattr(self, name)))
        for name in ("do_sample", "logprobs"):
            set_(name, _bool(name, getattr(self, name)))
        if self.seed is not None:
            set_("seed", checked_int("seed", self.seed))
        if self.deadline is not None:
            set_("deadline", checked_float("deadline", self.deadline))
        set_("stop_token_ids", tuple(checked_int("stop_token_ids", i) for i in _sequence("stop_token_ids",
                                                                                   self.stop_token_ids)))
        set_("stop", _sequence("stop", self.stop))
        for text in self.stop:
            if not isinstance(text, str):
                raise TypeError(f"stop must hold strings, got {type(text).__name__} {text!r}")
        self._check_ranges()

    def _check_ranges(self):
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.do_sample and not self.temperature > 0.0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed <= _INT64_MAX:
            raise ValueError(f"seed must be in [0, 2**63 - 1], got {self.seed}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for token_id in self.stop_token_ids:
            if token_id < 0:
                raise ValueError(f"stop_token_ids must hold ids >= 0, got {token_id}")
        for text in self.stop:
            if not text:
                raise ValueError("stop must not hold an empty string")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=True")
        if self.num_beams < 1:
            raise ValueError(f"num_beams must be >= 1, got {self.num_beams}")
        if self.deadline is not None and not self.deadline > 0.0:
            raise ValueError(f"deadline must be > 0 seconds, got {self.deadline}")

    @classmethod
    def field_names(cls) -> frozenset[str]:
        """The option names `from_kwargs` accepts."""
        return frozenset(field.name for field in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls, **options) -> "RequestOptions":
        """Builds validated options from keyword arguments.

        Args:
            **options: Any of the attributes; the others keep their defaults.

        Returns:
            The options.

        Raises:
            TypeError: if an option name is unknown or a value has the wrong type (the message names it).
            ValueError: if a value is out of range (the message names the option and the value).
        """
        unknown = sorted(set(options) - cls.field_names())
        if unknown:
            raise TypeError(f"unknown request option(s) {', '.join(map(repr, unknown))}; "
                            f"known: {', '.join(sorted(cls.field_names()))}")
        return cls(**options)

    def update(self, **changes) -> "RequestOptions":
        """Returns a copy with `changes` applied (validated again, unknown names refused)."""
        return type(self).from_kwargs(**{**dataclasses.asdict(self), **changes})
