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

log = logging.getLogger("hfport.server")

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


def validation_message(exc: RequestValidationError | ValidationError) -> str:
    parts = []
    for err in exc.errors():
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

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error ({type(exc).__name__}); see the server log", "InternalError")
