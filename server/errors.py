"""Every error leaves as JSON {"error": message, "error_type": kind} with a fitting status code."""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from hfport.errors import HfportError

from .store import StoreUnavailable

log = logging.getLogger("hfport.server")

STORE_RETRY_AFTER_S = 5  # what a 503 for an unanswering database tells clients to wait before they retry
STATUS_TYPES = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 405: "MethodNotAllowed",
                409: "Conflict", 413: "PayloadTooLarge", 415: "UnsupportedMediaType", 422: "ValidationError",
                429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable", 504: "Timeout"}


class ApiError(Exception):
    """Raised by handlers and helpers: becomes a JSON error response."""

    def __init__(self, status: int, message: str, error_type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message = status, message
        self.error_type = error_type or STATUS_TYPES.get(status, "Error")
        self.headers = headers


def error_response(status: int, message: str, error_type: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "error_type": error_type}, status_code=status, headers=headers)


def store_unavailable(exc: StoreUnavailable) -> ApiError:
    """A database that does not answer (stopped, cut off, past a transaction's deadline): 503 naming it (the store's
    message never holds a password) with Retry-After, the same on every API process. Logged as one line: an outage
    fails every request, and a traceback each would bury the log."""
    cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    log.warning("the job store does not answer: %s", cause)
    return ApiError(503, f"the job store does not answer ({cause}); retry in a few seconds", "StoreUnavailable",
                    {"Retry-After": str(STORE_RETRY_AFTER_S)})


def validation_message(exc: RequestValidationError | ValidationError) -> str:
    parts = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":  # its location is the character where parsing stopped, not a field
            where = err.get("loc", ())[-1]
            parts.append(f"body: not valid JSON at character {where} ({(err.get('ctx') or {}).get('error', '')})"
                         .replace(" ()", ""))
            continue
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        parts.append(f"{loc}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request"


class ShapedErrorRoute(APIRoute):
    """A route that answers the errors in `shaped` in its API's own shape (`shape`) rather than hfport's; the app's
    handlers (install) answer the rest."""

    shaped: tuple[type[Exception], ...] = ()

    def shape(self, exc: Exception) -> Response:
        raise NotImplementedError

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except self.shaped as e:
                return self.shape(e)

        return route


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.error_type, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return error_response(exc.status_code, message, STATUS_TYPES.get(exc.status_code, "HTTPError"),
                              getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, validation_message(exc), "ValidationError")

    @app.exception_handler(HfportError)
    async def _hfport(request: Request, exc: HfportError) -> JSONResponse:
        return error_response(400, str(exc), type(exc).__name__)

    @app.exception_handler(StoreUnavailable)
    async def _store(request: Request, exc: StoreUnavailable) -> JSONResponse:
        error = store_unavailable(exc)
        return error_response(error.status, error.message, error.error_type, error.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error ({type(exc).__name__}); see the server log", "InternalError")
