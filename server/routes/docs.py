"""The API's own description: GET /openapi.json and its browser view GET /docs (Swagger UI), behind the token when
one is set, as every route but /health and the dashboard. Swagger UI's script, stylesheet and icon are served from the
installed swagger-ui-bundle-v2 package (Apache-2.0) at /docs/assets/, not fetched from a CDN as FastAPI's default page
does, so the docs work on a host without internet."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from swagger_ui_bundle import swagger_ui_path

from ..errors import ApiError

ASSETS_PATH = "/docs/assets"
ASSETS = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css", "favicon-32x32.png": "image/png"}
DIST = Path(str(swagger_ui_path))  # swagger-ui's dist folder inside the package

router = APIRouter(include_in_schema=False)


@router.get("/openapi.json")
def openapi(request: Request) -> dict:
    return request.app.openapi()


@router.get("/docs")
def docs() -> HTMLResponse:
    return get_swagger_ui_html(openapi_url="/openapi.json", title="hfport API",
                               swagger_js_url=f"{ASSETS_PATH}/swagger-ui-bundle.js",
                               swagger_css_url=f"{ASSETS_PATH}/swagger-ui.css",
                               swagger_favicon_url=f"{ASSETS_PATH}/favicon-32x32.png")


@router.get(ASSETS_PATH + "/{name}")
def asset(name: str) -> FileResponse:
    """One of Swagger UI's files, by name from a fixed list (nothing else of the package is reachable)."""
    if name not in ASSETS:
        raise ApiError(404, f"no docs asset {name!r}; there are {sorted(ASSETS)}", "NotFound")
    path = DIST / name
    if not path.is_file():
        raise ApiError(503, f"{path} is missing: reinstall swagger-ui-bundle-v2 (hfport's dependency)",
                       "DocsUnavailable")
    return FileResponse(path, media_type=ASSETS[name])
