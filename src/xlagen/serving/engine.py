"""`Engine`: continuous batching on decode slots, with an asyncio API.

One engine thread owns the model's `SlotDecoder` (`xlagen.generation.slots`) and runs the loop: expire and
cancel, admit waiting requests into free slots (prefill, insert, first token), then advance every active slot
by one step. A request joins at the next step and leaves as soon as it ends, so no request waits for
another to finish (iteration-level batching, Orca, OSDI 2022). Tokens reach each consumer's event loop
through `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from xlagen.generation import checks
from xlagen.generation.row_sampling import RowOptions
from xlagen.generation.slots import SlotDecoder
from xlagen.models.base import EncoderDecoderLM
from xlagen.serving.streams import Completion, ContextTooLong, EngineClosed, EventStream, QueueFull, TokenEvent
from xlagen.serving.options import MAX_TOP_LOGPROBS, RequestOptions, seed_words
from xlagen.serving import schedule
from xlagen.serving.prompts import Prepared, Prompts, bucket_of
from xlagen.serving.text import TokenText

logger = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "cancelled", "deadline")
ENCODER_PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512)  # an encoder-decoder model's encoder inputs
DECODER_PROMPT_ROOM = 8  # columns for an encoder-decoder model's decoder prompt (T5: 1, Whisper: up to 4)


def default_prompt_buckets(max_length: int, encoder_decoder: bool = False) -> tuple[int, ...]:
    """Prompt buckets that take every prompt that fits: for a decoder-only model the powers of two from 16 below
    `max_length`, and `max_length - 1` (a prompt and one new token); for an encoder-decoder model the encoder
    inputs 16 to 512."""
    if encoder_decoder:
        return ENCODER_PROMPT_BUCKETS
    powers = tuple(2**k for k in range(4, max_length.bit_length()) if 2**k < max_length - 1)
    return (*powers, max_length - 1) if max_length > 1 else (1,)


@dataclass
class _Request:
    prepared: Prepared
    options: RequestOptions
    seed: np.ndarray  # int32 [2]
    budget: int  # new tokens at most
    deliver: Any  # event -> None, from the engine thread
    text: TokenText
    submitted: float
    deadline_at: float | None
    cancelled: bool = False
    finished: bool = False
    slot: int | None = None
    start: int = 0  # first cache column of the request's real tokens
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    pieces: list = field(default_factory=list)
    completion: Completion | None = None


@dataclass
class _Chunked:
    """A long prompt being prefilled a chunk at a time between steps, into `slot` once its last chunk ran."""
    request: _Request
    slot: int
    ids: np.ndarray  # int32 [1, Pb]
    mask: np.ndarray
    options: RowOptions
    offsets: list  # first columns of the chunks still to run
    result: Any = None  # the last chunk's (SlotDecoder.prefill_chunk)


def default_max_length(model, slots: int, steps_per_call: int = 1) -> int:
    """The engine's `max_length` when none is given: the model's positions (1024 for a model without a limit),
    halved (not below 256) while the slots' KV cache would take more than half of the memory still available,
    with a warning naming the length kept; a model of 32k or 128k positions then serves what fits rather than
    refusing to start."""
    positions = getattr(model.config, "max_positions", None) or 1024
    available = checks.available_memory_bytes()
    length = positions
    if available is not None:
        while length > 256 and SlotDecoder.memory(model, slots, length, steps_per_call)[1] > available // 2:
            length //= 2
    if length < positions:
        logger.warning("max_length %d of the model's %d positions: %d slots of %d would take more than half of "
                       "the %.1f GiB of memory available (set max_length to choose)", length, positions, slots,
                       positions, available / 2**30)
    return length


def _seed_words(seed: int) -> np.ndarray:
    """An int64-range seed as the int32 `[2]` of the sampling hash (`options.seed_words`)."""
    return np.array(seed_words(seed), np.int32)


class Engine:
    """Continuous batching of generation requests on `slots` decode slots of one model.

    Args:
        model: A text model loaded by xlagen (GPT-2, OPT, T5, ...).
        tokenizer: Its tokenizer (`encode`, `decode`).
        slots: Requests decoded together (each slot holds one request's KV cache in variables).
        max_length: Columns one request may use: its prompt's real tokens plus its new tokens (default:
            `default_max_length`, the model's positions, 1024 for a model without a limit, halved while the
            slots' cache would take more than half of the memory available). A request whose prompt and
            `max_new_tokens` exceed them is refused (`ContextTooLong`); `max_new_tokens=None` asks for as many
            as fit. Each slot holds a KV cache of `max_length * 1.25` columns (`SlotDecoder`).
        prompt_buckets: Lengths (decoder prompts of decoder-only models, encoder inputs of encoder-decoder
            models) are padded up to these; each compiles prefill and insert programs when first used (or in
            `warmup`); a longer prompt is refused (`ContextTooLong`). Default (`default_prompt_buckets`): every
            prompt that fits `max_length`.
        max_queue: Requests that may wait for a slot; a further one raises `QueueFull`.
        steps_per_call: k, the most tokens every slot advances per compiled step call: k while no request
            waits for a free slot or prefills in chunks and every active request has k or more tokens left to
            generate, else 1 (each compiles its step programs). Several steps in one call spare the per-call
            work of the host and of TensorFlow's runtime; their tokens are streamed when the call returns (at
            most k - 1 tokens late), and a request that arrives meanwhile waits at most k steps for its slot.
            1: every call one step.
        step_widths: How many slots a step may advance (each width compiles one step program): a step runs
            on the first W slots for the smallest W that holds every active request, so a lone request does
            not pay for 16 rows. Default: 1, 4 and `slots`.
        prefill_chunk: A decoder-only model's prompt whose bucket is longer than this many tokens, arriving while
            other requests decode, is prefilled this many tokens at a time, one chunk between two steps (each
            bucket compiles one chunk program), so that the running requests keep receiving tokens; one such
            prompt at a time (another waits, the shorter ones behind it do not). A prompt arriving while nothing
            decodes is prefilled at once. None: every prompt at once.
        prefill_batch: Most waiting prompts of one bucket prefilled together in one program (each power of two
            up to it compiles one prefill program per bucket); 1 prefills one prompt at a time.
        kernels: Where xlagen's native kernels run in the engine's programs (`xlagen.native.Kernels`; None:
            the policy in force when it is made).

    Raises:
        ValueError: for sizes < 1, or a `max_length` beyond the model's positions.
        TypeError: kernels is not a `xlagen.native.Kernels`.

    Example:
        >>> engine = Engine(model, tokenizer, slots=8)
        >>> engine.warmup(); engine.start()
        >>> async for event in engine.stream("Hello", max_new_tokens=20):
        ...     print(event.text, end="")
        >>> engine.close()
    """

    def __init__(self, model, tokenizer, *, slots: int = 8, max_length: int | None = None,
                 prompt_buckets: Sequence[int] | None = None, max_queue: int = 64, steps_per_call: int = 4,
                 step_widths: Sequence[int] | None = None, prefill_batch: int = 4, prefill_chunk: int | None = 256,
                 kernels=None):
        positions = getattr(model.config, "max_positions", None)
        if max_length is None:
            max_length = default_max_length(model, slots, steps_per_call)
        if positions is not None and max_length > positions:
            raise ValueError(f"max_length {max_length} exceeds the model's {positions} positions")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if prefill_batch < 1:
            raise ValueError(f"prefill_batch must be >= 1, got {prefill_batch}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 or None, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        # Prompts prefilled together: powers of two up to prefill_batch (a group is split into them, unpadded).
        self.prefill_sizes = tuple(sorted({min(2**k, prefill_batch) for k in range(prefill_batch.bit_length())},
                                          reverse=True))
        self.model, self.tokenizer = model, tokenizer
        self.encoder_decoder = isinstance(model, EncoderDecoderLM)
        if prompt_buckets is None:
            prompt_buckets = default_prompt_buckets(max_length, self.encoder_decoder)
        buckets = tuple(sorted(set(int(b) for b in prompt_buckets)))
        if not buckets or buckets[0] < 1 or (not self.encoder_decoder and buckets[-1] >= max_length):
            raise ValueError(f"prompt_buckets must be >= 1 and (decoder-only models) < max_length {max_length}, "
                             f"got {tuple(prompt_buckets)}")
        self.prompt_buckets, self.max_length, self.max_queue = buckets, max_length, max_queue
        generation = getattr(model, "generation_config", None)
        self._eos_ids = frozenset(generation.eos_token_ids) if generation is not None else frozenset()
        self._decoder = SlotDecoder(model, slots, max_length, steps_per_call,
                                    encoder_length=buckets[-1] if self.encoder_decoder else 0,
                                    suppress=tuple(getattr(generation, "suppress_tokens", None) or ()),
                                    begin_suppress=tuple(getattr(generation, "begin_suppress_tokens", None) or ()),
                                    kernels=kernels)
        self.slots = slots
        widths = sorted({w for w in (1, 4) if w < slots} | {slots}) if step_widths is None else step_widths
        self.step_widths = tuple(sorted(set(int(w) for w in widths)))
        if self.step_widths[0] < 1 or self.step_widths[-1] != slots:
            raise ValueError(f"step_widths must be >= 1 and end with slots={slots}, got {tuple(widths)}")
        self._prompts = Prompts(model, tokenizer, buckets)
        # Every slot's prompt ends at the write column, so it never starts left of the longest prompt.
        self._start_column = DECODER_PROMPT_ROOM if self.encoder_decoder else buckets[-1]
        self._index = self._start_column
        self._rng = np.random.default_rng()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._active: dict[int, _Request] = {}
        self._chunked: _Chunked | None = None
        self._options = self._idle_options()
        self._lock = threading.Condition()  # guards _waiting, _closing; wakes the engine thread
        self._device = threading.Lock()  # one user of the slots at a time (the engine thread, warmup)
        self._thread: threading.Thread | None = None
        self._closing = self._drain = False
        self._counters = collections.Counter()
        self._warm = False

    # -- public API -----------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Requests it holds at once: one per slot and a full queue."""
        return self.slots + self.max_queue

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt it takes (an encoder-decoder model's encoder input: its largest bucket)."""
        return self.prompt_buckets[-1] if self.encoder_decoder else self.max_length - 1

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

    def warmup(self, prompts: Sequence | None = None, buckets: Sequence[int] | None = None) -> float:
        """Compiles the prefill, chunk and insert programs of prompt buckets, the steps, the shift and the move, so
        that no request waits for a compile (a bucket not warmed compiles when its first prompt comes).

        Args:
            prompts: Example prompts whose prefill programs to compile (a speech model needs an example of its
                features); default: one of each length in `buckets`.
            buckets: Prompt lengths whose buckets to compile (default: every bucket).

        Returns:
            The seconds it took.

        Raises:
            RuntimeError: while requests are running or waiting.
            ValueError: for a length beyond the largest bucket.
        """
        started = time.perf_counter()
        if prompts is not None:
            examples = prompts
        else:
            lengths = self.prompt_buckets if buckets is None else sorted({bucket_of(int(b), self.prompt_buckets)
                                                                          for b in buckets})
            examples = [[0] * length for length in lengths]
        with self._device:
            if self._active or self._waiting:
                raise RuntimeError("Engine.warmup runs before requests arrive (requests are running or waiting)")
            for prompt in examples:
                prepared = self._prompts.prepare(prompt)
                for size in self.prefill_sizes[::-1]:
                    ids, mask, extra, options = self._batch([prepared] * size, [RequestOptions()] * size,
                                                            [_seed_words(0)] * size)
                    prefilled, _ = self._decoder.prefill(ids, mask, extra, options)
                    self._decoder.insert(prefilled, ids, mask, 0, self._index, row=size - 1)
                if not self.encoder_decoder and self.prefill_chunk is not None and \
                        prepared.ids.shape[1] > self.prefill_chunk:
                    ids, mask, _, options = self._batch([prepared], [RequestOptions()], [_seed_words(0)])
                    self._decoder.prefill_chunk(ids, mask, 0, self.prefill_chunk, None, options)
            for width in self.step_widths:
                for steps in sorted({1, self._decoder.steps_per_call}):
                    self._decoder.step(self._index, self._width_options(width), width, steps=steps)
            self._decoder.shift(1, self._index)
            if len(self.step_widths) > 1:
                self._decoder.move(1, 0)
        self._warm = True
        return time.perf_counter() - started

    def stream(self, prompt, **options) -> EventStream:
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
            ContextTooLong: (a ValueError) when the prompt's tokens plus `max_new_tokens` exceed `max_length`.
            QueueFull: when `max_queue` requests are waiting.
            EngineClosed: after `close`.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def deliver(event: TokenEvent) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        return EventStream(self, self._submit(prompt, RequestOptions.from_kwargs(**options), deliver), queue)

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
            `requests_finished` (a dict by finish reason), `prefills`, `steps` (step calls), `multi_steps`
            (step calls of `steps_per_call` tokens), `prefill_chunks` (chunks of long prompts run), `shifts`,
            `moves` (requests packed into lower slots for a narrower step), `compiles` (programs traced and
            compiled so far), `cache_bytes` (the slots' KV cache, masks and histories), `warm`
            (whether `warmup` ran), `running` (the engine thread is alive).
        """
        with self._lock:
            counters = dict(self._counters)
            return {"queue_depth": len(self._waiting), "active_slots": len(self._active), "slots": self.slots,
                    "tokens_generated": counters.get("tokens", 0),
                    "requests_submitted": counters.get("submitted", 0),
                    "requests_finished": {reason: counters.get(reason, 0) for reason in FINISH_REASONS},
                    "prefills": counters.get("prefills", 0), "steps": counters.get("steps", 0),
                    "multi_steps": counters.get("multi_steps", 0),
                    "prefill_chunks": counters.get("prefill_chunks", 0),
                    "shifts": counters.get("shifts", 0), "moves": counters.get("moves", 0),
                    "compiles": self._decoder.compiles, "cache_bytes": self._decoder.cache_bytes,
                    "warm": self._warm, "running": self._thread is not None and self._thread.is_alive()}

    # -- requests -------------------------------------------------------------------------------------

    def _submit(self, prompt, options: RequestOptions, deliver) -> _Request:
        if options.num_beams > 1:
            raise ValueError(f"num_beams={options.num_beams}: the slot engine decodes one beam per request; "
                             "run beam search with xlagen.CompiledGenerator")
        vocab = self.model.config.vocab_size
        for token_id in options.stop_token_ids:
            if token_id >= vocab:
                raise ValueError(f"stop_token_ids holds {token_id}, outside the vocabulary [0, {vocab})")
        try:
            prepared = self._prompts.prepare(prompt)
        except ContextTooLong as error:  # past the largest bucket: name max_length when that is what it exceeds
            if not self.encoder_decoder and error.prompt_tokens >= self.max_length:
                raise ContextTooLong(error.prompt_tokens, None, self.max_length) from None
            raise
        if prepared.ids.shape[1] > self._start_column:
            raise ValueError(f"a decoder prompt of {prepared.ids.shape[1]} tokens is longer than the "
                             f"{self._start_column} the slots leave for it")
        room = self.max_length - prepared.real_length
        if room < 1:
            raise ContextTooLong(prepared.real_length, None, self.max_length)
        budget = room if options.max_new_tokens is None else options.max_new_tokens
        if budget > room:
            raise ContextTooLong(prepared.real_length, budget, self.max_length)
        seed = options.seed if options.seed is not None else int(self._rng.integers(0, 2**63 - 1))
        now = time.monotonic()
        text = TokenText(self.tokenizer, prepared.context, self._eos_ids | set(options.stop_token_ids), options.stop)
        request = _Request(prepared, options, _seed_words(seed), budget, deliver, text,
                           now, None if options.deadline is None else now + options.deadline)
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
                    while not (self._waiting or self._active or self._chunked or self._closing):
                        self._lock.wait()
                    if self._closing and not (self._drain and (self._waiting or self._active or self._chunked)):
                        break
                with self._device:
                    self._iterate()
        except Exception:  # a failing program must not leave consumers waiting forever
            logger.exception("the serving engine stopped on an error")
            with self._lock:
                self._closing = True  # later submissions raise EngineClosed
            raise
        finally:
            self._finish_all("cancelled")

    def _iterate(self) -> None:
        now = time.monotonic()
        running = list(self._active.values()) + ([self._chunked.request] if self._chunked else [])
        for request in running:
            if request.cancelled:
                self._finish(request, "cancelled")
            elif request.deadline_at is not None and now >= request.deadline_at:
                self._finish(request, "deadline")
        self._admit(now)
        if self._chunked is not None:
            self._prefill_chunk()
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
        free = [slot for slot in range(self.slots) if slot not in self._active and slot != self._chunked_slot()]
        admitted, held = [], []
        while len(admitted) < len(free):
            request = self._take_waiting(now)
            if request is None:
                break
            if self._chunks(request):
                if self._chunked is not None:
                    held.append(request)  # one long prompt at a time; the shorter ones behind it go on
                    continue
                self._start_chunks(request, free.pop(0))
                continue
            admitted.append(request)
        if held:
            with self._lock:
                self._waiting.extendleft(reversed(held))
        groups: dict[tuple, list[_Request]] = {}  # by shapes: the prompts of one prefill program
        for request in admitted:
            prepared = request.prepared
            key = (prepared.ids.shape, *((name, value.shape) for name, value in sorted(prepared.extra.items())))
            groups.setdefault(key, []).append(request)
        for group in groups.values():
            while group:
                size = next(size for size in self.prefill_sizes if size <= len(group))
                batch, group = group[:size], group[size:]
                self._prefill(batch, [free.pop(0) for _ in batch])
        with self._lock:  # expire what still waits
            expired = [r for r in self._waiting if r.cancelled or (r.deadline_at is not None and now >= r.deadline_at)]
            for request in expired:
                self._waiting.remove(request)
        for request in expired:
            self._finish(request, "cancelled" if request.cancelled else "deadline")

    def _chunked_slot(self) -> int | None:
        return None if self._chunked is None else self._chunked.slot

    def _chunks(self, request: _Request) -> bool:
        """Whether `request`'s prompt prefills in chunks between steps: a decoder-only prompt of a bucket longer
        than `prefill_chunk`, while other requests decode (or another prompt is in chunks)."""
        return (self.prefill_chunk is not None and not self.encoder_decoder
                and request.prepared.ids.shape[1] > self.prefill_chunk and bool(self._active or self._chunked))

    def _start_chunks(self, request: _Request, slot: int) -> None:
        """Reserves `slot` for `request` and plans its chunks: from the chunk holding its first real token to the
        end of its bucket, the last one ending at the bucket's end (overlapping the one before)."""
        ids, mask, _, options = self._batch([request.prepared], [request.options], [request.seed])
        offsets = schedule.chunk_offsets(ids.shape[1], request.prepared.real_length, self.prefill_chunk)
        self._chunked = _Chunked(request, slot, ids, mask, options, offsets)

    def _prefill_chunk(self) -> None:
        """Runs the next chunk of the prompt being prefilled; after its last, the request joins its slot and gets
        its first token."""
        chunked = self._chunked
        offset = chunked.offsets.pop(0)
        chunked.result, (tokens, logprobs, top_ids, top_logprobs) = self._decoder.prefill_chunk(
            chunked.ids, chunked.mask, offset, self.prefill_chunk, chunked.result, chunked.options,
            self._alternatives([chunked.request]))
        self._counters["prefill_chunks"] += 1
        if chunked.offsets:
            return
        self._chunked = None
        self._join(chunked.request, chunked.slot, chunked.result, chunked.ids, chunked.mask, row=0)
        self._counters["prefills"] += 1
        self._emit(chunked.request, int(tokens[0]), float(logprobs[0]), top_ids[0], top_logprobs[0])

    def _join(self, request: _Request, slot: int, prefilled, ids: np.ndarray, mask: np.ndarray, row: int) -> None:
        """Inserts row `row` of a prefill into `slot`, where `request` decodes from the next step."""
        self._decoder.insert(prefilled, ids, mask, slot, self._index, row=row)
        request.slot, request.start = slot, self._index - request.prepared.real_length
        self._active[slot] = request
        self._set_options(slot, request)

    def _batch(self, prepared: list[Prepared], options: list[RequestOptions], seeds: list[np.ndarray]):
        """The prompts and options of one prefill program: `(ids, mask, extra, RowOptions)` with a row each."""
        extra = {name: np.concatenate([p.extra[name] for p in prepared]) for name in prepared[0].extra}
        rows = [self._row_options(o, seed, 0) for o, seed in zip(options, seeds)]
        return (np.concatenate([p.ids for p in prepared]), np.concatenate([p.mask for p in prepared]), extra,
                RowOptions(*(np.concatenate(column) for column in zip(*rows))))

    def _prefill(self, requests: list[_Request], slots: list[int]) -> None:
        """Prefills `requests` (prompts of one shape) in one program, inserts them into `slots`, and sends each
        its first token."""
        ids, mask, extra, options = self._batch([r.prepared for r in requests], [r.options for r in requests],
                                                [r.seed for r in requests])
        prefilled, (tokens, logprobs, top_ids, top_logprobs) = self._decoder.prefill(
            ids, mask, extra, options, self._alternatives(requests))
        for row, (request, slot) in enumerate(zip(requests, slots)):
            self._join(request, slot, prefilled, ids, mask, row)
        self._counters["prefills"] += len(requests)
        for row, request in enumerate(requests):
            self._emit(request, int(tokens[row]), float(logprobs[row]), top_ids[row], top_logprobs[row])

    @staticmethod
    def _alternatives(requests) -> int:
        """How many top tokens a program must report for `requests`: all that any request may ask for, so that
        one program (per shape) serves every request that asks for some."""
        return MAX_TOP_LOGPROBS if any(request.options.top_logprobs for request in requests) else 0

    def _compact(self) -> None:
        """Moves the requests in the highest slots into free lower ones when that lets a narrower step program
        decode them all (a lone request left in slot 15 would otherwise pay for 16 rows)."""
        for source, target in schedule.compaction(self.step_widths, self._active, self._chunked_slot()):
            self._decoder.move(source, target)
            request = self._active.pop(source)
            request.slot = target
            self._active[target] = request
            for column in self._options:
                column[target] = column[source]
            self._reset_options(source)
            self._counters["moves"] += 1

    def _steps(self) -> int:
        """Tokens per slot in the next step call: `steps_per_call` unless a request waits for a free slot, a
        long prompt is being prefilled in chunks, or an active request has fewer tokens left to generate."""
        with self._lock:
            waiting = bool(self._waiting)
        return schedule.steps_per_call(
            self._decoder.steps_per_call, waiting, self.slots - len(self._active) - (self._chunked is not None),
            self._chunked is not None, (request.budget - len(request.token_ids) for request in self._active.values()))

    def _step(self) -> None:
        decoder, steps = self._decoder, self._steps()
        amount = schedule.shift_amount(self._index, steps, decoder.length, (r.start for r in self._active.values()),
                                       self._start_column)
        if amount:
            decoder.shift(amount, self._index)
            self._index -= amount
            for request in self._active.values():
                request.start -= amount
            self._counters["shifts"] += 1
        self._compact()
        width = schedule.step_width(self.step_widths, self._active)
        tokens, logprobs, top_ids, top_logprobs = decoder.step(self._index, self._width_options(width), width,
                                                               self._alternatives(self._active.values()), steps)
        self._index += steps
        self._counters["steps"] += 1
        self._counters["multi_steps"] += steps > 1
        for slot, request in list(self._active.items()):
            for step, (token, logprob) in enumerate(zip(tokens[slot], logprobs[slot])):
                self._emit(request, int(token), float(logprob), top_ids[slot, step], top_logprobs[slot, step])
                if request.finished:
                    break

    def _emit(self, request: _Request, token: int, logprob: float, top_ids: np.ndarray,
              top_logprobs: np.ndarray) -> None:
        """Hands one new token to the request's consumer; ends the request when it is done."""
        request.token_ids.append(token)
        request.logprobs.append(logprob)
        top = None
        if request.options.top_logprobs:
            wanted = request.options.top_logprobs
            top = tuple((int(i), float(lp)) for i, lp in zip(top_ids[:wanted], top_logprobs[:wanted]))
            request.top_logprobs.append(top)
        self._options.step[request.slot] += 1
        with self._lock:
            self._counters["tokens"] += 1
        text, stopped = request.text.add(token)
        finish = "stop" if stopped else "length" if len(request.token_ids) >= request.budget else None
        if finish == "length":  # the held-back text may complete a stop string
            rest, stopped = request.text.finish()
            text, finish = text + rest, "stop" if stopped else finish
        self._deliver(request, TokenEvent(token, text, logprob if request.options.logprobs else None, finish, top))
        if finish is not None:
            self._finish(request, finish, event=False)

    def _deliver(self, request: _Request, event: TokenEvent) -> None:
        if event.text:
            request.pieces.append(event.text)
        if event.finish_reason is not None:
            logprobs = tuple(request.logprobs) if request.options.logprobs else None
            top = tuple(request.top_logprobs) if request.options.top_logprobs else None
            request.completion = Completion("".join(request.pieces), tuple(request.token_ids), event.finish_reason,
                                            request.prepared.prompt_tokens, len(request.token_ids), logprobs, top)
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
            text = request.text.finish()[0] if reason == "deadline" else ""
            self._deliver(request, TokenEvent(None, text, None, reason))
        request.finished = True
        if self._chunked is not None and self._chunked.request is request:
            self._chunked = None
        if request.slot is not None and self._active.get(request.slot) is request:
            del self._active[request.slot]
            self._reset_options(request.slot)
        with self._lock:
            self._counters[reason] += 1

    def _finish_all(self, reason: str) -> None:
        with self._lock:
            waiting, self._waiting = list(self._waiting), collections.deque()
        chunked = [self._chunked.request] if self._chunked else []
        for request in list(self._active.values()) + chunked + waiting:
            self._finish(request, reason)

    # -- per-slot options -----------------------------------------------------------------------------

    def _width_options(self, width: int) -> RowOptions:
        return RowOptions(*(column[:width] for column in self._options))

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
