"""Transcription for the server: concurrent uploads of up to 30 s batched into Whisper's batch buckets, longer
ones through `Transcriber` (its 30 s windows one after the other); and OpenAI's routes
`POST /v1/audio/transcriptions` (multipart: file, model, language, prompt, response_format, temperature,
timestamp_granularities[]) and `POST /v1/audio/translations` (file, model, prompt, response_format,
temperature: speech in any of the model's languages to English text; multilingual models only).

Uploads share a batch when they ask for the same language, task and timestamps; a batch's transcripts are
those `Transcriber` gives for each recording alone (the same features, decoder prompt, language detection
per row and segment rules).

An upload is decoded on a worker thread (`asyncio.to_thread`), a block at a time, and refused (400,
`code: audio_too_long`, `param: file`) when it lasts more than `max_audio_seconds`: from its header before
decoding, else as soon as decoding passes the limit. OpenAI answers 413 for a body over its size limit (as
the server's body limit does here) and 400 `invalid_request_error` for audio longer than a model takes; this
is the latter.
"""

from __future__ import annotations

import asyncio
import io
import math
from typing import Any

import numpy as np

from xlagen.serving.batcher import WorkQueue, await_result
from xlagen.serving.protocol import RequestError
from xlagen.speech.audio import AudioTooLong
from xlagen.speech.transcribe import SAMPLING_RATE, Transcriber, Transcript, render
from xlagen.text.whisper_tokens import LANGUAGES

FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
# An hour of audio: 230 MB of 16 kHz float32 samples per upload while it waits and runs (queued uploads add up),
# and 120 windows to decode within one request's timeout (600 s by default); 25 MiB (the default body limit)
# of 64 kbit/s speech lasts 55 min, while a FLAC of silence that size would last days.
MAX_AUDIO_SECONDS = 3600.0


class TranscriptionBatcher:
    """Batches concurrent transcriptions over one Whisper model (one worker thread).

    Args:
        model: A `TFWhisperForConditionalGeneration`.
        processor: Its `WhisperProcessor`.
        generator: The `CompiledGenerator` to run on (one is made when None).
        max_batch: Most recordings per batch.
        max_queue: Most waiting requests; beyond it `transcribe` raises `QueueFull`.
        max_wait: Seconds to wait for more uploads once one is queued.
        max_audio_seconds: The routes refuse uploads that last longer (see the module docstring); None: no limit.
    """

    def __init__(self, model, processor, *, generator=None, max_batch: int = 8, max_queue: int = 64,
                 max_wait: float = 0.01, max_audio_seconds: float | None = MAX_AUDIO_SECONDS):
        if max_audio_seconds is not None and not max_audio_seconds > 0:
            raise ValueError(f"max_audio_seconds must be > 0 (or None for no limit), got {max_audio_seconds}")
        self.transcriber = Transcriber(model, processor, generator)
        self.model, self.processor = model, processor
        self.max_audio_seconds = max_audio_seconds
        self._queue = WorkQueue(self._run, max_batch=max_batch, max_queue=max_queue, max_wait=max_wait,
                                name="xlagen-transcriber")
        self._submitted = 0
        self._tokens = 0

    def start(self) -> None:
        self._queue.start()

    def close(self, drain: bool = True) -> None:
        self._queue.close(drain)

    def stats(self) -> dict:
        """queue_depth, active_slots (recordings in the running batch), tokens_generated, compiles."""
        return {"queue_depth": self._queue.depth, "active_slots": self._queue.active,
                "tokens_generated": self._tokens, "requests_completed": self._queue.completed,
                "compiles": self.transcriber.generator.compile_count}

    def warmup(self, batch_sizes=(1,)) -> None:
        """Compiles the programs requests can need at these batch sizes: without timestamps (json, text) and with
        them (srt, vtt, verbose_json; audio over 30 s), each with the language detected, given, and translating
        (multilingual models).

        The decoder prompt's length decides the program near the model's positions (detected: start, language,
        <|notimestamps|>; given: start, language, <|transcribe|>, <|notimestamps|>), as timestamps do; option
        sets that share a program run it once more, without compiling.
        """
        noise = np.random.default_rng(0).standard_normal(SAMPLING_RATE).astype(np.float32) * 0.1
        for size in batch_sizes:
            for timestamps in (False, True):
                for language, task in self._warmup_options():
                    self._run([(noise, language, task, timestamps)] * size)

    def _warmup_options(self) -> list[tuple[str | None, str | None]]:
        """(language, task) pairs whose programs may differ: detected, one of the model's languages, translating."""
        options = [(None, None)]
        lang_to_id = self.model.generation_config.lang_to_id or {}
        if lang_to_id and self.model.generation_config.is_multilingual is not False:
            options.append((next(iter(lang_to_id)), None))
            if self.cannot_translate() is None:
                options.append((None, "translate"))
        return options

    def check(self, language: str | None, task: str | None) -> None:
        """Refuses a language or task the model cannot take (ValueError naming it)."""
        from xlagen.generation.api import resolve_config
        from xlagen.speech.whisper_decoding import check_options, language_id

        config = resolve_config(self.model, None, {"language": language, "task": task,
                                                   "decoder_start_token_id": self.transcriber._start_token()})
        check_options(config)
        if language is not None:
            language_id(language, config)

    def cannot_translate(self) -> str | None:
        """Why the model cannot translate (English-only, or no translate task token), or None when it can."""
        config = self.model.generation_config
        if config.is_multilingual is False:
            return "it is English-only (generation_config.json: is_multilingual false)"
        if "translate" not in (config.task_to_id or {}):
            return "its generation_config.json has no translate task token (task_to_id)"
        return None

    async def transcribe(self, samples: np.ndarray, *, language: str | None = None, task: str | None = None,
                         timestamps: bool = False, deadline: float | None = None) -> Transcript:
        """The transcript of 16 kHz mono `samples`.

        Raises:
            QueueFull: If the queue is full.
            ValueError: For a language or task the model does not take.
            TimeoutError: If the deadline passed first.
        """
        self.check(language, task)
        long = len(samples) > self.processor.feature_extractor.n_samples
        self._submitted += 1
        key = ("long", self._submitted) if long else ("short", language, task, timestamps)
        future = self._queue.submit(key, (samples, language, task, timestamps), deadline)
        return await await_result(future, deadline)

    def _run(self, payloads: list) -> list[Transcript]:
        """Transcribes one group on the worker thread: a long recording alone (`Transcriber`), else clips of
        at most 30 s in one `generate` call (`Transcriber.transcribe_clips`)."""
        samples, language, task, timestamps = payloads[0]
        if len(samples) > self.processor.feature_extractor.n_samples:
            transcripts = [self.transcriber(samples, language=language, task=task, return_timestamps=timestamps)]
        else:
            transcripts = self.transcriber.transcribe_clips([payload[0] for payload in payloads], language=language,
                                                            task=task, return_timestamps=timestamps)
        self._tokens += sum(len(segment.tokens) for transcript in transcripts for segment in transcript.segments)
        return transcripts


def decode_upload(file, filename: str, max_seconds: float | None = None) -> np.ndarray:
    """16 kHz mono float32 samples of an uploaded file (wav, flac, ogg, mp3, ... as libsndfile reads them),
    decoded a block at a time (`xlagen.speech.audio.read_audio`); call it off the event loop.

    Args:
        file: The upload: bytes, or a binary file object (Starlette's spooled upload file).
        filename: Its name, for messages.
        max_seconds: Refuse audio that lasts longer (None: no limit).

    Raises:
        RequestError: If the file is empty, not decodable audio, or longer than `max_seconds` (naming it, param
            `file`).
    """
    from xlagen.speech.audio import read_audio

    file = io.BytesIO(file) if isinstance(file, (bytes, bytearray)) else file
    file.seek(0, io.SEEK_END)
    empty = file.tell() == 0
    file.seek(0)
    if empty:
        raise RequestError(f"the uploaded file '{filename}' is empty", "file")
    try:
        samples = read_audio(file, SAMPLING_RATE, max_seconds=max_seconds, name=filename)
    except AudioTooLong as error:
        lasts = f"lasts {error.seconds:.1f} s" if error.seconds is not None else "lasts longer"
        raise RequestError(f"the uploaded file '{filename}' {lasts}; this server transcribes at most "
                           f"{error.max_seconds:g} s of audio per request", "file", code="audio_too_long") from None
    except ValueError as error:
        raise RequestError(f"the uploaded file '{filename}' is not audio this server can decode: {error}",
                           "file") from None
    if not len(samples):
        raise RequestError(f"the uploaded file '{filename}' holds no audio (0 samples)", "file")
    return samples


def _language_name(transcript: Transcript, task: str) -> str | None:
    """The language's name in English, as OpenAI's verbose_json gives it: the audio's, or a translation's
    (always "english")."""
    code = "en" if task == "translate" else transcript.language
    return LANGUAGES.get(code, code)


def format_transcript(transcript: Transcript, response_format: str, task: str) -> tuple[Any, str]:
    """(body, media type) of a transcript in one of OpenAI's response formats.

    A transcription's json and verbose_json carry OpenAI's `usage` of models billed by audio duration:
    `{"type": "duration", "seconds": N}`, the audio's seconds rounded up. Segments carry their window's
    `avg_logprob`, `compression_ratio` and `no_speech_prob` (`xlagen.speech.transcribe.Segment`).
    """
    usage = {"usage": {"type": "duration", "seconds": math.ceil(transcript.duration)}} if task == "transcribe" else {}
    if response_format == "json":
        return {"text": transcript.text, **usage}, "application/json"
    if response_format == "text":
        return transcript.text + "\n", "text/plain"
    if response_format in ("srt", "vtt"):
        return render(transcript, response_format), "text/plain"
    segments = [{"id": i, "seek": round(s.start * 100), "start": round(s.start, 3), "end": round(s.end, 3),
                 "text": s.text, "tokens": list(s.tokens), "temperature": 0.0, "avg_logprob": s.avg_logprob,
                 "compression_ratio": s.compression_ratio, "no_speech_prob": s.no_speech_prob}
                for i, s in enumerate(transcript.segments)]
    return {"task": task, "language": _language_name(transcript, task), "duration": round(transcript.duration, 3),
            "text": transcript.text, "segments": segments, **usage}, "application/json"


def _form_field(form, name: str) -> str | None:
    value = form.get(name)
    if value is not None and not isinstance(value, str):
        raise RequestError(f"{name} must be a text field", name)
    return value


# OpenAI's fields of each route; `task` is xlagen's own on the transcription route.
TRANSCRIPTION_FIELDS = frozenset({"file", "model", "language", "prompt", "response_format", "temperature",
                                  "timestamp_granularities[]", "timestamp_granularities", "task"})
TRANSLATION_FIELDS = frozenset({"file", "model", "prompt", "response_format", "temperature"})


def _common_fields(form, state, known: frozenset) -> str:
    """Checks what both routes share (unknown fields, file, model, prompt, temperature); returns the
    response_format."""
    unknown = sorted(set(form.keys()) - known)
    if unknown:
        raise RequestError(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0])
    upload = form.get("file")
    if upload is None or isinstance(upload, str):
        raise RequestError("file is required: the audio file, as a multipart upload", "file")
    model = _form_field(form, "model")
    if model is not None and model != state.settings.model_name:
        raise RequestError(f"the model '{model}' does not exist; this server serves "
                           f"'{state.settings.model_name}'", "model", status=404, code="model_not_found")
    response_format = _form_field(form, "response_format") or "json"
    if response_format not in FORMATS:
        raise RequestError(f"response_format must be one of {list(FORMATS)}, got {response_format!r}",
                           "response_format")
    if _form_field(form, "prompt"):
        raise RequestError("prompt (conditioning on previous text) is not supported by this server", "prompt")
    temperature = _form_field(form, "temperature")
    if temperature not in (None, "", "0", "0.0"):
        raise RequestError(f"temperature: only 0 (greedy decoding) is supported, got {temperature!r}",
                           "temperature")
    return response_format


def _transcription_options(form) -> tuple[str | None, str | None]:
    """(language, task) of a transcription request; checks its timestamp_granularities."""
    granularities = form.getlist("timestamp_granularities[]") + form.getlist("timestamp_granularities")
    if set(granularities) - {"segment"}:
        raise RequestError(f"timestamp_granularities: only 'segment' is supported, got {granularities}",
                           "timestamp_granularities")
    if granularities and (_form_field(form, "response_format") or "json") != "verbose_json":
        raise RequestError("timestamp_granularities needs response_format 'verbose_json'",
                           "timestamp_granularities")
    task = _form_field(form, "task") or None
    if task not in (None, "transcribe", "translate"):
        raise RequestError(f"task must be 'transcribe' or 'translate', got {task!r}", "task")
    return _form_field(form, "language") or None, task


def _audio_route(state, batcher: TranscriptionBatcher, translate: bool, max_audio_seconds: float | None):
    """The Starlette endpoint of the transcription route, or with `translate` of the translation route."""
    from fastapi.responses import JSONResponse, Response

    from xlagen.serving.server import _until_disconnected

    async def endpoint(request):  # the request as is, no FastAPI injection
        form = await request.form()
        response_format = _common_fields(form, state, TRANSLATION_FIELDS if translate else TRANSCRIPTION_FIELDS)
        language, task = (None, "translate") if translate else _transcription_options(form)
        reason = batcher.cannot_translate() if translate else None
        if reason:
            raise RequestError(f"the model '{state.settings.model_name}' cannot translate: {reason}; "
                               "/v1/audio/translations needs a multilingual Whisper checkpoint", "model",
                               code="translation_not_supported")
        try:
            batcher.check(language, task)
        except ValueError as error:
            raise RequestError(str(error), "language") from None
        upload = form["file"]
        samples = await asyncio.to_thread(decode_upload, upload.file, upload.filename or "file", max_audio_seconds)
        timestamps = response_format in ("srt", "vtt", "verbose_json")
        work = asyncio.ensure_future(batcher.transcribe(samples, language=language, task=task, timestamps=timestamps,
                                                        deadline=state.settings.request_timeout))
        try:
            transcript = await _until_disconnected(request, work)
        except TimeoutError:
            raise RequestError(f"the transcription did not finish within {state.settings.request_timeout} s",
                               status=504, error_type="timeout_error", code="deadline_exceeded") from None
        body, media_type = format_transcript(transcript, response_format, task or "transcribe")
        if media_type == "application/json":
            return JSONResponse(body)
        return Response(body, media_type=media_type)

    return endpoint


def add_translation_route(app, state, batcher: TranscriptionBatcher, path: str = "/v1/audio/translations", *,
                          max_audio_seconds: float | None = None) -> None:
    """Adds OpenAI's translation route (speech to English text) to the server `app` (`state` is the server's state).

    A model that cannot translate (English-only: generation_config.json `is_multilingual: false`, or no
    `translate` among its task tokens) answers 400 with `param: model`, `code: translation_not_supported`.

    Args:
        max_audio_seconds: Longer uploads are refused; None: the batcher's `max_audio_seconds`.
    """
    limit = batcher.max_audio_seconds if max_audio_seconds is None else max_audio_seconds
    app.router.add_route(path, _audio_route(state, batcher, True, limit), methods=["POST"])


def add_transcription_route(app, state, batcher: TranscriptionBatcher, path: str = "/v1/audio/transcriptions", *,
                            translation_path: str | None = "/v1/audio/translations",
                            max_audio_seconds: float | None = None) -> None:
    """Adds OpenAI's transcription route, and its translation route (`add_translation_route`), to the server
    `app` (`state` is the server's state).

    Args:
        translation_path: Where the translation route goes; None leaves it out.
        max_audio_seconds: Longer uploads are refused; None: the batcher's `max_audio_seconds`.
    """
    limit = batcher.max_audio_seconds if max_audio_seconds is None else max_audio_seconds
    app.router.add_route(path, _audio_route(state, batcher, False, limit), methods=["POST"])
    if translation_path is not None:
        add_translation_route(app, state, batcher, translation_path, max_audio_seconds=limit)
