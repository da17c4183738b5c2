"""An OpenAI-compatible HTTP server on xlagen's serving backends (FastAPI; run it with
`xlagen.serving.http.server_for`, or uvicorn).

`create_app` takes the backends already built: `text` (the slot `Engine`, or a `RequestBatcher`) serves
completions with one beam, `beams` (a `RequestBatcher`) those with `num_beams > 1`, `speech` (a
`TranscriptionBatcher`) the audio routes. The app starts them and warms them up when it starts (`/health`
answers 503 until the warm-up has finished), and closes them when it stops, after the requests in flight
(uvicorn stops accepting connections on SIGTERM and waits for them: a graceful drain).

Protection: `xlagen.serving.guard` checks Host, Origin, the API key, Content-Type and the body (size, time)
before a route runs. A route never does work on the event loop that grows with its input: prompts are
capped in characters, then tokenized (and chat templates rendered) on a small thread pool. A request that
can never fit the backend's slots and queue is 400; a full queue gives 429 with `Retry-After`; a request that
outlives `request_timeout` is ended (504, or an error event when streaming); a client that disconnects
cancels its request, freeing its slot; a request whose prompts partly fail to enter the queue cancels the
rest at once. Every error, the framework's own 404, 405 and 422 included, is OpenAI's error JSON.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from xlagen.serving import protocol
from xlagen.serving.errors import install_error_handlers
from xlagen.serving.guard import JSON, MULTIPART, Guard
from xlagen.serving.metrics import CONTENT_TYPE, ServingMetrics
from xlagen.serving.options import MAX_TOP_LOGPROBS
from xlagen.serving.protocol import RequestError
from xlagen.serving.settings import ServerSettings
from xlagen.serving.streams import ContextTooLong
from xlagen.serving.text import TokenPieces

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Backends:
    """What serves the routes: see the module docstring. `warmup` runs on a thread when the app starts."""

    tokenizer: Any
    text: Any = None
    beams: Any = None
    speech: Any = None
    warmup: Callable[[], None] | None = None

    def named(self) -> dict[str, Any]:
        unique: dict[int, tuple[str, Any]] = {}
        for name in ("text", "beams", "speech"):
            backend = getattr(self, name)
            if backend is not None and id(backend) not in unique:
                unique[id(backend)] = (name, backend)
        return dict(unique.values())


async def _json_body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(f"the request body is not valid JSON: {error}") from None


async def _until_disconnected(request: Request, work: asyncio.Task):
    """Awaits `work`, cancelling it if the client disconnects first."""
    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            work.cancel()
            raise asyncio.CancelledError("the client disconnected")
        return work.result()
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()


async def _all_or_none(awaitables: list[Awaitable]) -> list:
    """The results of `awaitables`, run together; the first to fail cancels the others at once (a request whose
    third prompt is refused does not go on decoding the first two)."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclasses.dataclass
class _Job:
    """One choice of a request: which prompt, which backend, which options."""

    index: int
    prompt: Any
    backend: Any
    options: dict


class _App:
    """The routes' state and handlers (see `create_app`)."""

    def __init__(self, backends: Backends, settings: ServerSettings):
        self.backends, self.settings = backends, settings
        self.tokenizer = backends.tokenizer
        self.metrics = ServingMetrics(backends.named)
        self.ready = threading.Event()
        self.draining = False
        self.drain_event: asyncio.Event | None = None
        self.warmup_error: BaseException | None = None
        # Tokenizing and rendering chat templates: off the event loop, two at a time at most.
        self._text_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="xlagen-tokenize")
        self._pieces: TokenPieces | None = None
        self.max_prompt_chars = self._prompt_char_limit()

    def _prompt_char_limit(self) -> int:
        """Characters a text prompt may have: as many as the longest prompt the text backends take could hold,
        each token at its longest, so no prompt that fits is refused and a 10 MB one is never tokenized."""
        limits = [getattr(backend, "max_prompt_tokens", None) for backend in (self.backends.text, self.backends.beams)
                  if backend is not None]
        tokens = max([limit for limit in limits if limit] or [0])
        vocab = self.tokenizer.get_vocab() if tokens and hasattr(self.tokenizer, "get_vocab") else {}
        longest = max((len(token) for token in vocab), default=16)
        return max(tokens * longest, 1)

    # lifecycle
    def start(self) -> None:
        self.drain_event = asyncio.Event()
        for backend in self.backends.named().values():
            backend.start()

    def begin_drain(self) -> None:
        """The server stops taking connections: `/health` says so, and bodies still arriving are refused."""
        self.draining = True
        if self.drain_event is not None:
            self.drain_event.set()

    def warm_up(self) -> None:
        started = time.perf_counter()
        try:
            if self.backends.warmup is not None:
                self.backends.warmup()
            self.ready.set()
            logger.info("ready: warm-up took %.1f s", time.perf_counter() - started)
        except Exception as error:  # noqa: BLE001 - reported by /health, the server keeps serving
            self.warmup_error = error
            logger.error("warm-up failed: %s", error)

    def close(self) -> None:
        for backend in self.backends.named().values():
            backend.close(drain=True)
        self._text_pool.shutdown(wait=False, cancel_futures=True)

    # routes
    def health(self) -> Response:
        if self.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if self.warmup_error is not None:
            return JSONResponse({"status": "warm-up failed", "error": str(self.warmup_error)}, status_code=503)
        if not self.ready.is_set():
            return JSONResponse({"status": "warming up"}, status_code=503)
        return JSONResponse({"status": "ok"})

    def _model_card(self) -> dict:
        return {"id": self.settings.model_name, "object": "model", "created": 0, "owned_by": "xlagen"}

    def models(self) -> dict:
        return {"object": "list", "data": [self._model_card()]}

    def model(self, model_id: str) -> dict:
        self._check_model({"model": model_id})
        return self._model_card()

    def _check_model(self, body: dict) -> None:
        name = body.get("model")
        if name is not None and name != self.settings.model_name:
            raise RequestError(f"the model '{name}' does not exist; this server serves '{self.settings.model_name}'",
                               "model", status=404, error_type="not_found_error", code="model_not_found")

    def _vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def pieces(self) -> TokenPieces:
        if self._pieces is None:
            self._pieces = TokenPieces(self.tokenizer)
        return self._pieces

    async def _off_loop(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self._text_pool, function, *args)

    def _check_chars(self, text: str, param: str) -> None:
        if len(text) > self.max_prompt_chars:
            raise RequestError(f"the {param} has {len(text)} characters, more than the {self.max_prompt_chars} the "
                               "longest prompt this server takes can hold: shorten it", param,
                               code="context_length_exceeded")

    async def _tokenized(self, prompts: list) -> list[list[int]]:
        """Text prompts as ids (capped in characters, encoded off the event loop); id prompts as they are."""
        for prompt in prompts:
            if isinstance(prompt, str):
                self._check_chars(prompt, "prompt")
        texts = [prompt for prompt in prompts if isinstance(prompt, str)]
        if not texts:
            return prompts
        encoded = iter(await self._off_loop(lambda: [self.tokenizer.encode(text) for text in texts]))
        ids = [list(next(encoded)) if isinstance(prompt, str) else prompt for prompt in prompts]
        if any(not row for row in ids):
            raise RequestError("a prompt encodes to no tokens", "prompt")
        return ids

    async def completions(self, request: Request) -> Response:
        body = protocol.check_fields(await _json_body(request), protocol.COMMON_FIELDS | {
            "prompt", "echo", "best_of", "suffix"})
        self._check_model(body)
        protocol._neutral(body, "echo", (None, False))
        protocol._neutral(body, "suffix", (None, ""))
        logprobs = protocol._integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
        sampling = protocol.parse_sampling(body, max_n=self.settings.max_n, vocab_size=self._vocab_size(),
                                           logprobs=logprobs is not None, top_logprobs=logprobs or 0)
        if body.get("best_of") not in (None, sampling.n):
            raise RequestError(f"best_of must equal n ({sampling.n}) when given, got {body['best_of']!r}", "best_of")
        prompts = await self._tokenized(protocol.parse_prompts(body, self._vocab_size()))
        return await self._respond(request, "text_completion", prompts, sampling)

    @staticmethod
    def _too_long(error: ContextTooLong, kind: str, sampling: protocol.Sampling) -> RequestError:
        """A prompt that does not fit, in the API's words (OpenAI's `context_length_exceeded`)."""
        prompt = "messages" if kind == "chat.completion" else "prompt"
        if error.max_new_tokens is None:
            return RequestError(f"this model's maximum context length is {error.limit} tokens, and the {prompt} "
                                f"alone has {error.prompt_tokens}: shorten the {prompt}", prompt,
                                code="context_length_exceeded")
        return RequestError(f"this model's maximum context length is {error.limit} tokens, but {error.prompt_tokens} "
                            f"tokens in the {prompt} + {sampling.max_tokens_name} {error.max_new_tokens} = "
                            f"{error.prompt_tokens + error.max_new_tokens} were requested: shorten the {prompt} or "
                            f"set {sampling.max_tokens_name} to at most {error.limit - error.prompt_tokens}",
                            sampling.max_tokens_name, code="context_length_exceeded")

    async def chat(self, request: Request) -> Response:
        body = protocol.check_fields(await _json_body(request), protocol.COMMON_FIELDS | {
            "messages", "max_completion_tokens", "top_logprobs", "response_format"})
        self._check_model(body)
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(f"the model '{self.settings.model_name}' has no chat template (tokenizer_config.json "
                               "'chat_template' or chat_template.jinja): use /v1/completions", "messages")
        if body.get("response_format") not in (None, {"type": "text"}):
            raise RequestError("response_format: only {\"type\": \"text\"} is supported", "response_format")
        logprobs = protocol._boolean(body, "logprobs", False)
        top_logprobs = protocol._integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
        if top_logprobs and not logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        sampling = protocol.parse_sampling(body, max_n=self.settings.max_n, vocab_size=self._vocab_size(),
                                           logprobs=logprobs, top_logprobs=top_logprobs, max_tokens_name=name,
                                           default_max_tokens=None)
        messages = protocol.parse_messages(body.get("messages"))
        self._check_chars("".join(message["content"] for message in messages), "messages")

        def render() -> list[int]:
            return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

        try:
            ids = await self._off_loop(render)
        except Exception as error:  # noqa: BLE001 - a template error (raise_exception) is the request's fault
            raise RequestError(f"the chat template failed on these messages: {error}", "messages") from None
        return await self._respond(request, "chat.completion", [ids], sampling)

    def _jobs(self, prompts: list, sampling: protocol.Sampling) -> list[_Job]:
        beams = sampling.num_beams > 1
        backend = self.backends.beams if beams else self.backends.text
        if backend is None:
            raise RequestError("num_beams > 1 is not served by this server" if beams
                               else "this server serves no text model", "num_beams" if beams else None)
        if beams and sampling.num_beams not in self.settings.beam_sizes:
            raise RequestError(f"num_beams must be 1 or one of {list(self.settings.beam_sizes)} on this server (each "
                               f"beam width compiles programs of its own), got {sampling.num_beams}", "num_beams")
        jobs = [_Job(p * sampling.n + j, prompt, backend, sampling.options(j, self.settings.request_timeout))
                for p, prompt in enumerate(prompts) for j in range(sampling.n)]
        capacity = getattr(backend, "capacity", None)
        if capacity is not None and len(jobs) > capacity:
            raise RequestError(f"this request needs {len(jobs)} completions at once ({len(prompts)} prompt(s) x n="
                               f"{sampling.n}), more than this server holds (decoding and waiting: {capacity}): send "
                               "fewer prompts or a smaller n", "n" if sampling.n > 1 else "prompt",
                               code="too_many_completions")
        return jobs

    async def _respond(self, request: Request, kind: str, prompts: list, sampling: protocol.Sampling) -> Response:
        try:
            return await self._answer(request, kind, prompts, sampling)
        except ContextTooLong as error:
            raise self._too_long(error, kind, sampling) from None

    async def _answer(self, request: Request, kind: str, prompts: list, sampling: protocol.Sampling) -> Response:
        jobs = self._jobs(prompts, sampling)
        arrived = time.perf_counter()
        if sampling.stream:
            return await self._stream(request, kind, jobs, sampling, arrived)
        work = asyncio.ensure_future(_all_or_none([job.backend.generate(job.prompt, **job.options) for job in jobs]))
        completions = await _until_disconnected(request, work)
        for completion in completions:
            if completion.finish_reason in ("deadline", "cancelled"):
                raise self._ended(completion.finish_reason)
        self.metrics.time_to_first_token.observe(time.perf_counter() - arrived)
        choices = [self._choice(kind, job.index, c) for job, c in zip(jobs, completions)]
        prompt_tokens = sum(c.prompt_tokens for job, c in zip(jobs, completions) if job.index % sampling.n == 0)
        response = protocol.envelope(kind, protocol.new_id("chatcmpl" if kind.startswith("chat") else "cmpl"),
                                     self.settings.model_name, choices)
        response["usage"] = protocol.usage(prompt_tokens, sum(c.completion_tokens for c in completions))
        return JSONResponse(response)

    def _ended(self, reason: str) -> RequestError:
        """The error of a request the backend ended before it finished."""
        if reason == "deadline":
            return RequestError(f"the request did not finish within {self.settings.request_timeout} s", status=504,
                                error_type="timeout_error", code="deadline_exceeded")
        return RequestError("the request was cancelled: the server is shutting down", status=503,
                            error_type="server_error", code="shutting_down")

    def _logprobs(self, kind: str, token_ids, logprobs, alternatives, texts=None, offset: int = 0) -> dict | None:
        if logprobs is None:
            return None
        if kind.startswith("chat"):
            return protocol.chat_logprobs(self.pieces, token_ids, logprobs, alternatives)
        return protocol.completion_logprobs(self.pieces, token_ids, logprobs, alternatives, texts, offset)

    def _choice(self, kind: str, index: int, completion) -> dict:
        logprobs = self._logprobs(kind, completion.token_ids, completion.logprobs, completion.top_logprobs)
        if kind == "chat.completion":
            return {"index": index, "message": {"role": "assistant", "content": completion.text},
                    "logprobs": logprobs, "finish_reason": completion.finish_reason}
        return {"index": index, "text": completion.text, "logprobs": logprobs,
                "finish_reason": completion.finish_reason}

    async def _stream(self, request: Request, kind: str, jobs: list[_Job], sampling: protocol.Sampling,
                      arrived: float) -> Response:
        streams = []
        try:
            for job in jobs:
                streams.append(job.backend.stream(job.prompt, **job.options))
            first = asyncio.ensure_future(_all_or_none([stream.__anext__() for stream in streams]))
            first_events = await _until_disconnected(request, first)
        except BaseException:
            await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
            raise
        chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
        response_id = protocol.new_id("chatcmpl" if kind == "chat.completion" else "cmpl")
        return StreamingResponse(self._events(jobs, streams, first_events, chunk_kind, response_id, sampling,
                                              arrived), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _events(self, jobs, streams, first_events, kind: str, response_id: str, sampling, arrived: float):
        """The server-sent events of a streamed request; cancelling it (a disconnect) cancels every choice."""
        queue: asyncio.Queue = asyncio.Queue()
        created = int(time.time())

        async def pump(number: int):
            last = time.perf_counter()
            self.metrics.time_to_first_token.observe(last - arrived)
            event = first_events[number]
            while True:
                await queue.put((number, event))
                if event.finish_reason is not None:
                    return
                event = await streams[number].__anext__()
                now = time.perf_counter()
                self.metrics.inter_token.observe(now - last)
                last = now

        pumps = [asyncio.ensure_future(pump(i)) for i in range(len(jobs))]
        usage = {"prompt": 0, "completion": 0}
        offsets = [0] * len(jobs)
        try:
            if kind == "chat.completion.chunk":
                for job in jobs:
                    yield self._sse(kind, response_id, created, job.index, {"role": "assistant", "content": ""},
                                    None, None)
            finished = 0
            while finished < len(jobs):
                number, event = await queue.get()
                job = jobs[number]
                usage["completion"] += event.token_id is not None
                if event.finish_reason in ("deadline", "cancelled"):
                    yield _sse_data(self._ended(event.finish_reason).body())
                    break
                if event.text or event.logprob is not None:
                    logprobs = None if event.logprob is None else self._logprobs(
                        kind, [event.token_id], [event.logprob],
                        None if event.top_logprobs is None else [event.top_logprobs], [event.text], offsets[number])
                    offsets[number] += len(event.text)
                    yield self._sse(kind, response_id, created, job.index, event.text, logprobs, None)
                if event.finish_reason is not None:
                    finished += 1
                    yield self._sse(kind, response_id, created, job.index, "" if kind == "text_completion" else {},
                                    None, event.finish_reason)
            if sampling.include_usage:
                prompt_tokens = sum(len(job.prompt) for job in jobs if job.index % sampling.n == 0)
                chunk = protocol.envelope(kind, response_id, self.settings.model_name, [], created)
                chunk["usage"] = protocol.usage(prompt_tokens, usage["completion"])
                yield _sse_data(chunk)
            yield "data: [DONE]\n\n"
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)

    def _sse(self, kind: str, response_id: str, created: int, index: int, content, logprobs, reason) -> str:
        if kind == "chat.completion.chunk":
            delta = content if isinstance(content, dict) else {"content": content}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": index, "text": content, "logprobs": logprobs, "finish_reason": reason}
        return _sse_data(protocol.envelope(kind, response_id, self.settings.model_name, [choice], created))

    def render_metrics(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)


def _sse_data(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def create_app(backends: Backends, settings: ServerSettings) -> FastAPI:
    """The server's ASGI app (run it with `xlagen.serving.http.server_for`: one process, the backends' threads
    do the work).

    Args:
        backends: What serves the routes (see `Backends`); started, warmed up and closed by the app.
        settings: Limits, the API key and who may call.

    Returns:
        The FastAPI app; `app.state.server` holds its state (`ready`, `metrics`, `backends`, `begin_drain`).
    """
    state = _App(backends, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.start()
        warmup = asyncio.ensure_future(asyncio.to_thread(state.warm_up))
        try:
            yield
        finally:
            state.begin_drain()
            await asyncio.gather(warmup, return_exceptions=True)
            await asyncio.to_thread(state.close)

    app = FastAPI(title="xlagen", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state

    install_error_handlers(app, settings.retry_after)

    app.add_api_route("/health", state.health, methods=["GET"])
    app.add_api_route("/metrics", state.render_metrics, methods=["GET"])
    app.add_api_route("/v1/models", state.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", state.model, methods=["GET"])
    app.add_api_route("/v1/completions", state.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", state.chat, methods=["POST"])
    if backends.speech is not None:
        from xlagen.serving.speech import add_transcription_route

        add_transcription_route(app, state, backends.speech)
    routes = {route.path for route in app.routes}
    post_types = {route.path: MULTIPART if route.path.startswith("/v1/audio/") else JSON
                  for route in app.routes if "POST" in getattr(route, "methods", ())}

    def count(path: str, status: int) -> None:  # unknown paths share one label: no label per probe of a scanner
        state.metrics.requests.labels(path if path in routes else "other", str(status)).inc()

    if settings.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                           allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"],
                           allow_private_network=True, max_age=600)
    app.add_middleware(Guard, settings=settings, post_types=post_types, on_response=count,
                       draining=lambda: state.drain_event)
    return app
