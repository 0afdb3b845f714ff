"""Bearer-token check, server-side path confinement, and the request body size limit."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Annotated

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import ApiError, error_response
from .settings import Settings, SettingsDep

_bearer = HTTPBearer(auto_error=False, description="HFPORT_API_TOKEN, when the server is started with one")


def require_token(settings: SettingsDep,
                  credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    """401 without a token, 403 with a wrong one; a no-op when the server has no token."""
    if settings.api_token is None:
        return
    if credentials is None or credentials.scheme.lower() != "bearer" or not credentials.credentials:
        raise ApiError(401, "this server needs 'Authorization: Bearer <token>'", "Unauthorized",
                       headers={"WWW-Authenticate": "Bearer"})
    if not secrets.compare_digest(credentials.credentials.encode(), settings.api_token.encode()):
        raise ApiError(403, "the bearer token is not valid for this server", "Forbidden")


Authorized = Depends(require_token)


def confine(path: str | os.PathLike[str], settings: Settings, what: str = "path", must_exist: bool = True) -> Path:
    """The real path of `path` when it lies inside an allowed dir. Relative paths are taken from the data dir.

    400 for '..' components, an empty or NUL-containing path, or a missing file; 403 when the resolved path
    (symlinks followed) falls outside every allowed dir."""
    text = os.fspath(path)
    if not text or "\x00" in text:
        raise ApiError(400, f"{what}: empty or invalid path", "InvalidPath")
    raw = Path(text).expanduser()
    if ".." in raw.parts:
        raise ApiError(400, f"{what}: '..' is not allowed in server-side paths ({text!r})", "InvalidPath")
    full = raw if raw.is_absolute() else settings.data_dir / raw
    try:
        real = full.resolve(strict=False)
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise ApiError(400, f"{what}: cannot be resolved ({e})", "InvalidPath") from e
    if not any(real == root or real.is_relative_to(root) for root in settings.roots):
        raise ApiError(403, f"{what}: {text!r} is outside the allowed directories "
                            f"({', '.join(str(r) for r in settings.roots)})", "PathNotAllowed")
    if must_exist and not real.exists():
        raise ApiError(400, f"{what}: {text!r} does not exist", "InvalidPath")
    return real


def confine_files(folder: str | os.PathLike[str], settings: Settings, what: str = "path") -> None:
    """Every file and folder under FOLDER (a model folder the server reads) resolves inside an allowed dir: a symlink
    out (vocab.txt -> /etc/...) is refused with 403 as a path outside them is; confining the folder alone would still
    let the tokenizer or the loader read through it. Symlinked folders are walked too (each real folder once)."""
    root = Path(folder)
    seen: set[Path] = set()

    def check(path: Path) -> Path:
        try:
            real = path.resolve(strict=False)
        except (OSError, RuntimeError) as e:  # a symlink loop
            raise ApiError(400, f"{what}: {path} cannot be resolved ({e})", "InvalidPath") from e
        if not any(real == r or real.is_relative_to(r) for r in settings.roots):
            raise ApiError(403, f"{what}: {path} links outside the allowed directories "
                                f"({', '.join(str(r) for r in settings.roots)})", "PathNotAllowed")
        return real

    for top, dirs, files in os.walk(root, followlinks=True):
        real = check(Path(top))
        if real in seen:  # a link back into a folder already walked
            dirs[:] = []
            continue
        seen.add(real)
        for name in files:
            check(Path(top) / name)


class BodyLimit:
    """Refuses request bodies over a limit with 413 before the app parses them: by Content-Length when given,
    else while streaming. Upload routes get settings.max_data_bytes, every other route max_request_bytes."""

    def __init__(self, app: ASGIApp, settings: Settings, upload_paths: tuple[str, ...]):
        self.app, self.settings, self.upload_paths = app, settings, upload_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        upload = scope["path"].rstrip("/") in self.upload_paths
        limit = self.settings.max_data_bytes if upload else self.settings.max_request_bytes
        what, setting = ("upload", "HFPORT_MAX_DATA_BYTES") if upload else ("request body", "HFPORT_MAX_REQUEST_BYTES")
        message = f"{what} larger than the server's limit of {limit} bytes ({setting})"
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await error_response(413, message, "PayloadTooLarge")(scope, receive, send)
            return
        seen, exceeded, started = 0, False, False

        async def limited_receive() -> Message:
            nonlocal seen, exceeded
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    exceeded = True
                    raise ApiError(413, message, "PayloadTooLarge")
            return msg

        async def guarded_send(msg: Message) -> None:
            nonlocal started
            if exceeded and not started:
                return  # the 413 below replaces whatever the app made of the cut-off body
            started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not exceeded:
                raise
        if exceeded and not started:
            await error_response(413, message, "PayloadTooLarge")(scope, receive, send)
