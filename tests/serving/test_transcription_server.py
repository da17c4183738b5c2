"""`POST /v1/audio/transcriptions` and `/v1/audio/translations` on a tiny Whisper: uploads batched together give
each file's `Transcriber` transcript; the response formats; translations as transformers' translate; the
refused options, models and over-long uploads; decoding off the event loop."""

from __future__ import annotations

import asyncio
import io
import math
import warnings

import pytest
import soundfile

from conftest import require_extra
from serving.live_server import running

require_extra("fastapi", "uvicorn", "prometheus_client", "httpx", "multipart", "jinja2")

import httpx  # noqa: E402

from models.test_whisper import save_tiny_whisper  # noqa: E402
from whisper_fixtures import build_whisper_tokenizer, save_feature_extractor, synthetic_audio  # noqa: E402
from xlagen.serving.speech import FORMATS  # noqa: E402

MAX_NEW = 12
MAX_SECONDS = 20.0


@pytest.fixture(scope="module")
def whisper_server(tmp_path_factory):
    from xlagen import TFWhisperForConditionalGeneration, WhisperProcessor
    from xlagen.serving.server import Backends, ServerSettings, create_app
    from xlagen.serving.speech import TranscriptionBatcher

    folder = tmp_path_factory.mktemp("whisper_server")
    reference = save_tiny_whisper(folder, seed=2, max_length=MAX_NEW + 4)
    build_whisper_tokenizer(folder)
    save_feature_extractor(folder, 80)
    model = TFWhisperForConditionalGeneration.from_pretrained(folder)
    model.generation_config = model.generation_config.update(max_new_tokens=MAX_NEW)
    processor = WhisperProcessor.from_pretrained(folder)
    batcher = TranscriptionBatcher(model, processor, max_batch=2, max_wait=0.5, max_audio_seconds=MAX_SECONDS)
    with running(create_app(Backends(processor.tokenizer, speech=batcher), ServerSettings("tiny-whisper"))) as (url, _):
        yield url, batcher, reference


def wav(seconds: float, seed: int) -> bytes:
    data = io.BytesIO()
    soundfile.write(data, synthetic_audio(seconds, seed=seed), 16000, format="WAV")
    return data.getvalue()


def test_concurrent_uploads_are_batched_and_match_transcriber(whisper_server):
    url, batcher, _ = whisper_server
    files = [wav(3.0, seed=1), wav(5.0, seed=2)]
    expected = [batcher.transcriber(synthetic_audio(s, seed=seed), language="en", return_timestamps=True)
                for s, seed in ((3.0, 1), (5.0, 2))]

    async def upload_both():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/audio/transcriptions", files={"file": ("a.wav", f)},
                                                      data={"language": "en", "response_format": "verbose_json",
                                                            "timestamp_granularities[]": "segment"})
                                          for f in files))

    compiles = batcher.stats()["compiles"]
    responses = asyncio.run(upload_both())
    for response, transcript in zip(responses, expected):
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["text"] == transcript.text and body["language"] == "english"
        assert [s["tokens"] for s in body["segments"]] == [list(s.tokens) for s in transcript.segments]
        assert body["duration"] == pytest.approx(transcript.duration, abs=1e-3)
        assert body["usage"] == {"type": "duration", "seconds": math.ceil(transcript.duration)}
        for got, segment in zip(body["segments"], transcript.segments):  # a batch row's measures are its own
            assert got["avg_logprob"] == pytest.approx(segment.avg_logprob, rel=1e-4)
            assert got["no_speech_prob"] == pytest.approx(segment.no_speech_prob, rel=1e-3)
            assert got["compression_ratio"] == segment.compression_ratio
    assert batcher.stats()["compiles"] == compiles + 1  # one program of batch 2, not two of batch 1
    srt = httpx.post(url + "/v1/audio/transcriptions", files={"file": ("a.wav", files[0])},
                     data={"language": "en", "response_format": "srt"}, timeout=120)
    cues = [s for s in expected[0].segments if s.text.strip()]
    assert srt.status_code == 200 and srt.text.count(" --> ") == len(cues)
    assert all(s.text.strip() in srt.text for s in cues)


@pytest.mark.parametrize("data, param", [({"response_format": "xml"}, "response_format"),
                                         ({"prompt": "earlier words"}, "prompt"),
                                         ({"language": "klingon"}, "language"),
                                         ({"response_format": "verbose_json", "timestamp_granularities[]": "word"},
                                          "timestamp_granularities")])
def test_refused_options(whisper_server, data, param):
    url, _, _ = whisper_server
    response = httpx.post(url + "/v1/audio/transcriptions", files={"file": ("a.wav", wav(1.0, seed=3))}, data=data)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_not_audio(whisper_server):
    url, _, _ = whisper_server
    response = httpx.post(url + "/v1/audio/transcriptions", files={"file": ("notes.txt", b"hello")})
    assert response.status_code == 400 and "notes.txt" in response.json()["error"]["message"]


def test_translations_match_transformers(whisper_server):
    """The translation route decodes with <|translate|> (the language detected), as transformers' generate with
    task="translate"; its verbose_json names English, the output's language, and has no usage."""
    import numpy as np
    import torch

    url, batcher, reference = whisper_server
    audio = synthetic_audio(4.0, seed=5)
    features = batcher.processor.feature_extractor(audio, sampling_rate=16000, return_tensors="np")["input_features"]
    with torch.no_grad():
        theirs = reference.generate(torch.tensor(features), task="translate", max_new_tokens=MAX_NEW,
                                    return_dict_in_generate=True).sequences.numpy()
    assert theirs[0, 2] == batcher.model.generation_config.task_to_id["translate"]  # start, language, translate
    expected = batcher.processor.batch_decode(theirs, skip_special_tokens=True)[0].strip()
    response = httpx.post(url + "/v1/audio/translations", files={"file": ("a.wav", wav(4.0, seed=5))}, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json() == {"text": expected}
    verbose = httpx.post(url + "/v1/audio/translations", files={"file": ("a.wav", wav(4.0, seed=5))},
                         data={"response_format": "verbose_json"}, timeout=120).json()
    transcript = batcher.transcriber(audio, task="translate", return_timestamps=True)
    assert verbose["task"] == "translate" and verbose["language"] == "english" and "usage" not in verbose
    assert [s["tokens"] for s in verbose["segments"]] == [list(s.tokens) for s in transcript.segments]
    assert not np.isnan([s["avg_logprob"] for s in verbose["segments"]]).any()
    for data, param in (({"language": "fr"}, "language"), ({"timestamp_granularities[]": "segment"},
                                                            "timestamp_granularities[]")):
        refused = httpx.post(url + "/v1/audio/translations", files={"file": ("a.wav", wav(1.0, seed=3))}, data=data)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param


def test_an_english_only_model_does_not_translate(tmp_path):
    from xlagen import TFWhisperForConditionalGeneration, WhisperProcessor
    from xlagen.serving.server import Backends, ServerSettings, create_app
    from xlagen.serving.speech import TranscriptionBatcher

    save_tiny_whisper(tmp_path, seed=2, multilingual=False)
    build_whisper_tokenizer(tmp_path)
    save_feature_extractor(tmp_path, 80)
    batcher = TranscriptionBatcher(TFWhisperForConditionalGeneration.from_pretrained(tmp_path),
                                   WhisperProcessor.from_pretrained(tmp_path))
    app = create_app(Backends(batcher.processor.tokenizer, speech=batcher), ServerSettings("tiny.en"))
    with running(app) as (url, _):
        response = httpx.post(url + "/v1/audio/translations", files={"file": ("a.wav", wav(1.0, seed=3))})
    error = response.json()["error"]
    assert response.status_code == 400 and (error["param"], error["code"]) == ("model", "translation_not_supported")
    assert "English-only" in error["message"] and "tiny.en" in error["message"]


def flac(seconds: float, state_length: bool = True) -> bytes:
    """A FLAC of a tone; without `state_length` its header counts 0 samples (a stream of unknown length)."""
    data = io.BytesIO()
    soundfile.write(data, synthetic_audio(seconds, seed=4), 16000, format="FLAC")
    data = bytearray(data.getvalue())
    if not state_length:  # STREAMINFO's 36-bit sample count: the low 4 bits of its byte 13, bytes 14-17
        data[8 + 13] &= 0xF0
        data[8 + 14:8 + 18] = bytes(4)
    return bytes(data)


@pytest.mark.parametrize("state_length, lasts", [(True, "lasts 25.0 s"), (False, "lasts longer")])
def test_uploads_longer_than_the_limit_are_refused(whisper_server, state_length, lasts):
    """From the header before decoding, or while decoding a stream that does not state its length: 400 naming the
    file (OpenAI's answer to audio longer than a model takes; 413 stays the body limit's)."""
    url, batcher, _ = whisper_server
    assert batcher.max_audio_seconds == MAX_SECONDS
    for route in ("transcriptions", "translations"):
        response = httpx.post(f"{url}/v1/audio/{route}", files={"file": ("long.flac", flac(25.0, state_length))})
        error = response.json()["error"]
        assert response.status_code == 400 and (error["param"], error["code"]) == ("file", "audio_too_long")
        assert f"'long.flac' {lasts}" in error["message"] and "at most 20 s" in error["message"]
    accepted = httpx.post(url + "/v1/audio/transcriptions", files={"file": ("ok.flac", flac(15.0, state_length))},
                          timeout=120)
    assert accepted.status_code == 200, accepted.text


def test_decoding_runs_off_the_event_loop(whisper_server, monkeypatch):
    """While an upload is decoded, the server answers other requests."""
    import time

    from xlagen.serving import speech

    url, _, _ = whisper_server
    decoding, original = [], speech.decode_upload

    def slow(*args):
        decoding.append(time.monotonic())
        time.sleep(2.0)
        return original(*args)

    monkeypatch.setattr(speech, "decode_upload", slow)

    async def upload_and_probe():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            upload = asyncio.ensure_future(client.post("/v1/audio/transcriptions",
                                                       files={"file": ("a.wav", wav(1.0, 3))}))
            while not decoding:
                await asyncio.sleep(0.02)
            started = time.monotonic()
            health = await client.get("/health")
            answered = time.monotonic() - started
            return await upload, health, answered, upload

    response, health, answered, _ = asyncio.run(upload_and_probe())
    assert health.status_code == 200 and answered < 1.0
    assert response.status_code == 200


def test_warmup_compiles_every_format_and_language_option(tmp_path):
    """After the warm-up (/health 200), no response format, language or task compiles: near the model's positions
    the decoder prompt's length (3 tokens detected, 4 given or translating) decides the program, as timestamps do."""
    from xlagen import TFWhisperForConditionalGeneration, WhisperProcessor
    from xlagen.serving.server import Backends, ServerSettings, create_app
    from xlagen.serving.speech import TranscriptionBatcher

    save_tiny_whisper(tmp_path, seed=2)  # no max_new_tokens: each prompt decodes up to the 40 positions
    build_whisper_tokenizer(tmp_path)
    save_feature_extractor(tmp_path, 80)
    batcher = TranscriptionBatcher(TFWhisperForConditionalGeneration.from_pretrained(tmp_path),
                                   WhisperProcessor.from_pretrained(tmp_path))
    backends = Backends(batcher.processor.tokenizer, speech=batcher, warmup=batcher.warmup)
    with running(create_app(backends, ServerSettings("tiny-whisper"))) as (url, _):
        compiled = batcher.stats()["compiles"]
        assert compiled == 4  # with and without timestamps, for prompts of 3 and 4 tokens
        for route, data, formats in [("transcriptions", {}, FORMATS), ("transcriptions", {"language": "en"}, FORMATS),
                                     ("transcriptions", {"language": "french", "task": "transcribe"}, ("json", "srt")),
                                     ("transcriptions", {"task": "translate"}, ("text", "vtt")),
                                     ("translations", {}, ("json", "verbose_json"))]:
            for response_format in formats:
                response = httpx.post(f"{url}/v1/audio/{route}", files={"file": ("a.wav", wav(2.0, seed=6))},
                                      data={**data, "response_format": response_format}, timeout=120)
                assert response.status_code == 200, response.text
        long = httpx.post(url + "/v1/audio/transcriptions", files={"file": ("b.wav", wav(35.0, seed=7))},
                          data={"response_format": "srt"}, timeout=120)
        assert long.status_code == 200, long.text
        assert batcher.stats()["compiles"] == compiled


def test_openai_client_transcribes_and_translates(whisper_server):
    """The audio routes through the `openai` package, as users call them: its multipart uploads, its response
    types, and its errors."""
    require_extra("openai")
    import openai

    url, batcher, _ = whisper_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    text = client.audio.transcriptions.create(model="tiny-whisper", file=("a.wav", wav(3.0, seed=1)))
    assert text.text == batcher.transcriber(synthetic_audio(3.0, seed=1)).text
    expected = batcher.transcriber(synthetic_audio(3.0, seed=1), return_timestamps=True)
    verbose = client.audio.transcriptions.create(model="tiny-whisper", file=("a.wav", wav(3.0, seed=1)),
                                                 response_format="verbose_json", timestamp_granularities=["segment"])
    assert verbose.text == expected.text and len(verbose.segments) == len(expected.segments)
    assert all(s.avg_logprob <= 0 and s.compression_ratio > 0 and 0 <= s.no_speech_prob <= 1 for s in verbose.segments)
    srt = client.audio.transcriptions.create(model="tiny-whisper", file=("a.wav", wav(3.0, seed=1)),
                                             response_format="srt")
    assert "-->" in srt or not expected.segments
    with warnings.catch_warnings():  # the openai package marks its translations method deprecated; it still works
        warnings.simplefilter("ignore", DeprecationWarning)
        translated = client.audio.translations.create(model="tiny-whisper", file=("a.wav", wav(4.0, seed=5)))
    assert translated.text == batcher.transcriber(synthetic_audio(4.0, seed=5), task="translate").text
    with pytest.raises(openai.BadRequestError) as refused:
        client.audio.transcriptions.create(model="tiny-whisper", file=("a.wav", b"not audio"))
    assert refused.value.param == "file"
    with pytest.raises(openai.NotFoundError):
        client.audio.transcriptions.create(model="whisper-1", file=("a.wav", wav(1.0, seed=3)))
