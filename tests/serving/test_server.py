"""The HTTP server against a real uvicorn on a loopback port: OpenAI routes, streaming, validation, protection
(401, 413, 429, deadline, disconnect), metrics, and `xlagen serve`'s drain on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import require_extra
from serving.live_server import running, wait_healthy
from xlagen.serving.text import TokenPieces

require_extra("fastapi", "uvicorn", "prometheus_client", "httpx", "multipart", "jinja2")

import httpx  # noqa: E402

SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.fixture(scope="module")
def tokenizer(gpt2_checkpoint):
    from xlagen import AutoTokenizer

    return AutoTokenizer.from_pretrained(gpt2_checkpoint[0])


@pytest.fixture(scope="module")
def text_server(gpt2_model, tokenizer):
    """A server of the tiny GPT-2 as `xlagen serve` builds it: the slot engine (prompt bucket 16) for one beam,
    the request batcher for beam search; warmed up."""
    from xlagen.serving import Engine
    from xlagen.serving.batcher import RequestBatcher
    from xlagen.serving.server import Backends, ServerSettings, create_app

    engine = Engine(gpt2_model, tokenizer, slots=4, prompt_buckets=(16,), prefill_batch=1)  # batching: test_engine
    beams = RequestBatcher(gpt2_model, tokenizer, max_batch=4)
    with running(create_app(Backends(tokenizer, text=engine, beams=beams, warmup=engine.warmup),
                            ServerSettings("tiny-gpt2"))) as (url, _):
        yield url, engine, beams


def greedy_text(model, tokenizer, prompt: str, new_tokens: int) -> tuple[str, list[int]]:
    """model.generate's greedy continuation (text up to EOS, and the new ids)."""
    ids = np.array([tokenizer.encode(prompt)], np.int32)
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, repetition_penalty=1.0).numpy()[0]
    new = out[ids.shape[1]:].tolist()
    if 0 in new:
        new = new[:new.index(0) + 1]
    return tokenizer.decode(new, skip_special_tokens=True), new


def sse_payloads(response: httpx.Response) -> list:
    lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_completion_matches_generate(text_server, gpt2_model, tokenizer):
    url, *_ = text_server
    expected, ids = greedy_text(gpt2_model, tokenizer, "Hello world", 12)
    response = httpx.post(url + "/v1/completions", json={"model": "tiny-gpt2", "prompt": "Hello world",
                                                         "max_tokens": 12, "temperature": 0}, timeout=60)
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny-gpt2" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["text"] == expected and choice["index"] == 0
    assert choice["finish_reason"] == ("stop" if ids[-1] == 0 else "length")
    assert body["usage"] == {"prompt_tokens": len(tokenizer.encode("Hello world")), "completion_tokens": len(ids),
                             "total_tokens": len(tokenizer.encode("Hello world")) + len(ids)}


def test_streaming_chunks_concatenate_to_the_completion(text_server):
    url, *_ = text_server
    request = {"prompt": ["Hello world", "The quick brown fox"], "max_tokens": 10, "temperature": 0}
    whole = httpx.post(url + "/v1/completions", json=request, timeout=60).json()
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={**request, "stream": True, "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        chunks = sse_payloads(response)
    texts, reasons = {0: "", 1: ""}, {}
    for chunk in chunks[:-1]:
        assert chunk["object"] == "text_completion" and chunk["id"] == chunks[0]["id"]
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"] is not None:
            reasons[choice["index"]] = choice["finish_reason"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert reasons == {c["index"]: c["finish_reason"] for c in whole["choices"]}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


def test_n_stop_and_logprobs(text_server, gpt2_model, tokenizer):
    url, *_ = text_server
    full, ids = greedy_text(gpt2_model, tokenizer, "Hello world", 12)
    stop = next(c for c in full[1:] if c != "\ufffd" and full.index(c) > 0)  # a whole character, not at the start
    body = httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": "Hello world", "max_tokens": 12, "temperature": 0, "n": 2, "stop": [stop]}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for choice in body["choices"]:
        assert choice["text"] == full[:full.index(stop)] and choice["finish_reason"] == "stop"
    choice = httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": "Hello world", "max_tokens": 12, "temperature": 0, "logprobs": 0}).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [TokenPieces(tokenizer).text_of(i) for i in ids]  # text, not BPE symbols
    assert len(logprobs["token_logprobs"]) == len(ids) and all(lp <= 0 for lp in logprobs["token_logprobs"])
    assert logprobs["top_logprobs"] is None
    sampled = [httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": "Hello world", "max_tokens": 8, "temperature": 0.7, "seed": 5}).json() for _ in range(2)]
    assert sampled[0]["choices"][0]["text"] == sampled[1]["choices"][0]["text"]


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def test_chat_completions(text_server, gpt2_checkpoint, gpt2_model, tmp_path):
    from xlagen import AutoTokenizer
    from xlagen.serving.batcher import RequestBatcher
    from xlagen.serving.server import Backends, ServerSettings, create_app

    folder = tmp_path / "chat"
    AutoTokenizer.from_pretrained(gpt2_checkpoint[0]).save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    chat_tokenizer = AutoTokenizer.from_pretrained(folder)
    batcher = RequestBatcher(gpt2_model, chat_tokenizer, generator=text_server[2].generator)
    messages = [{"role": "user", "content": "Hello"}]
    expected, _ = greedy_text(gpt2_model, chat_tokenizer, "user: Hello\nassistant:", 8)
    with running(create_app(Backends(chat_tokenizer, text=batcher), ServerSettings("chat"))) as (url, _):
        request = {"messages": messages, "max_tokens": 8, "temperature": 0}
        body = httpx.post(url + "/v1/chat/completions", json=request, timeout=60).json()
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"] == {"role": "assistant", "content": expected}
        with httpx.stream("POST", url + "/v1/chat/completions", json={**request, "stream": True}, timeout=60) as r:
            chunks = sse_payloads(r)
        bad_role = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]})
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] is not None
    assert bad_role.status_code == 400 and bad_role.json()["error"]["param"] == "messages[0]"


def test_beam_search_route(text_server, gpt2_model, tokenizer):
    url, *_ = text_server
    ids = np.array([tokenizer.encode("Hello world")], np.int32)
    out = gpt2_model.generate(ids, max_new_tokens=4, num_beams=2, do_sample=False).numpy()[0, ids.shape[1]:]
    out = out.tolist()[:out.tolist().index(0) + 1] if 0 in out.tolist() else out.tolist()
    body = httpx.post(url + "/v1/completions", timeout=120, json={
        "prompt": "Hello world", "max_tokens": 4, "num_beams": 2}).json()
    assert body["choices"][0]["text"] == tokenizer.decode(out, skip_special_tokens=True)


@pytest.mark.parametrize("change, param", [
    ({"temperature": 3}, "temperature"), ({"top_p": 0}, "top_p"), ({"n": 0}, "n"), ({"n": 99}, "n"),
    ({"max_tokens": "8"}, "max_tokens"), ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"logprobs": 21}, "logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"frobnicate": 1}, "frobnicate"), ({"prompt": ""}, "prompt"),
    ({"prompt": [1, 10**6]}, "prompt"), ({"seed": -1}, "seed"), ({"stream_options": {"include_usage": True}},
                                                                "stream_options"),
    ({"num_beams": 2, "n": 2}, "n"), ({"echo": True}, "echo")])
def test_validation_names_the_field(text_server, change, param):
    url, *_ = text_server
    response = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, **change}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and param in error["message"]


def test_other_errors(text_server):
    url, *_ = text_server
    bad_json = httpx.post(url + "/v1/completions", content=b"{not json", timeout=30,
                          headers={"Content-Type": "application/json"})
    assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]["message"]
    wrong_model = httpx.post(url + "/v1/completions", json={"model": "gpt-4", "prompt": "Hi"}, timeout=30)
    assert wrong_model.status_code == 404 and wrong_model.json()["error"]["param"] == "model"
    too_long = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 500, "num_beams": 2}, timeout=30)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
    for body in ({"prompt": "Hi", "max_tokens": 70}, {"prompt": "Hi", "max_tokens": 70, "stream": True}):
        refused = httpx.post(url + "/v1/completions", json=body, timeout=30)  # the engine: max_length 64
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["code"] == "context_length_exceeded", refused.text
        assert error["param"] == "max_tokens" and "maximum context length is 64" in error["message"]
    chat = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]}, timeout=30)
    assert chat.status_code == 400 and "chat template" in chat.json()["error"]["message"]


def test_models_health_and_metrics(text_server):
    url, *_ = text_server
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny-gpt2"
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    metrics = httpx.get(url + "/metrics").text
    for name in ("xlagen_queue_depth", "xlagen_active_slots", "xlagen_tokens_generated_total", "xlagen_compiles_total",
                 "xlagen_time_to_first_token_seconds_bucket", "xlagen_inter_token_seconds_bucket",
                 'xlagen_requests_total{route="/v1/completions",status="200"}'):
        assert name in metrics


def test_disconnect_frees_the_slot(text_server, monkeypatch):
    url, engine, _ = text_server
    # Steps made slow, so that the request is still decoding when the server sees the client leave.
    step = engine._decoder.step
    monkeypatch.setattr(engine._decoder, "step", lambda *args, **kw: time.sleep(0.1) or step(*args, **kw))
    cancelled = engine.stats()["requests_finished"]["cancelled"]
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={"prompt": "Hello world", "max_tokens": 48, "temperature": 0.8, "seed": 1,
                            "stream": True}) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the first token arrived: the request holds a slot
    deadline = time.monotonic() + 30
    while engine.stats()["active_slots"] or engine.stats()["requests_finished"]["cancelled"] == cancelled:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.02)


@pytest.fixture(scope="module")
def guarded_server(gpt2_model, tokenizer):
    """A server with an API key, a 2 KB body limit, a queue of one request and a 1.5 s deadline; no warm-up, so
    that the first request of a shape compiles for seconds while others wait."""
    from xlagen.serving.batcher import RequestBatcher
    from xlagen.serving.server import Backends, ServerSettings, create_app

    batcher = RequestBatcher(gpt2_model, tokenizer, max_batch=1, max_queue=1)
    settings = ServerSettings("tiny-gpt2", api_key="sesame", max_body_bytes=2048, request_timeout=1.5, retry_after=3)
    with running(create_app(Backends(tokenizer, text=batcher), settings)) as (url, _):
        yield url, batcher


def test_api_key_and_body_limit(guarded_server):
    url, _ = guarded_server
    request = {"prompt": "Hi", "max_tokens": 2}
    assert httpx.post(url + "/v1/completions", json=request).status_code == 401
    wrong = httpx.post(url + "/v1/completions", json=request, headers={"Authorization": "Bearer sesam"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/health").status_code == 200  # probes need no key
    key = {"Authorization": "Bearer sesame"}
    big = {"prompt": "x" * 4000, "max_tokens": 2}
    assert httpx.post(url + "/v1/completions", json=big, headers=key).status_code == 413

    def chunked():  # no Content-Length: the limit is enforced while the body is read
        for _ in range(10):
            yield b" " * 500

    assert httpx.post(url + "/v1/completions", content=chunked(),
                      headers={**key, "Content-Type": "application/json"}).status_code == 413


def test_queue_full_deadline_and_disconnect(guarded_server):
    url, batcher = guarded_server
    key = {"Authorization": "Bearer sesame"}
    new_shape = {"prompt": "Hello world, hello tokens, hello language models and more", "max_tokens": 30,
                 "temperature": 0}

    async def scenario():
        async with httpx.AsyncClient(base_url=url, headers=key, timeout=60) as client:
            compiling = asyncio.ensure_future(client.post("/v1/completions", json=new_shape))  # runs, compiling
            await _until(lambda: batcher.stats()["active_slots"] == 1)
            completed = batcher.stats()["requests_completed"]
            # A streaming request that waits in the queue; its client leaves before it runs.
            leaving = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "Hi", "stream": True}))
            await _until(lambda: batcher.stats()["queue_depth"] == 1)
            full = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            leaving.cancel()
            await _until(lambda: batcher.stats()["queue_depth"] == 0)
            return full, await compiling, completed

    full, timed_out, completed = asyncio.run(scenario())
    assert full.status_code == 429 and full.headers["Retry-After"] == "3"
    assert full.json()["error"]["code"] == "queue_full"
    assert timed_out.status_code == 504 and timed_out.json()["error"]["code"] == "deadline_exceeded"
    time.sleep(0.5)
    # The request whose client left never ran: only the compiling one completed.
    asyncio.run(_wait_async(lambda: batcher.stats()["active_slots"] == 0))
    assert batcher.stats()["requests_completed"] == completed + 1


async def _until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def _wait_async(condition) -> None:
    await _until(condition, 60.0)


def test_serve_command_drains_on_sigterm(gpt2_checkpoint, tmp_path):
    """`xlagen serve` in its own process: ready after warm-up, then SIGTERM while a request runs: it finishes,
    new connections are refused, the process exits 0."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": SRC, "XLAGEN_API_KEY": "k"}
    process = subprocess.Popen([sys.executable, "-m", "xlagen.cli", "serve", gpt2_checkpoint[0], "--backend", "batcher",
                                "--port", str(port), "--no-warmup",
                                "--compile-cache", str(tmp_path / "cache")], env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url, 120)
        result = {}

        def long_request():  # the first request compiles (no warm-up), so it is still running at SIGTERM
            with httpx.stream("POST", url + "/v1/completions", headers={"Authorization": "Bearer k"}, timeout=120,
                              json={"prompt": "x " * 20, "max_tokens": 16, "temperature": 0, "stream": True}) as r:
                result["status"], result["lines"] = r.status_code, [line for line in r.iter_lines() if line]

        thread = threading.Thread(target=long_request)
        thread.start()
        time.sleep(1.0)
        process.send_signal(signal.SIGTERM)
        thread.join(120)
        assert process.wait(60) == 0
        assert result["status"] == 200 and result["lines"][-1] == "data: [DONE]"
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_request_whose_prompts_partly_fail_cancels_the_others(gpt2_model, tokenizer):
    """A queue of two, and an engine thread held up (its device lock taken here): a request of three prompts gets two
    into the queue and a 429 for the third; the two queued ones are cancelled at once and never decoded."""
    from xlagen.serving import Engine
    from xlagen.serving.server import Backends, ServerSettings, create_app

    engine = Engine(gpt2_model, tokenizer, slots=1, max_length=64, prompt_buckets=(16,), max_queue=2)
    with running(create_app(Backends(tokenizer, text=engine, warmup=engine.warmup), ServerSettings("tiny"))) as (
            url, _):
        with engine._device:  # the engine thread cannot take requests meanwhile
            refused = httpx.post(url + "/v1/completions", timeout=60,
                                 json={"prompt": ["a b", "c d", "e f"], "max_tokens": 30, "temperature": 0})
        deadline = time.monotonic() + 30
        while engine.stats()["requests_finished"]["cancelled"] < 2:
            assert time.monotonic() < deadline, engine.stats()
            time.sleep(0.01)
        stats = engine.stats()
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
    assert stats["requests_submitted"] == 2 and stats["prefills"] == 0 and stats["tokens_generated"] == 0
