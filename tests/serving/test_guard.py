"""The server's request guard and HTTP limits as units: which Host headers are answered, CORS for allowed origins,
settings refused at construction, query strings kept out of the access log."""

from __future__ import annotations

import logging

import pytest

from conftest import require_extra
from serving.live_server import running

require_extra("fastapi", "uvicorn", "prometheus_client", "httpx", "multipart", "jinja2")

import httpx  # noqa: E402

from xlagen.serving.guard import host_allowed, host_name  # noqa: E402
from xlagen.serving.settings import ServerSettings  # noqa: E402


@pytest.mark.parametrize("header, name", [("localhost:8000", "localhost"), ("[::1]:8000", "::1"), ("[::1]", "::1"),
                                          ("Example.COM.", "example.com"), ("10.0.0.5", "10.0.0.5")])
def test_host_name(header, name):
    assert host_name(header) == name


@pytest.mark.parametrize("name, bound, allowed, answered", [
    ("localhost", "127.0.0.1", (), True), ("127.0.0.1", "127.0.0.1", (), True), ("::1", "::1", (), True),
    ("app.localhost", "127.0.0.1", (), True),
    ("evil.example", "127.0.0.1", (), False),  # DNS rebinding: a name the attacker controls
    ("192.168.1.9", "127.0.0.1", (), False),
    ("192.168.1.9", "192.168.1.9", (), True), ("192.168.1.8", "192.168.1.9", (), False),
    ("10.1.2.3", "0.0.0.0", (), True),  # bound to every interface: any IP literal (no name, no rebinding)
    ("localhost", "0.0.0.0", (), True), ("api.example.com", "0.0.0.0", (), False),
    ("api.example.com", "0.0.0.0", ("api.example.com",), True),
    ("a.b.example.com", "0.0.0.0", (".example.com",), True), ("example.com", "0.0.0.0", (".example.com",), True),
    ("badexample.com", "0.0.0.0", (".example.com",), False), ("anything", "10.0.0.1", ("*",), True),
    ("localhost", "192.168.1.9", (), False),
])
def test_host_allowed(name, bound, allowed, answered):
    assert host_allowed(name, bound, allowed) is answered


@pytest.mark.parametrize("settings, words", [
    (dict(api_key=""), "API key is empty"), (dict(api_key="  "), "API key is empty"),
    (dict(api_key="a b"), "whitespace"), (dict(max_n=0), "max_n"), (dict(body_timeout=0), "body_timeout"),
    (dict(beam_sizes=(1, 2)), "beam_sizes"),
])
def test_settings_refused(settings, words):
    with pytest.raises(ValueError, match=words):
        ServerSettings("m", **settings)


def test_the_key_is_not_in_the_settings_repr():
    assert "sesame" not in repr(ServerSettings("m", api_key="sesame"))


def test_cors_for_allowed_origins(gpt2_model, gpt2_checkpoint):
    from xlagen import AutoTokenizer
    from xlagen.serving.batcher import RequestBatcher
    from xlagen.serving.server import Backends, create_app

    tokenizer = AutoTokenizer.from_pretrained(gpt2_checkpoint[0])
    settings = ServerSettings("tiny", api_key="k", allowed_origins=("https://app.example",))
    backend = RequestBatcher(gpt2_model, tokenizer, max_batch=1)
    with running(create_app(Backends(tokenizer, text=backend), settings)) as (url, _):
        preflight = httpx.options(url + "/v1/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        allowed = httpx.get(url + "/v1/models", headers={"Origin": "https://app.example", "Authorization": "Bearer k"})
        other = httpx.get(url + "/v1/models", headers={"Origin": "https://evil.example", "Authorization": "Bearer k"})
        other_preflight = httpx.options(url + "/v1/completions", headers={
            "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 200  # no key needed: browsers send none with a preflight
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "https://app.example"
    assert other.status_code == 403 and "access-control-allow-origin" not in other.headers
    assert other_preflight.status_code == 403


def test_query_strings_are_not_logged():
    from xlagen.serving.http import RedactQueries

    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "GET", "/v1/models?api_key=sesame", "1.1", 200), None)
    assert RedactQueries().filter(record)
    assert "sesame" not in record.getMessage() and "/v1/models?[redacted]" in record.getMessage()


@pytest.mark.parametrize("address, loopback", [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True),
                                               ("localhost", True), ("0.0.0.0", False), ("::", False),
                                               ("10.0.0.5", False), ("example.com", False)])
def test_is_loopback(address, loopback):
    from xlagen.serving.guard import is_loopback

    assert is_loopback(address) is loopback
