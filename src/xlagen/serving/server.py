"""An OpenAI-compatible HTTP server on xlagen's serving backends (FastAPI; run it with uvicorn).

`create_app` takes the backends already built: `text` (the slot `Engine`, or a `RequestBatcher`) serves
completions with one beam, `beams` (a `RequestBatcher`) those with `num_beams > 1`, `speech` (a
`TranscriptionBatcher`) the audio route. The app starts them and warms them up when it starts (`/health`
answers 503 until the warm-up has finished), and closes them when it stops, after the requests in flight
(uvicorn stops accepting connections on SIGTERM and waits for them: a graceful drain).

Protection: a request body over `max_body_bytes` gets 413; with an API key, `/v1/*` needs
`Authorization: Bearer KEY` (401 otherwise; compared in constant time); a full queue gives 429 with
`Retry-After`; a request that outlives `request_timeout` is ended (504, or an error event when streaming);
a client that disconnects cancels its request, freeing its slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from xlagen.serving import protocol
from xlagen.serving.streams import ContextTooLong, EngineClosed, QueueFull
from xlagen.serving.metrics import CONTENT_TYPE, ServingMetrics
from xlagen.serving.protocol import RequestError

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """How the server behaves.

    Attributes:
        model_name: The id `/v1/models` lists and requests may name.
        api_key: Required as `Authorization: Bearer ...` on `/v1/*` when set.
        max_body_bytes: Larger request bodies get 413.
        request_timeout: Seconds a request may take (its deadline); None for no limit.
        max_n: Largest `n` (choices per prompt) accepted.
        retry_after: Seconds announced in `Retry-After` with a 429.
    """

    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 25 * 1024 * 1024
    request_timeout: float | None = 600.0
    max_n: int = 8
    retry_after: int = 1


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


class _BodyTooLarge(Exception):
    pass


class _Guard:
    """ASGI middleware: the body size limit (413) and the API key of `/v1/*` (401)."""

    def __init__(self, app, settings: ServerSettings, on_response: Callable[[str, int], None]):
        self.app, self.settings, self.on_response = app, settings, on_response

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.on_response(scope["path"], message["status"])
            await send(message)

        started = False
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.settings.api_key is not None and scope["path"].startswith("/v1"):
            given = headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                     self.settings.api_key.encode()):
                return await _error(RequestError("a valid API key is required: Authorization: Bearer KEY",
                                                 status=401, error_type="authentication_error",
                                                 code="invalid_api_key"))(scope, receive, tracking_send)
        limit = self.settings.max_body_bytes
        too_large = RequestError(f"the request body exceeds {limit} bytes", status=413, code="request_too_large")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await _error(too_large)(scope, receive, tracking_send)
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await _error(too_large)(scope, receive, tracking_send)


def _error(error: RequestError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


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
        self.warmup_error: BaseException | None = None

    # lifecycle
    def start(self) -> None:
        for backend in self.backends.named().values():
            backend.start()

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

    # routes
    def health(self) -> Response:
        if self.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if self.warmup_error is not None:
            return JSONResponse({"status": "warm-up failed", "error": str(self.warmup_error)}, status_code=503)
        if not self.ready.is_set():
            return JSONResponse({"status": "warming up"}, status_code=503)
        return JSONResponse({"status": "ok"})

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "xlagen"}]}

    def _check_model(self, body: dict) -> None:
        name = body.get("model")
        if name is not None and name != self.settings.model_name:
            raise RequestError(f"the model '{name}' does not exist; this server serves '{self.settings.model_name}'",
                               "model", status=404, code="model_not_found")

    def _vocab_size(self) -> int:
        return len(self.tokenizer)

    async def completions(self, request: Request) -> Response:
        body = protocol.check_fields(await _json_body(request), protocol.COMMON_FIELDS | {
            "prompt", "echo", "best_of", "suffix"})
        self._check_model(body)
        protocol._neutral(body, "echo", (None, False))
        protocol._neutral(body, "suffix", (None, ""))
        logprobs = body.get("logprobs")
        if logprobs is not None and (isinstance(logprobs, bool) or logprobs != 0):
            raise RequestError("logprobs: only 0 is supported (the chosen tokens' log-probabilities, without "
                               f"alternatives), got {logprobs!r}", "logprobs")
        sampling = protocol.parse_sampling(body, max_n=self.settings.max_n, vocab_size=self._vocab_size(),
                                           logprobs=logprobs is not None)
        if body.get("best_of") not in (None, sampling.n):
            raise RequestError(f"best_of must equal n ({sampling.n}) when given, got {body['best_of']!r}", "best_of")
        prompts = protocol.parse_prompts(body, self._vocab_size())
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
        if body.get("top_logprobs") not in (None, 0):
            raise RequestError("top_logprobs: only 0 is supported (no alternatives are reported)", "top_logprobs")
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        sampling = protocol.parse_sampling(body, max_n=self.settings.max_n, vocab_size=self._vocab_size(),
                                           logprobs=logprobs, max_tokens_name=name, default_max_tokens=None)
        messages = _check_messages(body.get("messages"))
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as error:  # noqa: BLE001 - a template error (raise_exception) is the request's fault
            raise RequestError(f"the chat template failed on these messages: {error}", "messages") from None
        return await self._respond(request, "chat.completion", [list(ids)], sampling)

    def _jobs(self, prompts: list, sampling: protocol.Sampling) -> list[_Job]:
        backend = self.backends.beams if sampling.num_beams > 1 else self.backends.text
        if backend is None:
            raise RequestError("num_beams > 1 is not served by this server" if sampling.num_beams > 1
                               else "this server serves no text model", "num_beams" if sampling.num_beams > 1
                               else None)
        return [_Job(p * sampling.n + j, prompt, backend, sampling.options(j, self.settings.request_timeout))
                for p, prompt in enumerate(prompts) for j in range(sampling.n)]

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
        work = asyncio.ensure_future(asyncio.gather(*(job.backend.generate(job.prompt, **job.options)
                                                      for job in jobs)))
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

    def _choice(self, kind: str, index: int, completion) -> dict:
        reason = completion.finish_reason
        if kind == "chat.completion":
            logprobs = None if completion.logprobs is None else protocol.chat_logprobs(
                self.tokenizer, completion.token_ids, completion.logprobs)
            return {"index": index, "message": {"role": "assistant", "content": completion.text},
                    "logprobs": logprobs, "finish_reason": reason}
        logprobs = None
        if completion.logprobs is not None:
            texts = [self.tokenizer.decode([i], skip_special_tokens=True) for i in completion.token_ids]
            logprobs = protocol.completion_logprobs(self.tokenizer, completion.token_ids, texts, completion.logprobs)
        return {"index": index, "text": completion.text, "logprobs": logprobs, "finish_reason": reason}

    async def _stream(self, request: Request, kind: str, jobs: list[_Job], sampling: protocol.Sampling,
                      arrived: float) -> Response:
        streams = [job.backend.stream(job.prompt, **job.options) for job in jobs]
        firsts = [asyncio.ensure_future(s.__anext__()) for s in streams]
        try:
            first_events = await _until_disconnected(request, asyncio.ensure_future(asyncio.gather(*firsts)))
        except BaseException:
            for task in firsts:
                task.cancel()
            await asyncio.gather(*firsts, return_exceptions=True)
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
                    yield self._sse(kind, response_id, created, job.index, event.text, event, None)
                if event.finish_reason is not None:
                    finished += 1
                    yield self._sse(kind, response_id, created, job.index, "" if kind == "text_completion" else {},
                                    None, event.finish_reason)
            if sampling.include_usage:
                prompt_tokens = await self._prompt_tokens(jobs, sampling)
                chunk = protocol.envelope(kind, response_id, self.settings.model_name, [], created)
                chunk["usage"] = protocol.usage(prompt_tokens, usage["completion"])
                yield _sse_data(chunk)
            yield "data: [DONE]\n\n"
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)

    async def _prompt_tokens(self, jobs: list[_Job], sampling: protocol.Sampling) -> int:
        return sum(len(job.prompt) if not isinstance(job.prompt, str) else len(self.tokenizer.encode(job.prompt))
                   for job in jobs if job.index % sampling.n == 0)

    def _sse(self, kind: str, response_id: str, created: int, index: int, content, event, reason) -> str:
        if kind == "chat.completion.chunk":
            delta = content if isinstance(content, dict) else {"content": content}
            logprobs = None if event is None or event.logprob is None else protocol.chat_logprobs(
                self.tokenizer, [event.token_id], [event.logprob])
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            logprobs = None if event is None or event.logprob is None else protocol.completion_logprobs(
                self.tokenizer, [event.token_id], [event.text], [event.logprob])
            choice = {"index": index, "text": content, "logprobs": logprobs, "finish_reason": reason}
        return _sse_data(protocol.envelope(kind, response_id, self.settings.model_name, [choice], created))

    def render_metrics(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)


def _sse_data(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


_ROLES = ("system", "developer", "user", "assistant", "tool")


def _check_messages(messages) -> list[dict]:
    """Chat messages as the template expects them: role and text content (text parts joined)."""
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
        checked.append({**message, "content": content})
    return checked


def create_app(backends: Backends, settings: ServerSettings) -> FastAPI:
    """The server's ASGI app (run it with uvicorn: one process, the backends' threads do the work).

    Args:
        backends: What serves the routes (see `Backends`); started, warmed up and closed by the app.
        settings: Limits and the API key.

    Returns:
        The FastAPI app; `app.state.server` holds its state (`ready`, `metrics`, `backends`).
    """
    state = _App(backends, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.start()
        warmup = asyncio.ensure_future(asyncio.to_thread(state.warm_up))
        try:
            yield
        finally:
            state.draining = True
            await asyncio.gather(warmup, return_exceptions=True)
            await asyncio.to_thread(state.close)

    app = FastAPI(title="xlagen", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state

    @app.exception_handler(RequestError)
    async def request_error(request: Request, error: RequestError):
        return _error(error)

    @app.exception_handler(QueueFull)
    async def queue_full(request: Request, error: QueueFull):
        return _error(RequestError(f"the server is busy: {error}", status=429, error_type="rate_limit_error",
                                   code="queue_full"), headers={"Retry-After": str(settings.retry_after)})

    @app.exception_handler(EngineClosed)
    async def closed(request: Request, error: EngineClosed):
        return _error(RequestError(f"the server is shutting down: {error}", status=503, error_type="server_error",
                                   code="shutting_down"))

    @app.exception_handler(ValueError)
    async def bad_value(request: Request, error: ValueError):  # the engine's checks of a request (prompt too long)
        return _error(RequestError(str(error)))

    @app.exception_handler(TypeError)
    async def bad_type(request: Request, error: TypeError):
        return _error(RequestError(str(error)))

    app.add_api_route("/health", state.health, methods=["GET"])
    app.add_api_route("/metrics", state.render_metrics, methods=["GET"])
    app.add_api_route("/v1/models", state.models, methods=["GET"])
    app.add_api_route("/v1/completions", state.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", state.chat, methods=["POST"])
    if backends.speech is not None:
        from xlagen.serving.speech import add_transcription_route

        add_transcription_route(app, state, backends.speech)
    routes = {route.path for route in app.routes}

    def count(path: str, status: int) -> None:  # unknown paths share one label: no label per probe of a scanner
        state.metrics.requests.labels(path if path in routes else "other", str(status)).inc()

    app.add_middleware(_Guard, settings=settings, on_response=count)
    return app
