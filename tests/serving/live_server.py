"""A real uvicorn server on a free loopback port, in a thread of the test process."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


@contextlib.contextmanager
def running(app, ready_timeout: float = 120.0, wait_healthy: bool = True):
    """Serves `app` on 127.0.0.1:<free port>; yields (base url, uvicorn.Server); stops it (a graceful drain)."""
    import httpx
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=30))
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
