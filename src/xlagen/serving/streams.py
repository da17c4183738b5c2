"""What the serving engine hands out: `TokenEvent`s through an async iterator, a `Completion` at the end,
and its errors (`QueueFull`, `EngineClosed`)."""

from __future__ import annotations

import asyncio
from typing import NamedTuple


class QueueFull(RuntimeError):
    """The engine's queue of waiting requests holds `max_queue` requests: retry later (HTTP 429)."""


class EngineClosed(RuntimeError):
    """The engine was closed (or is draining) and takes no new requests (HTTP 503)."""


class ContextTooLong(ValueError):
    """A prompt, or a prompt with the new tokens asked for, that does not fit the tokens a request may use (HTTP
    400, as OpenAI's and vLLM's `context_length_exceeded`).

    Attributes:
        prompt_tokens: The prompt's tokens (the decoder prompt's, for an encoder-decoder model).
        max_new_tokens: The new tokens asked for, or None when the prompt alone leaves no room.
        limit: The tokens one request may use (the engine's `max_length`, the batcher's model positions), or
            the longest prompt taken (the engine's largest prompt bucket) when `max_new_tokens` is None.
    """

    def __init__(self, prompt_tokens: int, max_new_tokens: int | None, limit: int, what: str = "max_length",
                 message: str | None = None):
        self.prompt_tokens, self.max_new_tokens, self.limit = prompt_tokens, max_new_tokens, limit
        if message is None and max_new_tokens is None:
            message = (f"the prompt's {prompt_tokens} tokens leave no room for new tokens within {what} {limit}: "
                       "shorten the prompt")
        elif message is None:
            message = (f"the prompt's {prompt_tokens} tokens + max_new_tokens {max_new_tokens} = "
                       f"{prompt_tokens + max_new_tokens} exceed {what} {limit}: shorten the prompt or ask for at "
                       f"most {limit - prompt_tokens} new tokens")
        super().__init__(message)


class TokenEvent(NamedTuple):
    """One step of a request's stream.

    Attributes:
        token_id: The generated id, or None for a last event that ends the request between tokens
            (finish reason "cancelled" or "deadline").
        text: The text this token adds: '' while it completes no character, and never text of a stop token
            or from a stop string on; decoded without special tokens.
        logprob: The token's log-probability when the request asked for `logprobs`, else None.
        finish_reason: None, or on the last event: "stop" (EOS, a stop id or a stop string), "length"
            (`max_new_tokens` or the engine's `max_length`), "cancelled" or "deadline".
        top_logprobs: With the request's `top_logprobs` > 0, that many `(token id, logprob)` pairs, the most
            likely tokens of the step's distribution first; else None.
    """

    token_id: int | None
    text: str
    logprob: float | None
    finish_reason: str | None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


class Completion(NamedTuple):
    """A finished request.

    Attributes:
        text: The generated text (stop strings and what follows them left out).
        token_ids: The generated ids, the stop token included.
        finish_reason: As `TokenEvent.finish_reason`.
        prompt_tokens: Tokens of the prompt (of the encoder input for an encoder-decoder model).
        completion_tokens: `len(token_ids)`.
        logprobs: One per token with `logprobs=True`, else None.
        top_logprobs: One tuple of `(token id, logprob)` pairs per token with `top_logprobs` > 0, else None.
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: tuple[float, ...] | None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None


class EventStream:
    """The async iterator of one request's `TokenEvent`s (`Engine.stream`). Closing it (`aclose`, leaving
    an `async with`, dropping it, or cancelling the task that awaits it) cancels the request."""

    def __init__(self, engine, request, queue: asyncio.Queue):
        self._engine, self._request, self._queue = engine, request, queue
        self._done = False

    def __aiter__(self):
        return self

    def __await__(self):  # `await engine.stream(...)` gives the stream too
        yield from ()
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        try:
            event = await self._queue.get()
        except BaseException:
            self._close()
            raise
        if event.finish_reason is not None:
            self._done = True
        return event

    def completion(self) -> Completion | None:
        """The finished request (None before its last event)."""
        return self._request.completion

    def _close(self):
        if not self._done:
            self._done = True
            self._engine._cancel(self._request)

    async def aclose(self):
        self._close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self._close()

    def __del__(self):
        self._close()


