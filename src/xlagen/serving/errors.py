"""Every error the server answers, in OpenAI's error JSON (`{"error": {"message", "type", "param", "code"}}`):
the routes' `RequestError`s, the backends' errors, and the framework's own 404, 405 and 422."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from xlagen.serving.protocol import RequestError
from xlagen.serving.streams import EngineClosed, QueueFull

_STATUS_ERRORS = {404: ("not_found_error", "not_found"), 405: ("invalid_request_error", "method_not_allowed")}


def error_response(error: RequestError, headers: dict | None = None) -> JSONResponse:
    """The response of `error`: its status and OpenAI's error JSON."""
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def install_error_handlers(app: FastAPI, retry_after: int) -> None:
    """Answers every error of `app`'s routes in OpenAI's shape (`retry_after`: seconds announced with a 429)."""

    @app.exception_handler(RequestError)
    async def request_error(request: Request, error: RequestError):
        return error_response(error)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        error_type, code = _STATUS_ERRORS.get(error.status_code, ("invalid_request_error", None))
        message = (f"no route {request.method} {request.url.path}" if error.status_code == 404 else
                   f"{request.method} is not allowed on {request.url.path}" if error.status_code == 405 else
                   str(error.detail))
        return error_response(RequestError(message, status=error.status_code, error_type=error_type, code=code),
                              headers=getattr(error, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        first = (error.errors() or [{}])[0]
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        return error_response(RequestError(f"{first.get('msg', 'invalid request')}", where, status=422))

    @app.exception_handler(QueueFull)
    async def queue_full(request: Request, error: QueueFull):
        return error_response(RequestError(f"the server is busy: {error}", status=429, error_type="rate_limit_error",
                                           code="queue_full"), headers={"Retry-After": str(retry_after)})

    @app.exception_handler(EngineClosed)
    async def closed(request: Request, error: EngineClosed):
        return error_response(RequestError(f"the server is shutting down: {error}", status=503,
                                           error_type="server_error", code="shutting_down"))

    @app.exception_handler(ValueError)
    async def bad_value(request: Request, error: ValueError):  # the backends' checks of a request
        return error_response(RequestError(str(error)))

    @app.exception_handler(TypeError)
    async def bad_type(request: Request, error: TypeError):
        return error_response(RequestError(str(error)))
