"""`ServerSettings`: what the HTTP server allows and how long it waits (numpy-free, importable without
TensorFlow or FastAPI)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """How the server behaves.

    Attributes:
        model_name: The id `/v1/models` lists and requests may name.
        api_key: Required as `Authorization: Bearer ...` on `/v1/*` when set; never empty (an unset variable
            expanded into `--api-key ""` must not mean "any key").
        max_body_bytes: Larger request bodies get 413.
        request_timeout: Seconds a request may take (its deadline); None for no limit.
        max_n: Largest `n` (choices per prompt) accepted.
        retry_after: Seconds announced in `Retry-After` with a 429.
        host: The address the server listens on; it decides which `Host` headers are answered (see
            `xlagen.serving.guard.host_allowed`).
        allowed_hosts: More host names to answer to (`*` any, `.example.com` the domain and its subdomains).
        allowed_origins: Browser origins (`https://app.example.com`, or `*`) allowed to call the API, with CORS
            answers; a request with any other `Origin` header is refused (403).
        body_timeout: Seconds a client has to send a request's body once its headers arrived (408 after).
        beam_sizes: The `num_beams` values above 1 that are served (each compiles its own programs); others 400.
    """

    model_name: str
    api_key: str | None = dataclasses.field(default=None, repr=False)
    max_body_bytes: int = 25 * 1024 * 1024
    request_timeout: float | None = 600.0
    max_n: int = 8
    retry_after: int = 1
    host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    body_timeout: float = 60.0
    beam_sizes: tuple[int, ...] = (2, 4)

    def __post_init__(self):
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty: give a non-empty key, or none to serve without one")
        if self.api_key is not None and any(c.isspace() or not c.isprintable() for c in self.api_key):
            raise ValueError("the API key holds whitespace or control characters, which no Authorization header "
                             "can carry")
        for name in ("max_body_bytes", "max_n", "retry_after"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("request_timeout", "body_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if any(size < 2 for size in self.beam_sizes):
            raise ValueError(f"beam_sizes are num_beams values >= 2, got {self.beam_sizes}")
        object.__setattr__(self, "allowed_hosts", tuple(h.strip().lower().strip("[]").rstrip(".")
                                                        for h in self.allowed_hosts))
        object.__setattr__(self, "allowed_origins", tuple(o.strip().rstrip("/") for o in self.allowed_origins))
