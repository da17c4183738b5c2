"""Turning a request's generated token ids into what the serving APIs return: one `TokenEvent` per token
(its text as a delta of the decoded completion), the `Completion`, and the stop rules applied afterwards
(EOS, `stop_token_ids`, `stop` strings) for a path that generates all tokens before it reports them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from xlagen.serving.options import RequestOptions


class QueueFull(RuntimeError):
    """The bounded request queue is full: retry later."""


class TokenEvent(NamedTuple):
    """One generated token: its id, the text it adds to the completion, its log-probability (with
    `logprobs`), and the finish reason on the request's last event ("stop", "length", "deadline")."""

    token_id: int | None
    text: str
    logprob: float | None
    finish_reason: str | None


class Completion(NamedTuple):
    """A finished request: its text, token ids, finish reason, token counts and per-token log-probabilities."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: tuple[float, ...] | None


def _stop_position(text: str, stops: Sequence[str]) -> int:
    """Where the first stop string starts in `text`, or -1."""
    found = [index for index in (text.find(stop) for stop in stops) if index >= 0]
    return min(found) if found else -1


def token_events(tokenizer, tokens: Sequence[int], logprobs: Sequence[float] | None, options: RequestOptions,
                 eos_ids: Sequence[int]) -> list[TokenEvent]:
    """The events of a request whose tokens are all known.

    The request ends at the first EOS or stop token (reported, its text not added: finish reason "stop"), at
    the first stop string (the text from it on left out: "stop") or after its last token ("length"). Each
    event's text is what its token adds to the decoded completion; a token ending in an incomplete UTF-8
    character adds nothing until a later one completes it.

    Args:
        tokenizer: Decodes ids (`decode(ids, skip_special_tokens=True)`).
        tokens: The generated ids (at most `options.max_new_tokens`).
        logprobs: One log-probability per token, or None.
        options: The request's options (`stop`, `stop_token_ids`).
        eos_ids: The model's EOS ids.

    Returns:
        The events; the last has the finish reason.
    """
    stops = set(eos_ids) | set(options.stop_token_ids)
    content = next((index for index, token in enumerate(tokens) if token in stops), len(tokens))
    # A stop string may span tokens: the text is never reported past where the first one starts.
    stop_at = _stop_position(tokenizer.decode(list(tokens[:content]), skip_special_tokens=True), options.stop) \
        if options.stop else -1
    events: list[TokenEvent] = []
    emitted = ""
    for index, token in enumerate(tokens[:content + 1]):
        logprob = None if logprobs is None else float(logprobs[index])
        if index == content:  # an EOS or stop token
            events.append(TokenEvent(int(token), "", logprob, "stop"))
            break
        text = tokenizer.decode(list(tokens[:index + 1]), skip_special_tokens=True)
        stopped = stop_at >= 0 and _stop_position(text, options.stop) >= 0
        last = index == len(tokens) - 1
        if stop_at >= 0:
            text = text[:stop_at]
        complete = last or stopped or not text.endswith("\ufffd")
        delta = text[len(emitted):] if complete and text.startswith(emitted) else ""
        emitted += delta
        events.append(TokenEvent(int(token), delta, logprob, "stop" if stopped else "length" if last else None))
        if stopped:
            break
    return events


def completion_of(events: Sequence[TokenEvent], prompt_tokens: int, logprobs: bool) -> Completion:
    """The `Completion` made of a request's events."""
    ids = tuple(e.token_id for e in events if e.token_id is not None)
    reason = events[-1].finish_reason if events else "length"
    return Completion("".join(e.text for e in events), ids, reason, prompt_tokens, len(ids),
                      tuple(e.logprob for e in events) if logprobs else None)
