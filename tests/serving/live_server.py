"""A real uvicorn server on a free loopback port, in a thread of the test process; waiting for one in a process."""

from __future__ import annotations

import contextlib
import threading
import time


@contextlib.contextmanager
def running(app, ready_timeout: float = 120.0, wait_healthy: bool = True, limits=None):
    """Serves `app` on 127.0.0.1:<free port> as `xlagen serve` does (`xlagen.serving.http.server_for`, with
    `limits`); yields (base url, the uvicorn server); stops it (a graceful drain)."""
    import httpx

    from xlagen.serving.http import HttpLimits, bind, server_for

    sock = bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = server_for(app, limits or HttpLimits(graceful_timeout=30))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + ready_timeout
        while not server.started or (wait_healthy and httpx.get(url + "/health").status_code != 200):
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not become ready"
            time.sleep(0.05)
        yield url, server
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()


def wait_healthy(process, url: str, timeout: float = 300.0) -> None:
    """Waits until the server process at `url` answers /health with 200 (failing if the process ends first)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, process.stderr.read()
        assert time.monotonic() < deadline, "the server did not become ready"
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
