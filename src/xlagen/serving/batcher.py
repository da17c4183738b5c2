"""Request-level batching over `CompiledGenerator`: concurrent requests that share their decoding options run
as one batch of the existing buckets, each batch one compiled whole-generation program.

This is the path for what the slot engine does not decode (beam search), and for a model the engine does not
serve. Its interface is the engine's (`stream`, `generate`, `stats`, `start`, `close`, `warmup`), but a
request's tokens arrive together, when its batch has finished: no request joins a running batch.

Which requests share a batch: those with the same decoding options apart from `max_new_tokens` (the batch
runs to the longest and each row is cut to its own), `stop`, `stop_token_ids` (both applied to each row's
tokens afterwards) and `deadline`. A sampled request with a seed runs alone, so that its tokens are those of
`CompiledGenerator.generate` for that prompt and `seed=seed_words(seed)` whatever else is queued: the slot
engine's tokens for the same seed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import numpy as np

from xlagen.serving.streams import Completion, ContextTooLong, EngineClosed, QueueFull, TokenEvent
from xlagen.serving.events import completion_of, token_events
from xlagen.serving.options import MAX_TOP_LOGPROBS, RequestOptions, seed_words

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Pending:
    """One queued request: its group key, what the group runner needs, and where its result goes."""

    key: Any
    payload: Any
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    expires: float | None  # time.monotonic() deadline, None without one
    created: float = dataclasses.field(default_factory=time.monotonic)


class WorkQueue:
    """A bounded queue of requests and one worker thread that runs them in groups of equal key.

    Args:
        run_group: `run_group(payloads) -> results` (one per payload), called on the worker thread.
        max_batch: Most requests in one group.
        max_queue: Most requests waiting; `submit` raises `QueueFull` beyond it.
        max_wait: Seconds the worker waits for more requests after the first of a group arrived.
        name: The worker thread's name.
    """

    def __init__(self, run_group: Callable[[list], list], *, max_batch: int, max_queue: int, max_wait: float,
                 name: str):
        if max_batch < 1 or max_queue < 1 or max_wait < 0:
            raise ValueError(f"max_batch and max_queue must be >= 1 and max_wait >= 0, got {max_batch}, "
                             f"{max_queue}, {max_wait}")
        self._run_group = run_group
        self.max_batch, self.max_queue, self.max_wait = max_batch, max_queue, max_wait
        self._pending: list[Pending] = []
        self._condition = threading.Condition()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._closing = False
        self._drain = True
        self.active = 0  # requests in the group being run
        self.completed = 0

    @property
    def depth(self) -> int:
        """Requests waiting for a group (not those cancelled meanwhile, which the worker drops)."""
        return sum(not request.future.cancelled() for request in self._pending)

    def start(self) -> None:
        """Starts the worker thread (once)."""
        if not self._thread.is_alive():
            self._thread.start()

    def submit(self, key, payload, deadline: float | None) -> asyncio.Future:
        """Queues a request; returns the future of its result (cancel it to drop the request).

        Raises:
            QueueFull: If `max_queue` requests are waiting.
            EngineClosed: If the queue is closed or not started.
        """
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        expires = None if deadline is None else time.monotonic() + deadline
        with self._condition:
            if self._closing or not self._thread.is_alive():
                raise EngineClosed("the batcher is not running (not started, or closing): no new requests")
            if self.depth >= self.max_queue:
                raise QueueFull(f"{self.depth} requests are waiting (max_queue={self.max_queue}); retry later")
            self._pending.append(Pending(key, payload, future, loop, expires))
            self._condition.notify()
        return future

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stops accepting requests; with `drain` runs what is queued first, else fails it; joins the worker."""
        with self._condition:
            self._closing, self._drain = True, drain
            if not drain:
                for request in self._pending:
                    _deliver(request, RuntimeError("the batcher was closed before this request ran"))
                self._pending.clear()
            self._condition.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _next_group(self) -> list[Pending] | None:
        """Waits for requests and takes the next group; None when closed and empty."""
        with self._condition:
            while True:
                self._drop_finished()
                if not self._pending:
                    if self._closing:
                        return None
                    self._condition.wait()
                    continue
                key = self._pending[0].key
                same = [r for r in self._pending if r.key == key]
                waited = time.monotonic() - self._pending[0].created
                if len(same) < self.max_batch and waited < self.max_wait and not self._closing:
                    self._condition.wait(self.max_wait - waited)
                    continue
                group = same[:self.max_batch]
                self._pending = [r for r in self._pending if r not in group]
                self.active = len(group)
                return group

    def _drop_finished(self) -> None:
        """Removes cancelled requests and fails expired ones (with `TimeoutError`)."""
        now, kept = time.monotonic(), []
        for request in self._pending:
            if request.future.cancelled():
                continue
            if request.expires is not None and now >= request.expires:
                _deliver(request, TimeoutError("the request's deadline passed while it was queued"))
                continue
            kept.append(request)
        self._pending = kept

    def _work(self) -> None:
        while (group := self._next_group()) is not None:
            try:
                results = self._run_group([r.payload for r in group])
            except Exception as error:  # noqa: BLE001 - the group's callers get the error, the worker goes on
                logger.warning("a batch of %d request(s) failed: %s", len(group), error)
                results = [error] * len(group)
            for request, result in zip(group, results):
                _deliver(request, result)
            with self._condition:
                self.active = 0
                self.completed += len(group)


def _deliver(request: Pending, result) -> None:
    """Sets the request's future (an exception if `result` is one) on its event loop, unless it was cancelled."""
    def settle():
        if request.future.done():
            return
        if isinstance(result, BaseException):
            request.future.set_exception(result)
        else:
            request.future.set_result(result)

    try:
        request.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the caller's event loop is closed: nobody waits for this result any more
        pass


async def await_result(future: asyncio.Future, deadline: float | None):
    """The future's result, waiting at most `deadline` seconds; cancels the future when the caller gives up.

    Raises:
        TimeoutError: When the deadline passes first (the request is dropped).
    """
    try:
        return await asyncio.wait_for(asyncio.shield(future), deadline)
    except asyncio.TimeoutError:
        raise TimeoutError(f"the request's deadline of {deadline} s passed") from None
    finally:
        if not future.done():
            future.cancel()


@dataclasses.dataclass(frozen=True)
class _TextRequest:
    ids: tuple[int, ...]
    options: RequestOptions


def _group_key(options: RequestOptions, prompt_bucket: int, request_number: int):
    """What must be equal for requests to share a batch (see the module docstring)."""
    alone = request_number if options.do_sample and options.seed is not None else None
    sampling = (options.temperature, options.top_p, options.top_k) if options.do_sample else ()
    return (prompt_bucket, options.do_sample, sampling, options.repetition_penalty, options.num_beams,
            options.logprobs, alone)


class RequestBatcher:
    """Batches concurrent text requests over a `CompiledGenerator` (one worker thread).

    Args:
        model: A causal or encoder-decoder LM (`generate` semantics).
        tokenizer: Its tokenizer (prompts given as text are encoded with it; outputs decoded).
        generator: The `CompiledGenerator` to run on; one with default buckets is made when None.
        max_batch: Most requests per batch (rounded up to a batch bucket when run).
        max_queue: Most requests waiting; beyond it `stream` and `generate` raise `QueueFull`.
        max_wait: Seconds to wait for more compatible requests once one is queued.
    """

    def __init__(self, model, tokenizer, *, generator=None, max_batch: int = 8, max_queue: int = 64,
                 max_wait: float = 0.005):
        from xlagen.generation.compiled import CompiledGenerator

        self.model, self.tokenizer = model, tokenizer
        self.generator = generator or CompiledGenerator(model)
        config = model.generation_config
        self.eos_ids = tuple(config.eos_token_ids) if config is not None else ()
        self.pad_id = (config.pad_token_id if config is not None and config.pad_token_id is not None
                       else (self.eos_ids or (0,))[0])
        self.encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
        self._queue = WorkQueue(self._run, max_batch=max_batch, max_queue=max_queue, max_wait=max_wait,
                                name="xlagen-batcher")
        self._submitted = 0
        self._tokens = 0

    @property
    def capacity(self) -> int:
        """Requests it holds at once: one running batch and a full queue."""
        return self._queue.max_batch + self._queue.max_queue

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt it takes: the model's positions less one new token (decoder-only), else the
        largest prompt bucket of its generator."""
        positions = None if self.encoder_decoder else self.model.config.max_positions
        return positions - 1 if positions else self.generator.buckets.prompt_lengths[-1]

    def start(self) -> None:
        """Starts the worker thread."""
        self._queue.start()

    def close(self, drain: bool = True) -> None:
        """Stops accepting requests; with `drain`, finishes the queued ones first."""
        self._queue.close(drain)

    def warmup(self, batch_sizes: Sequence[int] = (1,), prompt_lengths: Sequence[int] = (16,),
               max_new_tokens: Sequence[int] = (16,), **options) -> None:
        """Compiles the programs of these shapes for requests with `options` (e.g. num_beams=4)."""
        options = RequestOptions.from_kwargs(**options)
        self.generator.warmup(batch_sizes=tuple(batch_sizes), prompt_lengths=tuple(prompt_lengths),
                              max_new_tokens=tuple(max_new_tokens), eos_token_id=list(self.eos_ids) or None,
                              **_generate_options(options))

    def stats(self) -> dict:
        """queue_depth, active_slots (requests in the running batch), tokens_generated, requests_completed,
        compiles."""
        return {"queue_depth": self._queue.depth, "active_slots": self._queue.active,
                "tokens_generated": self._tokens, "requests_completed": self._queue.completed,
                "compiles": self.generator.compile_count}

    def _prepare(self, prompt, options: dict) -> tuple[Any, _TextRequest, RequestOptions]:
        """Validates a request; returns (group key, request, options).

        Raises:
            TypeError, ValueError: For a bad option (named) or a prompt that does not fit the model.
        """
        opts = RequestOptions.from_kwargs(**options)
        if opts.logprobs and opts.num_beams > 1:
            raise ValueError("logprobs cannot be combined with num_beams > 1 (beam search scores whole beams)")
        if opts.do_sample and opts.num_beams > 1:
            raise ValueError("do_sample cannot be combined with num_beams > 1 (beam sampling is not supported)")
        ids = tuple(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else tuple(prompt)
        if not ids:
            raise ValueError("the prompt is empty: it encodes to no tokens")
        vocab = self.model.config.vocab_size
        if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) and 0 <= i < vocab for i in ids):
            raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
        limit = None if self.encoder_decoder else self.model.config.max_positions
        if opts.max_new_tokens is None:
            if limit is None:
                raise ValueError("max_new_tokens=None (as many as fit) needs a decoder-only model with learned "
                                 "positions: give max_new_tokens")
            if len(ids) >= limit:
                raise ContextTooLong(len(ids), None, limit, "the model's positions")
            opts = opts.update(max_new_tokens=limit - len(ids))
        if limit is not None and len(ids) + opts.max_new_tokens > limit:
            raise ContextTooLong(len(ids), opts.max_new_tokens, limit, "the model's positions")
        bucket = self.generator._buckets_for(len(ids), opts.max_new_tokens)[0]
        self._submitted += 1
        return _group_key(opts, bucket, self._submitted), _TextRequest(ids, opts), opts

    async def stream(self, prompt: str | Sequence[int], **options) -> AsyncIterator[TokenEvent]:
        """Yields the request's tokens (all at once, when its batch has finished).

        Raises:
            QueueFull: If the queue is full (at the first iteration).
            TypeError, ValueError: For bad options or prompts.
        """
        key, request, opts = self._prepare(prompt, options)
        future = self._queue.submit(key, request, opts.deadline)
        try:
            events, _ = await await_result(future, opts.deadline)
        except TimeoutError:
            yield TokenEvent(None, "", None, "deadline")
            return
        for event in events:
            yield event

    async def generate(self, prompt: str | Sequence[int], **options) -> Completion:
        """The request's whole completion.

        Raises:
            QueueFull, TypeError, ValueError: As `stream`.
        """
        key, request, opts = self._prepare(prompt, options)
        future = self._queue.submit(key, request, opts.deadline)
        try:
            _, completion = await await_result(future, opts.deadline)
        except TimeoutError:
            return Completion("", (), "deadline", len(request.ids), 0, None)
        return completion

    def _run(self, requests: list[_TextRequest]) -> list:
        """Runs one batch on the worker thread; returns (events, completion) per request."""
        options = requests[0].options
        length = max(len(r.ids) for r in requests)
        ids = np.full((len(requests), length), self.pad_id, np.int32)
        mask = np.zeros_like(ids)
        for row, request in enumerate(requests):  # left padding
            ids[row, length - len(request.ids):] = request.ids
            mask[row, length - len(request.ids):] = 1
        new_tokens = max(r.options.max_new_tokens for r in requests)
        seed = None
        if options.do_sample and options.seed is not None:
            seed = seed_words(options.seed)  # as the engine's: the same tokens for the same seed
        out = self.generator.generate(ids, attention_mask=mask, seed=seed, max_new_tokens=new_tokens,
                                      eos_token_id=list(self.eos_ids) or None, pad_token_id=self.pad_id,
                                      output_scores=options.logprobs, return_dict_in_generate=options.logprobs,
                                      **_generate_options(options))
        sequences = (out.sequences if options.logprobs else out).numpy()
        new = sequences[:, 1:] if self.encoder_decoder else sequences[:, length:]
        logprobs, top = _chosen_logprobs(out.scores, new) if options.logprobs else (None, None)
        results = []
        for row, request in enumerate(requests):
            tokens = new[row, :request.options.max_new_tokens].tolist()
            row_logprobs = None if logprobs is None else logprobs[row, :len(tokens)].tolist()
            wanted = request.options.top_logprobs
            row_top = None if not wanted else [
                [(int(i), float(lp)) for i, lp in zip(*step)] for step in zip(top[1][row, :len(tokens), :wanted],
                                                                              top[0][row, :len(tokens), :wanted])]
            events = token_events(self.tokenizer, request.ids, tokens, row_logprobs, request.options, self.eos_ids,
                                  row_top)
            self._tokens += len(events)
            results.append((events, completion_of(events, len(request.ids), request.options.logprobs)))
        return results


def _generate_options(options: RequestOptions) -> dict:
    """The `generate` options of a request (explicit, so the checkpoint's sampling defaults do not apply)."""
    chosen = {"do_sample": options.do_sample, "num_beams": options.num_beams,
              "repetition_penalty": options.repetition_penalty}
    if options.do_sample:
        chosen.update(temperature=options.temperature, top_p=options.top_p, top_k=options.top_k)
    return chosen


def _chosen_logprobs(scores, tokens: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """float32 `[B, N]`: the log-softmax of each step's processed scores at the chosen token; and the
    `MAX_TOP_LOGPROBS` most likely tokens of each step, `(logprobs float32 [B, N, A], ids int32 [B, N, A])`."""
    import tensorflow as tf

    steps = tf.nn.log_softmax(tf.stack(scores, axis=1)[:, :tokens.shape[1]], axis=-1)  # [B, N, V]
    top = tf.math.top_k(steps, k=min(MAX_TOP_LOGPROBS, steps.shape[-1]))
    logprobs = steps.numpy()
    chosen = np.take_along_axis(logprobs, tokens[:, :logprobs.shape[1], None], axis=-1)[..., 0]
    return chosen, (top.values.numpy(), top.indices.numpy())
