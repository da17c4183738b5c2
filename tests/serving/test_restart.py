"""Restarts on a filled compile cache: `xlagen serve --compile-cache DIR` stopped with SIGTERM and started again
on the same DIR, and `xlagen generate --compile-cache DIR` run twice, each in its own process, give the first
run's greedy text. The second process loads its programs, native kernels' custom calls included, from
TensorFlow's persistent XLA cache rather than compiling them."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from conftest import require_extra

SRC = str(Path(__file__).resolve().parents[2] / "src")
PROMPT = "In the beginning"


def _environment() -> dict[str, str]:
    environment = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1"}
    environment.pop("XLAGEN_API_KEY", None)
    return environment


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def _serving(model: str, cache: Path, log: Path) -> Iterator[str]:
    """`xlagen serve model --compile-cache cache` on a free loopback port, its stderr in `log`; yields its URL
    once /health answers 200, then stops it with SIGTERM and checks that it exits 0."""
    import httpx

    port = _free_port()
    with open(log, "w") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "xlagen.cli", "serve", model, "--port", str(port),
                                    "--prompt-buckets", "16", "--compile-cache", str(cache)],
                                   env=_environment(), stdout=subprocess.DEVNULL, stderr=stderr)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None, f"xlagen serve exited with {process.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "xlagen serve did not become healthy"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health").status_code == 200:
                    break
            time.sleep(0.2)
        yield url
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _complete(url: str) -> dict:
    import httpx

    response = httpx.post(url + "/v1/completions", timeout=120,
                          json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return {"text": choice["text"], "tokens": choice["logprobs"]["tokens"]}


def test_serve_restarts_on_its_compile_cache(gpt2_checkpoint, tmp_path):
    require_extra("fastapi", "uvicorn", "prometheus_client", "httpx", "multipart", "jinja2")
    cache = tmp_path / "cache"
    with _serving(gpt2_checkpoint[0], cache, tmp_path / "first.log") as url:
        first = _complete(url)
    written = sorted(os.listdir(cache))
    assert any(name.startswith("xla_compile_cache") for name in written)
    with _serving(gpt2_checkpoint[0], cache, tmp_path / "second.log") as url:
        second = _complete(url)
    assert second == first
    assert sorted(os.listdir(cache)) == written  # every program of the second start came from the cache
    # A normal start, cold or from the cache, prints nothing: no retracing warning, no log of the cache's loads.
    assert (tmp_path / "first.log").read_text() == (tmp_path / "second.log").read_text() == ""


def test_generate_twice_on_one_compile_cache(gpt2_checkpoint, tmp_path):
    command = [sys.executable, "-m", "xlagen.cli", "generate", "--model", gpt2_checkpoint[0], "--greedy",
               "--max-new-tokens", "8", "--compile-cache", str(tmp_path / "cache"), PROMPT]
    runs = [subprocess.run(command, capture_output=True, text=True, timeout=300, env=_environment())
            for _ in range(2)]
    for run in runs:
        assert run.returncode == 0 and run.stderr == "", run.stderr[-3000:]
    assert runs[1].stdout == runs[0].stdout and runs[0].stdout.startswith(PROMPT)
