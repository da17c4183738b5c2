"""`xlagen serve` as deployed: a real server process on a loopback port with its default flags, tried as a browser
page, an attacker and the OpenAI client would: Host and Origin checks, Content-Type, the API key, prompts up to
the model's positions, requests that can never fit, slow and huge bodies, errors in OpenAI's shape, and a drain
that half-sent bodies do not hold."""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import build_bpe_tokenizer, require_extra, save_tiny_gpt2
from serving.live_server import wait_healthy

require_extra("fastapi", "uvicorn", "prometheus_client", "httpx", "multipart", "jinja2", "openai")

import httpx  # noqa: E402

SRC = str(Path(__file__).resolve().parents[2] / "src")
KEY = "s3cret-key"
POSITIONS = 256
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _serve(args: list[str], env: dict | None = None, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "xlagen.cli", "serve", *args],
                            env={**os.environ, "PYTHONPATH": SRC, **(env or {})}, stderr=subprocess.PIPE, text=True,
                            **popen)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny GPT-2 of 256 positions with a chat template, and its key file."""
    folder = tmp_path_factory.mktemp("gpt2-256")
    vocab = build_bpe_tokenizer(folder)
    save_tiny_gpt2(folder, vocab_size=vocab, bos_token_id=0, eos_token_id=0, n_positions=POSITIONS)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE,
                                                              "model_max_length": POSITIONS}))
    key_file = tmp_path_factory.mktemp("secrets") / "key"
    key_file.write_text(KEY + "\n")
    return folder, key_file


@pytest.fixture(scope="module")
def server(checkpoint):
    """`xlagen serve` with its default flags but for a key file, 2 slots, a queue of 2 and short body/header
    timeouts; (url, process)."""
    folder, key_file = checkpoint
    port = _free_port()
    process = _serve([str(folder), "--port", str(port), "--api-key-file", str(key_file), "--slots", "2",
                      "--max-queue", "2", "--body-timeout", "2", "--header-timeout", "2", "--max-connections", "40",
                      "--model-name", "tiny"])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url)
        yield url, process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def reference(checkpoint):
    """(tokenizer, model) loaded in this process, for the expected greedy tokens."""
    from xlagen import AutoTokenizer, TFAutoModelForCausalLM

    folder, _ = checkpoint
    return AutoTokenizer.from_pretrained(folder), TFAutoModelForCausalLM.from_pretrained(folder)


AUTH = {"Authorization": f"Bearer {KEY}"}


def _greedy(reference, ids: list[int], new: int) -> list[int]:
    tokenizer, model = reference
    out = model.generate(np.array([ids], np.int32), max_new_tokens=new, do_sample=False).numpy()[0, len(ids):]
    out = out.tolist()
    return out[:out.index(0) + 1] if 0 in out else out


def test_host_origin_content_type_and_key(server):
    url, _ = server
    body = {"prompt": "Hello world", "max_tokens": 2}
    evil = httpx.post(url + "/v1/completions", json=body, headers={**AUTH, "Host": "evil.example"})
    assert evil.status_code == 400 and evil.json()["error"]["code"] == "invalid_host"
    for host in ("localhost", f"localhost:{url.rsplit(':', 1)[1]}", "127.0.0.1"):
        assert httpx.get(url + "/health", headers={"Host": host}).status_code == 200
    page = httpx.post(url + "/v1/completions", json=body, headers={**AUTH, "Origin": "https://evil.example"})
    assert page.status_code == 403 and page.json()["error"]["code"] == "origin_not_allowed"
    # A "simple" cross-site request needs no preflight: text/plain is refused before anything runs.
    plain = httpx.post(url + "/v1/completions", content=json.dumps(body), headers={**AUTH, "Content-Type": "text/plain"})
    assert plain.status_code == 415 and plain.json()["error"]["code"] == "unsupported_media_type"
    form = httpx.post(url + "/v1/completions", data={"prompt": "x"}, headers=AUTH)
    assert form.status_code == 415
    assert httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer"}).status_code == 401
    assert httpx.post(url + "/v1/completions", json=body).status_code == 401
    assert httpx.post(url + "/v1/completions", json=body, headers=AUTH).status_code == 200


def test_error_shapes(server):
    url, _ = server
    for response, status in ((httpx.get(url + "/v1/nothing", headers=AUTH), 404),
                             (httpx.delete(url + "/v1/models", headers=AUTH), 405),
                             (httpx.post(url + "/v1/completions", content=b"x" * 26 * 2**20,
                                         headers={**AUTH, "Content-Type": "application/json"}), 413),
                             (httpx.post(url + "/v1/completions", content=b"{}", headers=AUTH), 415)):
        assert response.status_code == status
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_prompts_up_to_the_models_positions_with_default_flags(server, reference):
    """The default warm-up compiles 16 and 64 tokens; a 101-token prompt and a long chat are served (their bucket
    compiles when first used) with the greedy tokens of `generate`; past the positions, a 400 naming the prompt."""
    url, _ = server
    tokenizer, _ = reference
    ids = [int(i) for i in np.random.default_rng(3).integers(2, 300, 101)]
    body = httpx.post(url + "/v1/completions", headers=AUTH, timeout=300,
                      json={"prompt": ids, "max_tokens": 8, "temperature": 0}).json()
    expected = _greedy(reference, ids, 8)
    assert body["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True), body
    messages = [{"role": "system", "content": "You answer briefly. " * 3},
                {"role": "developer", "content": "The quick brown fox jumps over the lazy dog. " * 2},
                {"role": "user", "content": "Hello world, hello tokens, hello language models. " * 2}]
    chat_ids = tokenizer.apply_chat_template([{**m, "role": m["role"].replace("developer", "system")}
                                              for m in messages], add_generation_prompt=True)
    assert 128 < len(chat_ids) < 200
    chat = httpx.post(url + "/v1/chat/completions", headers=AUTH, timeout=300,
                      json={"messages": messages, "max_tokens": 6, "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(chat_ids)
    assert chat.json()["choices"][0]["message"]["content"] == tokenizer.decode(_greedy(reference, chat_ids, 6),
                                                                               skip_special_tokens=True)
    too_long = httpx.post(url + "/v1/completions", headers=AUTH, json={"prompt": ids * 3, "max_tokens": 4})
    error = too_long.json()["error"]
    assert too_long.status_code == 400 and error["param"] == "prompt" and error["code"] == "context_length_exceeded"


def test_a_request_that_can_never_fit_is_400_not_429(server):
    url, _ = server  # 2 slots + a queue of 2
    response = httpx.post(url + "/v1/completions", headers=AUTH, json={"prompt": "Hi", "max_tokens": 2, "n": 5})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "n" and error["code"] == "too_many_completions"
    beams = httpx.post(url + "/v1/completions", headers=AUTH, json={"prompt": "Hi", "max_tokens": 2, "num_beams": 3})
    assert beams.status_code == 400 and beams.json()["error"]["param"] == "num_beams"  # not a served beam width
    sampled = httpx.post(url + "/v1/completions", headers=AUTH,
                         json={"prompt": "Hi", "max_tokens": 2, "num_beams": 2, "temperature": 0.7})
    assert sampled.status_code == 400 and sampled.json()["error"]["param"] == "temperature"


def test_a_10_mb_prompt_does_not_stall_a_running_stream(server):
    url, _ = server
    gaps, health = [], []

    def stream():
        with httpx.stream("POST", url + "/v1/completions", headers=AUTH, timeout=120,
                          json={"prompt": "Hello", "max_tokens": 200, "temperature": 0.8, "seed": 1,
                                "stream": True}) as response:
            last = time.monotonic()
            for line in response.iter_lines():
                if line:
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

    thread = threading.Thread(target=stream)
    thread.start()
    time.sleep(1.0)
    huge = httpx.post(url + "/v1/completions", headers=AUTH, timeout=120,
                      json={"prompt": "lorem ipsum " * 900_000, "max_tokens": 1})
    for _ in range(3):
        begin = time.monotonic()
        httpx.get(url + "/health")
        health.append(time.monotonic() - begin)
    thread.join(120)
    # Refused by its length in characters, before tokenizing 10 MB (which took 25 s on the event loop).
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "prompt"
    assert "characters" in huge.json()["error"]["message"]
    assert max(health) < 10 and len(gaps) > 100  # the stream ran to its end; /health never waited for the prompt


def test_slow_clients_time_out(server):
    url, _ = server
    host, port = url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port))) as half_body:
        half_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
        half_body.settimeout(30)
        answer = half_body.recv(4096).decode()
    assert answer.startswith("HTTP/1.1 408"), answer
    with socket.create_connection((host, int(port))) as half_header:
        half_header.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        half_header.settimeout(60)
        assert half_header.recv(4096) == b""  # closed by the server after --header-timeout


def test_connections_beyond_the_cap_are_closed_and_idle_ones_time_out(server):
    """100 connections that send nothing (a cap of 40): those past the cap are closed at once, the others after
    the header timeout; the server answers again as soon as they are gone."""
    url, _ = server
    host, port = url.rsplit("/", 1)[1].split(":")
    idle = [socket.create_connection((host, int(port))) for _ in range(100)]
    waiting = selectors.DefaultSelector()
    for connection in idle:
        waiting.register(connection, selectors.EVENT_READ)
    ends = []
    deadline = time.monotonic() + 120
    while len(ends) < len(idle):
        assert time.monotonic() < deadline, f"{len(ends)} of {len(idle)} connections closed"
        for key, _ in waiting.select(timeout=1):
            try:
                ends.append("closed" if key.fileobj.recv(1) == b"" else "data")
            except ConnectionResetError:
                ends.append("reset")
            waiting.unregister(key.fileobj)
            key.fileobj.close()
    # Past the cap: aborted as they arrive (a reset); under it: closed after --header-timeout (an orderly close).
    assert sorted(ends) == ["closed"] * 40 + ["reset"] * 60
    assert httpx.get(url + "/health").status_code == 200


def test_openai_client(server, reference):
    import openai

    url, _ = server
    tokenizer, _ = reference
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    ids = tokenizer.encode("Hello world")
    completion = client.completions.create(model="tiny", prompt="Hello world", max_tokens=6, temperature=0, logprobs=3)
    expected = _greedy(reference, ids, 6)
    assert completion.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(expected) and all(len(top) == 3 for top in logprobs.top_logprobs)
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert token in top and max(top.values()) == pytest.approx(logprob)  # greedy: the most likely token
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert all(len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
               for entry in content)
    assert b"".join(bytes(entry.bytes) for entry in content).decode("utf-8", "replace").startswith(
        chat.choices[0].message.content)
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model="tiny", prompt="Hello world", max_tokens=6, temperature=0, stream=True) if chunk.choices)
    assert streamed == completion.choices[0].text
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2, logprobs=21)
    assert refused.value.param == "logprobs"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_drain_is_not_held_by_half_sent_bodies(checkpoint):
    """SIGTERM while a client is half-way through its body and another connection is idle: the process ends at
    once (the body gets 503), not after the request timeout."""
    folder, _ = checkpoint
    port = _free_port()
    process = _serve([str(folder), "--port", str(port), "--no-warmup", "--request-timeout", "300"])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url)
        idle = socket.create_connection(("127.0.0.1", port))
        half = socket.create_connection(("127.0.0.1", port))
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{")
        time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        assert process.wait(120) == 0  # not held for the 300 s of --request-timeout
        half.settimeout(10)
        assert half.recv(4096).decode().startswith("HTTP/1.1 503")
        idle.close()
        half.close()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("args, env, words", [
    (["--api-key", ""], {}, "API key from --api-key is empty"),
    ([], {"XLAGEN_API_KEY": ""}, "API key from $XLAGEN_API_KEY is empty"),
    (["--api-key-file", os.devnull], {}, "is empty"),
])
def test_an_empty_key_is_a_start_up_error(args, env, words):
    process = _serve(["--port", "0", *args], env=env)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("xlagen: error:") and words in lines[0]


def test_a_port_in_use_fails_at_once():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = _serve(["--port", str(port)])
        _, stderr = process.communicate(timeout=120)
    assert process.returncode == 1  # with no line of the model's loading before it
    assert stderr.strip().splitlines() == [f"xlagen: error: cannot listen on 127.0.0.1:{port}: the address is in use "
                                           "(another server listens there)"]
