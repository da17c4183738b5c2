"""`Engine`: continuous batching on decode slots, with an asyncio API.

One engine thread owns the model's `SlotDecoder` (`xlagen.generation.slots`) and runs the loop: expire and
cancel, admit waiting requests into free slots (prefill, insert, first token), then advance every active slot
by one step. A request joins at the next step and leaves as soon as it ends, so no request waits for
another to finish (iteration-level batching, Orca, OSDI 2022). Tokens reach each consumer's event loop
through `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

import numpy as np

from xlagen.generation.row_sampling import RowOptions
from xlagen.generation.slots import SlotDecoder
from xlagen.models.base import EncoderDecoderLM
from xlagen.serving.options import RequestOptions
from xlagen.serving.text import IncrementalDecoder, StopStrings

logger = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "cancelled", "deadline")
DEFAULT_PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512)


class QueueFull(RuntimeError):
    """The engine's queue of waiting requests holds `max_queue` requests: retry later (HTTP 429)."""


class EngineClosed(RuntimeError):
    """The engine was closed (or is draining) and takes no new requests (HTTP 503)."""


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
    """

    token_id: int | None
    text: str
    logprob: float | None
    finish_reason: str | None


class Completion(NamedTuple):
    """A finished request.

    Attributes:
        text: The generated text (stop strings and what follows them left out).
        token_ids: The generated ids, the stop token included.
        finish_reason: As `TokenEvent.finish_reason`.
        prompt_tokens: Tokens of the prompt (of the encoder input for an encoder-decoder model).
        completion_tokens: `len(token_ids)`.
        logprobs: One per token with `logprobs=True`, else None.
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: tuple[float, ...] | None


@dataclass
class _Prepared:
    """A prompt as the slots take it: the (decoder) prompt left-padded, and the model's other inputs."""

    ids: np.ndarray  # int32 [1, Pb]
    mask: np.ndarray  # int32 [1, Pb]
    extra: dict
    real_length: int  # real tokens of the decoder prompt: the columns a slot uses before new tokens
    prompt_tokens: int
    context: tuple  # prompt ids whose text precedes the output (incremental decoding)


@dataclass
class _Request:
    prepared: _Prepared
    options: RequestOptions
    seed: np.ndarray  # int32 [2]
    stop_ids: frozenset
    budget: int  # new tokens at most
    deliver: Any  # event -> None, from the engine thread
    detokenizer: IncrementalDecoder
    stops: StopStrings
    submitted: float
    deadline_at: float | None
    cancelled: bool = False
    finished: bool = False
    slot: int | None = None
    start: int = 0  # first cache column of the request's real tokens
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    pieces: list = field(default_factory=list)
    completion: Completion | None = None


def _bucket(length: int, buckets: tuple[int, ...]) -> int:
    index = bisect.bisect_left(buckets, length)
    if index == len(buckets):
        raise ValueError(f"prompt of {length} tokens is longer than the largest prompt bucket {buckets[-1]} "
                         f"(prompt_buckets={buckets}); shorten it or build the Engine with larger buckets")
    return buckets[index]


def _seed_words(seed: int) -> np.ndarray:
    """An int64-range seed as the int32 `[2]` of the sampling hash."""
    return np.array([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF], np.uint32).view(np.int32)


class _EventStream:
    """The async iterator of one request's `TokenEvent`s (`Engine.stream`). Closing it (`aclose`, leaving
    an `async with`, dropping it, or cancelling the task that awaits it) cancels the request."""

    def __init__(self, engine: "Engine", request: _Request, queue: asyncio.Queue):
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


class Engine:
    """Continuous batching of generation requests on `slots` decode slots of one model.

    Args:
        model: A text model loaded by xlagen (GPT-2, OPT, T5, ...).
        tokenizer: Its tokenizer (`encode`, `decode`).
        slots: Requests decoded together (each slot holds one request's KV cache in variables).
        max_length: Columns one request may use: its prompt's real tokens plus its new tokens (default: the
            model's positions, at most 1024). A request ends with "length" when it reaches them.
        prompt_buckets: Lengths (decoder prompts of decoder-only models, encoder inputs of encoder-decoder
            models) are padded up to these; each compiles one prefill and one insert program. Default: the
            powers of two from 16 below `max_length`.
        max_queue: Requests that may wait for a slot; a further one raises `QueueFull`.
        steps_per_call: Tokens every slot advances per compiled step call (1 reacts to new requests fastest).

    Raises:
        ValueError: for sizes < 1, or a `max_length` beyond the model's positions.

    Example:
        >>> engine = Engine(model, tokenizer, slots=8)
        >>> engine.warmup(); engine.start()
        >>> async for event in engine.stream("Hello", max_new_tokens=20):
        ...     print(event.text, end="")
        >>> engine.close()
    """

    def __init__(self, model, tokenizer, *, slots: int = 8, max_length: int | None = None,
                 prompt_buckets: Sequence[int] | None = None, max_queue: int = 64, steps_per_call: int = 1):
        positions = getattr(model.config, "max_positions", None)
        if max_length is None:
            max_length = min(positions or 1024, 1024)
        if positions is not None and max_length > positions:
            raise ValueError(f"max_length {max_length} exceeds the model's {positions} positions")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.model, self.tokenizer = model, tokenizer
        self.encoder_decoder = isinstance(model, EncoderDecoderLM)
        if prompt_buckets is None:
            prompt_buckets = tuple(b for b in DEFAULT_PROMPT_BUCKETS if b < max_length) or (max_length // 2,)
        buckets = tuple(sorted(set(int(b) for b in prompt_buckets)))
        if not buckets or buckets[0] < 1 or (not self.encoder_decoder and buckets[-1] >= max_length):
            raise ValueError(f"prompt_buckets must be >= 1 and (decoder-only models) < max_length {max_length}, "
                             f"got {tuple(prompt_buckets)}")
        self.prompt_buckets, self.max_length, self.max_queue = buckets, max_length, max_queue
        self._decoder = SlotDecoder(model, slots, max_length, steps_per_call,
                                    encoder_length=buckets[-1] if self.encoder_decoder else 0)
        self.slots = slots
        generation = getattr(model, "generation_config", None)
        self._eos_ids = frozenset(generation.eos_token_ids) if generation is not None else frozenset()
        self._start_column = buckets[-1] if not self.encoder_decoder else self._decoder_prompt_length()
        self._index = self._start_column
        self._rng = np.random.default_rng()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._active: dict[int, _Request] = {}
        self._options = self._idle_options()
        self._lock = threading.Condition()  # guards _waiting, _closing; wakes the engine thread
        self._device = threading.Lock()  # one user of the slots at a time (the engine thread, warmup)
        self._thread: threading.Thread | None = None
        self._closing = self._drain = False
        self._counters = collections.Counter()
        self._warm = False

    # -- public API -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the engine thread (requests submitted before wait in the queue).

        Raises:
            RuntimeError: if it was started already or closed.
        """
        with self._lock:
            if self._thread is not None or self._closing:
                raise RuntimeError("Engine.start: the engine was started already (or closed)")
            self._thread = threading.Thread(target=self._run, name="xlagen-engine", daemon=True)
            self._thread.start()

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stops taking requests and stops the engine thread.

        Args:
            drain: Finish the running and waiting requests first; else end them with "cancelled".
            timeout: Seconds to wait for the thread (None: as long as it takes).
        """
        with self._lock:
            self._closing, self._drain = True, drain
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        else:
            self._finish_all("cancelled")

    def warmup(self) -> float:
        """Compiles the programs of every prompt bucket and the step (before serving, so that no request
        waits for a compile).

        Returns:
            The seconds it took.

        Raises:
            RuntimeError: while requests are running or waiting.
        """
        started = time.perf_counter()
        with self._device:
            if self._active or self._waiting:
                raise RuntimeError("Engine.warmup runs before requests arrive (requests are running or waiting)")
            for bucket in self.prompt_buckets:
                prepared = self._prepare([0] * bucket)
                prefilled, _ = self._decoder.prefill(prepared.ids, prepared.mask, prepared.extra,
                                                     self._row_options(RequestOptions(), _seed_words(0), 0))
                self._decoder.insert(prefilled, prepared.ids, prepared.mask, 0, self._index)
            self._decoder.step(self._index, self._options)
            self._decoder.shift(1, self._index)
        self._warm = True
        return time.perf_counter() - started

    def stream(self, prompt, **options) -> _EventStream:
        """Submits a request; iterate the result with `async for` (call from a running event loop).

        Args:
            prompt: Text, or token ids (for an encoder-decoder model: the encoder's input).
            **options: `RequestOptions` fields (max_new_tokens, do_sample, temperature, top_p, top_k, seed,
                repetition_penalty, stop_token_ids, stop, logprobs, deadline).

        Returns:
            An async iterator of `TokenEvent`s; the last has a finish reason. After it, `.completion()`
            gives the `Completion`. Closing it early (or cancelling the task iterating it) cancels the request,
            and its slot is freed at the next step.

        Raises:
            TypeError, ValueError: for a bad option (named) or prompt, or `num_beams` > 1 (beam search
                is not decoded on slots: use `CompiledGenerator`).
            QueueFull: when `max_queue` requests are waiting.
            EngineClosed: after `close`.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def deliver(event: TokenEvent) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        return _EventStream(self, self._submit(prompt, RequestOptions.from_kwargs(**options), deliver), queue)

    async def generate(self, prompt, **options) -> Completion:
        """Runs a request to its end (see `stream` for the arguments and errors).

        Returns:
            The `Completion`.
        """
        events = self.stream(prompt, **options)
        async for _ in events:
            pass
        return events.completion()

    def stats(self) -> dict:
        """Counters for monitoring (Prometheus gauges and counters).

        Returns:
            A dict: `queue_depth`, `active_slots`, `slots`, `tokens_generated`, `requests_submitted`,
            `requests_finished` (a dict by finish reason), `prefills`, `steps`, `shifts`, `compiles` (programs
            traced and compiled so far), `warm` (whether `warmup` ran), `running` (the engine thread is
            alive).
        """
        with self._lock:
            counters = dict(self._counters)
            return {"queue_depth": len(self._waiting), "active_slots": len(self._active), "slots": self.slots,
                    "tokens_generated": counters.get("tokens", 0),
                    "requests_submitted": counters.get("submitted", 0),
                    "requests_finished": {reason: counters.get(reason, 0) for reason in FINISH_REASONS},
                    "prefills": counters.get("prefills", 0), "steps": counters.get("steps", 0),
                    "shifts": counters.get("shifts", 0), "compiles": self._decoder.compiles,
                    "warm": self._warm, "running": self._thread is not None and self._thread.is_alive()}

    # -- requests -------------------------------------------------------------------------------------

    def _decoder_prompt_length(self) -> int:
        ids, _, _ = self._generation_inputs([0] * self.prompt_buckets[0])
        return ids.shape[1]

    def _generation_inputs(self, ids: list[int]):
        """The model's decoder prompt and other inputs for prompt `ids` (an encoder's input is right-padded
        to its bucket): numpy `ids [1, P']`, `mask [1, P']`, dict `extra`."""
        length = len(ids)
        bucket = _bucket(length, self.prompt_buckets)
        padded = np.zeros((1, bucket), np.int32)
        padded[0, :length] = ids
        mask = (np.arange(bucket) < length).astype(np.int32)[None]
        decoder_ids, decoder_mask, extra = self.model.generation_inputs(padded, mask)
        return (np.asarray(decoder_ids, np.int32), np.asarray(decoder_mask, np.int32),
                {name: np.asarray(value) for name, value in extra.items()})

    def _token_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            ids = [int(i) for i in np.asarray(prompt).reshape(-1)] if len(prompt) else []
            if isinstance(prompt, np.ndarray) and not np.issubdtype(prompt.dtype, np.integer):
                raise TypeError(f"prompt ids must be integers, got an array of {prompt.dtype}")
            if any(isinstance(i, (bool, float)) for i in (prompt if not isinstance(prompt, np.ndarray) else ())):
                raise TypeError("prompt ids must be integers")
        else:
            raise TypeError(f"prompt must be a string or a sequence of token ids, got {type(prompt).__name__}")
        vocab = self.model.config.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        return ids

    def _prepare(self, prompt) -> _Prepared:
        ids = self._token_ids(prompt)
        if self.encoder_decoder:
            decoder_ids, decoder_mask, extra = self._generation_inputs(ids)
            return _Prepared(decoder_ids, decoder_mask, extra, int(decoder_mask.sum()), len(ids), ())
        bucket = _bucket(len(ids), self.prompt_buckets)
        padded, mask = np.zeros((1, bucket), np.int32), np.zeros((1, bucket), np.int32)
        padded[0, bucket - len(ids):], mask[0, bucket - len(ids):] = ids, 1
        return _Prepared(padded, mask, {}, len(ids), len(ids), tuple(ids))

    def _submit(self, prompt, options: RequestOptions, deliver) -> _Request:
        if options.num_beams > 1:
            raise ValueError(f"num_beams={options.num_beams}: the slot engine decodes one beam per request; "
                             "run beam search with xlagen.CompiledGenerator")
        vocab = self.model.config.vocab_size
        for token_id in options.stop_token_ids:
            if token_id >= vocab:
                raise ValueError(f"stop_token_ids holds {token_id}, outside the vocabulary [0, {vocab})")
        prepared = self._prepare(prompt)
        room = self.max_length - prepared.real_length
        if room < 1:
            raise ValueError(f"prompt of {prepared.real_length} tokens leaves no room for new tokens within "
                             f"max_length {self.max_length}")
        seed = options.seed if options.seed is not None else int(self._rng.integers(0, 2**63 - 1))
        now = time.monotonic()
        request = _Request(prepared, options, _seed_words(seed), self._eos_ids | set(options.stop_token_ids),
                           min(options.max_new_tokens, room), deliver,
                           IncrementalDecoder(self.tokenizer, prepared.context), StopStrings(options.stop), now,
                           None if options.deadline is None else now + options.deadline)
        with self._lock:
            if self._closing:
                raise EngineClosed("the engine is closed and takes no new requests")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (max_queue={self.max_queue}); "
                                "retry later")
            self._waiting.append(request)
            self._counters["submitted"] += 1
            self._lock.notify_all()
        return request

    def _cancel(self, request: _Request) -> None:
        """Marks `request` cancelled (any thread); the engine thread ends it at its next iteration."""
        if not request.finished:
            request.cancelled = True
            with self._lock:
                self._lock.notify_all()

    # -- the engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while not (self._waiting or self._active or self._closing):
                        self._lock.wait()
                    if self._closing and not (self._drain and (self._waiting or self._active)):
                        break
                with self._device:
                    self._iterate()
        except Exception:  # a failing program must not leave consumers waiting forever
            logger.exception("the serving engine stopped on an error")
            raise
        finally:
            self._finish_all("cancelled")

    def _iterate(self) -> None:
        now = time.monotonic()
        for request in list(self._active.values()):
            if request.cancelled:
                self._finish(request, "cancelled")
            elif request.deadline_at is not None and now >= request.deadline_at:
                self._finish(request, "deadline")
        self._admit(now)
        if self._active:
            self._step()
        else:
            self._index = self._start_column

    def _take_waiting(self, now: float) -> _Request | None:
        """The next waiting request that is still wanted (the others end here)."""
        while True:
            with self._lock:
                if not self._waiting:
                    return None
                request = self._waiting.popleft()
            if request.cancelled:
                self._finish(request, "cancelled")
            elif request.deadline_at is not None and now >= request.deadline_at:
                self._finish(request, "deadline")
            else:
                return request

    def _admit(self, now: float) -> None:
        free = [slot for slot in range(self.slots) if slot not in self._active]
        while free:
            request = self._take_waiting(now)
            if request is None:
                break
            prepared = request.prepared
            prefilled, (token, logprob) = self._decoder.prefill(
                prepared.ids, prepared.mask, prepared.extra, self._row_options(request.options, request.seed, 0))
            slot = free.pop(0)
            self._decoder.insert(prefilled, prepared.ids, prepared.mask, slot, self._index)
            request.slot, request.start = slot, self._index - prepared.real_length
            self._active[slot] = request
            self._set_options(slot, request)
            self._counters["prefills"] += 1
            self._emit(request, token, logprob)
        with self._lock:  # expire what still waits
            expired = [r for r in self._waiting if r.cancelled or (r.deadline_at is not None and now >= r.deadline_at)]
            for request in expired:
                self._waiting.remove(request)
        for request in expired:
            self._finish(request, "cancelled" if request.cancelled else "deadline")

    def _step(self) -> None:
        decoder, steps = self._decoder, self._decoder.steps_per_call
        if self._index + steps > decoder.length:
            amount = min(min(r.start for r in self._active.values()), self._index - self._start_column)
            decoder.shift(amount, self._index)
            self._index -= amount
            for request in self._active.values():
                request.start -= amount
            self._counters["shifts"] += 1
        tokens, logprobs = decoder.step(self._index, self._options)
        self._index += steps
        self._counters["steps"] += 1
        for slot, request in list(self._active.items()):
            for token, logprob in zip(tokens[slot], logprobs[slot]):
                self._emit(request, int(token), float(logprob))
                if request.finished:
                    break

    def _emit(self, request: _Request, token: int, logprob: float) -> None:
        """Hands one new token to the request's consumer; ends the request when it is done."""
        request.token_ids.append(token)
        request.logprobs.append(logprob)
        self._options.step[request.slot] += 1
        with self._lock:
            self._counters["tokens"] += 1
        finish = None
        if token in request.stop_ids:
            text, finish = "", "stop"
        else:
            text, found = request.stops.feed(request.detokenizer.add(token))
            finish = "stop" if found else None
        if finish is None and len(request.token_ids) >= request.budget:
            finish = "length"
        if finish == "length" or token in request.stop_ids:  # (after a stop string, nothing more is released)
            text += self._flush_text(request)
        self._deliver(request, TokenEvent(token, text, logprob if request.options.logprobs else None, finish))
        if finish is not None:
            self._finish(request, finish, event=False)

    def _flush_text(self, request: _Request) -> str:
        """The text still held back by the detokenizer and the stop-string matcher, at the end of a request."""
        text, found = request.stops.feed(request.detokenizer.flush())
        return text if found else text + request.stops.flush()

    def _deliver(self, request: _Request, event: TokenEvent) -> None:
        if event.text:
            request.pieces.append(event.text)
        if event.finish_reason is not None:
            logprobs = tuple(request.logprobs) if request.options.logprobs else None
            request.completion = Completion("".join(request.pieces), tuple(request.token_ids), event.finish_reason,
                                            request.prepared.prompt_tokens, len(request.token_ids), logprobs)
        try:
            request.deliver(event)
        except RuntimeError:  # the consumer's event loop is closed
            request.cancelled = True

    def _finish(self, request: _Request, reason: str, event: bool = True) -> None:
        """Ends `request` with `reason`: a last event without a token (unless one was just sent), and
        its slot freed."""
        if request.finished:
            return
        if event:
            text = self._flush_text(request) if reason == "deadline" else ""
            self._deliver(request, TokenEvent(None, text, None, reason))
        request.finished = True
        if request.slot is not None and self._active.get(request.slot) is request:
            del self._active[request.slot]
            self._reset_options(request.slot)
        with self._lock:
            self._counters[reason] += 1

    def _finish_all(self, reason: str) -> None:
        with self._lock:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for request in list(self._active.values()) + waiting:
            self._finish(request, reason)

    # -- per-slot options -----------------------------------------------------------------------------

    def _idle_options(self) -> RowOptions:
        n = self.slots
        return RowOptions(np.zeros(n, bool), np.ones(n, np.float32), np.zeros(n, np.int32), np.ones(n, np.float32),
                          np.ones(n, np.float32), np.zeros((n, 2), np.int32), np.zeros(n, np.int32))

    @staticmethod
    def _row_options(options: RequestOptions, seed: np.ndarray, steps: int) -> RowOptions:
        return RowOptions(np.array([options.do_sample]), np.array([options.temperature], np.float32),
                          np.array([options.top_k], np.int32), np.array([options.top_p], np.float32),
                          np.array([options.repetition_penalty], np.float32), seed[None],
                          np.array([steps], np.int32))

    def _set_options(self, slot: int, request: _Request) -> None:
        for column, value in zip(self._options, self._row_options(request.options, request.seed, 0)):
            column[slot] = value[0]

    def _reset_options(self, slot: int) -> None:
        for column, value in zip(self._options, self._idle_options()):
            column[slot] = value[slot]
