"""`POST /v1/audio/transcriptions` on a tiny Whisper: uploads batched together give each file's `Transcriber`
transcript; the response formats; the refused options."""

from __future__ import annotations

import asyncio
import io
import math

import pytest
import soundfile

from conftest import require_extra
from serving.live_server import running

require_extra("fastapi", "uvicorn", "prometheus_client", "httpx", "multipart", "jinja2")

import httpx  # noqa: E402

from models.test_whisper import save_tiny_whisper  # noqa: E402
from whisper_fixtures import build_whisper_tokenizer, save_feature_extractor, synthetic_audio  # noqa: E402

MAX_NEW = 12


@pytest.fixture(scope="module")
def whisper_server(tmp_path_factory):
    from xlagen import TFWhisperForConditionalGeneration, WhisperProcessor
    from xlagen.serving.server import Backends, ServerSettings, create_app
    from xlagen.serving.speech import TranscriptionBatcher

    folder = tmp_path_factory.mktemp("whisper_server")
    save_tiny_whisper(folder, seed=2, max_length=MAX_NEW + 4)
    build_whisper_tokenizer(folder)
    save_feature_extractor(folder, 80)
    model = TFWhisperForConditionalGeneration.from_pretrained(folder)
    model.generation_config = model.generation_config.update(max_new_tokens=MAX_NEW)
    processor = WhisperProcessor.from_pretrained(folder)
    batcher = TranscriptionBatcher(model, processor, max_batch=2, max_wait=0.5)
    with running(create_app(Backends(processor.tokenizer, speech=batcher), ServerSettings("tiny-whisper"))) as (url, _):
        yield url, batcher


def wav(seconds: float, seed: int) -> bytes:
    data = io.BytesIO()
    soundfile.write(data, synthetic_audio(seconds, seed=seed), 16000, format="WAV")
    return data.getvalue()


def test_concurrent_uploads_are_batched_and_match_transcriber(whisper_server):
    url, batcher = whisper_server
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
    url, _ = whisper_server
    response = httpx.post(url + "/v1/audio/transcriptions", files={"file": ("a.wav", wav(1.0, seed=3))}, data=data)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_not_audio(whisper_server):
    url, _ = whisper_server
    response = httpx.post(url + "/v1/audio/transcriptions", files={"file": ("notes.txt", b"hello")})
    assert response.status_code == 400 and "notes.txt" in response.json()["error"]["message"]
