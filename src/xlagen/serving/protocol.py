"""The OpenAI API's request fields, checked, and its response shapes (completions, chat completions).

Every field is validated here; a bad one raises `RequestError` naming it, which the server turns into a 400
with OpenAI's error JSON (`{"error": {"message", "type", "param", "code"}}`). Fields OpenAI defines that
xlagen does not implement are refused when set to anything but their neutral value (e.g. a non-zero
`presence_penalty`), never silently ignored. Extensions (as vLLM names them): `top_k`,
`repetition_penalty`, `num_beams`, `stop_token_ids`.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from typing import Any

from xlagen.serving.options import MAX_TOP_LOGPROBS
from xlagen.serving.text import IncrementalDecoder

_SEED_LIMIT = 2**63 - 1


class RequestError(ValueError):
    """A request the server refuses: HTTP `status` with OpenAI's error body, `param` naming the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 error_type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.error_type, self.code = param, status, error_type, code

    def body(self) -> dict:
        """OpenAI's error JSON."""
        return {"error": {"message": str(self), "type": self.error_type, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Sampling:
    """The decoding fields shared by both routes, checked; `options()` gives the engine's options."""

    max_tokens: int | None  # None: as many as fit the context
    temperature: float
    top_p: float
    top_k: int
    n: int
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    repetition_penalty: float
    num_beams: int
    logprobs: bool
    top_logprobs: int  # alternatives reported per token (0..20), with logprobs
    stream: bool
    include_usage: bool
    max_tokens_name: str = "max_tokens"

    def options(self, choice: int, deadline: float | None) -> dict:
        """`RequestOptions` keywords of choice `choice` (of `n`): sampled choices get seeds seed, seed+1, ..."""
        sample = self.temperature > 0 and self.num_beams == 1
        options = dict(max_new_tokens=self.max_tokens, do_sample=sample, top_p=self.top_p, top_k=self.top_k,
                       repetition_penalty=self.repetition_penalty, stop=self.stop,
                       stop_token_ids=self.stop_token_ids, logprobs=self.logprobs, top_logprobs=self.top_logprobs,
                       num_beams=self.num_beams, deadline=deadline)
        if sample:
            options["temperature"] = self.temperature
            if self.seed is not None:
                options["seed"] = (self.seed + choice) % (_SEED_LIMIT + 1)
        return options


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{name} must be a number, got {value!r}", name)
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise RequestError(f"{name} must be in {bracket}{low}, {high}], got {value}", name)
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {value!r}", name)
    if not low <= value <= high:
        raise RequestError(f"{name} must be in [{low}, {high}], got {value}", name)
    return value


def _boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}", name)
    return value


def _neutral(body: dict, name: str, neutral: tuple) -> None:
    """Refuses a field xlagen does not implement unless it has a neutral value."""
    if name in body and body[name] not in neutral:
        raise RequestError(f"{name} is not supported by this server (got {body[name]!r})", name)


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise RequestError(f"stop must be a non-empty string or a list of at most 4 of them, got {value!r}", "stop")
    return tuple(stops)


def _stop_token_ids(body: dict, vocab_size: int) -> tuple[int, ...]:
    value = body.get("stop_token_ids")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size
                                              for i in value):
        raise RequestError(f"stop_token_ids must be a list of token ids in [0, {vocab_size}), got {value!r}",
                           "stop_token_ids")
    return tuple(value)


COMMON_FIELDS = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop",
                           "stop_token_ids", "repetition_penalty", "num_beams", "stream", "stream_options",
                           "presence_penalty", "frequency_penalty", "logit_bias", "user", "logprobs"})


def check_fields(body: Any, allowed: frozenset[str]) -> dict:
    """The body as a dict; unknown fields are refused, naming them."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise RequestError(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0])
    return body


def _beam_conflicts(body: dict) -> None:
    """Refuses the sampling fields with beam search, which does not sample: never ignored silently."""
    for name, neutral in (("temperature", (None, 0, 0.0)), ("top_p", (None, 1, 1.0)), ("top_k", (None, 0, -1)),
                          ("seed", (None,))):
        if body.get(name) not in neutral:
            raise RequestError(f"{name} does not apply to beam search (num_beams > 1 does not sample): leave it out"
                               + (" or set it to 0" if name == "temperature" else ""), name)


def parse_sampling(body: dict, *, max_n: int, vocab_size: int, logprobs: bool, top_logprobs: int = 0,
                   max_tokens_name: str = "max_tokens", default_max_tokens: int | None = 16) -> Sampling:
    """The decoding fields of a completions or chat body, checked (`default_max_tokens` None: as many new
    tokens as fit the model's context, as OpenAI's chat completions do; `top_logprobs`: alternatives per
    token, with `logprobs`).

    Raises:
        RequestError: naming the first bad field.
    """
    for name in ("presence_penalty", "frequency_penalty"):
        _neutral(body, name, (None, 0, 0.0))
    _neutral(body, "logit_bias", (None, {}))
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise RequestError(f"user must be a string, got {body['user']!r}", "user")
    stream = _boolean(body, "stream", False)
    stream_options = body.get("stream_options")
    if stream_options is not None and (not stream or not isinstance(stream_options, dict)
                                       or set(stream_options) - {"include_usage"}):
        raise RequestError("stream_options must be an object {\"include_usage\": bool}, with stream: true",
                           "stream_options")
    include_usage = _boolean(stream_options or {}, "include_usage", False)
    num_beams = _integer(body, "num_beams", 1, 1, 64)
    n = _integer(body, "n", 1, 1, max_n)
    if num_beams > 1 and n > 1:
        raise RequestError("n > 1 cannot be combined with num_beams > 1: beam search returns its best beam", "n")
    if num_beams > 1 and logprobs:
        raise RequestError("logprobs cannot be combined with num_beams > 1", "logprobs")
    if num_beams > 1:
        _beam_conflicts(body)
    top_k = _integer(body, "top_k", 0, -1, vocab_size)
    return Sampling(
        max_tokens=_integer(body, max_tokens_name, default_max_tokens, 1, 1 << 20),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=max(top_k, 0), n=n, seed=_integer(body, "seed", None, 0, _SEED_LIMIT),
        stop=_stop(body), stop_token_ids=_stop_token_ids(body, vocab_size),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, 100.0, low_open=True),
        num_beams=num_beams, logprobs=logprobs, top_logprobs=top_logprobs, stream=stream,
        include_usage=include_usage, max_tokens_name=max_tokens_name)


def parse_prompts(body: dict, vocab_size: int) -> list[str | list[int]]:
    """The completions `prompt`: a string, a list of strings, a list of ids, or a list of lists of ids."""
    value = body.get("prompt")

    def ids(item) -> bool:
        return isinstance(item, list) and bool(item) and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in item)

    if isinstance(value, str) and value:
        return [value]
    if ids(value):
        return [value]
    if isinstance(value, list) and value and all((isinstance(v, str) and v) or ids(v) for v in value):
        return list(value)
    raise RequestError("prompt must be a non-empty string, a list of them, a list of token ids in "
                       f"[0, {vocab_size}) or a list of such lists", "prompt")


_ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_messages(messages) -> list[dict]:
    """Chat messages as the template expects them: role and text content (text parts joined); OpenAI's
    `developer` role, which chat templates do not know, as `system`."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects", "messages")
    checked = []
    for number, message in enumerate(messages):
        where = f"messages[{number}]"
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise RequestError(f"{where} must be an object with a role in {list(_ROLES)}", where)
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(f"{where}.content: only text parts are supported", f"{where}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(f"{where}.content must be a string or a list of text parts", f"{where}.content")
        unknown = set(message) - {"role", "content", "name"}
        if unknown:
            raise RequestError(f"{where} has unsupported field(s) {sorted(unknown)}", where)
        role = "system" if message["role"] == "developer" else message["role"]
        checked.append({**message, "role": role, "content": content})
    return checked


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(kind: str, response_id: str, model: str, choices: list, created: int | None = None) -> dict:
    """The fields every response and chunk has."""
    return {"id": response_id, "object": kind, "created": created or int(time.time()), "model": model,
            "choices": choices}


def _top(pieces, alternatives) -> list:
    return [(pieces.text_of(token_id), logprob, token_id) for token_id, logprob in alternatives]


def completion_logprobs(pieces, token_ids, logprobs, alternatives=None, texts=None, offset: int = 0) -> dict:
    """The legacy completions `logprobs` object: each token's text, log-probability and (with `alternatives`,
    one list of `(id, logprob)` per token) the most likely tokens at its step.

    Args:
        pieces: A `TokenPieces` of the tokenizer.
        token_ids: The generated ids.
        logprobs: Their log-probabilities.
        alternatives: Per token, `(id, logprob)` pairs, most likely first; None without.
        texts: The text each token adds to the completion (for `text_offset`: '' for a token that ends no
            character); default: decoded here.
        offset: The character offset of the first token in the completion's text.
    """
    if texts is None:
        decoder = IncrementalDecoder(pieces.tokenizer)
        texts = [decoder.add(i) for i in token_ids]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    top = None if alternatives is None else [
        {text: logprob for text, logprob, _ in _top(pieces, step)} for step in alternatives]
    return {"tokens": [pieces.text_of(i) for i in token_ids], "token_logprobs": [float(lp) for lp in logprobs],
            "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(pieces, token_ids, logprobs, alternatives=None) -> dict:
    """The chat `logprobs` object: per token its text, log-probability, UTF-8 bytes and the most likely tokens
    at its step (`top_logprobs`, empty without `alternatives`)."""
    content = []
    for number, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
        top = [] if alternatives is None else [
            {"token": text, "logprob": float(lp), "bytes": list(pieces.bytes_of(i))}
            for text, lp, i in _top(pieces, alternatives[number])]
        content.append({"token": pieces.text_of(token_id), "logprob": float(logprob),
                        "bytes": list(pieces.bytes_of(token_id)), "top_logprobs": top})
    return {"content": content}
