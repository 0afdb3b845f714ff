"""GET /: the dashboard, one static page (server/static/index.html) and its chart script (/static/charts.js,
hfport/train/static/charts.js: the one report.html inlines). The page holds no data: it fetches /jobs,
/models, /predict and the SSE stream with the token the user types in, so it is served without one."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response

from hfport.train import charts_js

from ..errors import ApiError

router = APIRouter(tags=["dashboard"])
PAGE = Path(__file__).resolve().parent.parent / "static" / "index.html"


@router.get("/", response_class=HTMLResponse, summary="The dashboard page")
def dashboard() -> HTMLResponse:
    if not PAGE.is_file():
        raise ApiError(503, f"the dashboard page is missing from this install ({PAGE}); the API works without it",
                       "DashboardUnavailable")
    return HTMLResponse(PAGE.read_text(encoding="utf-8"))


@router.get("/static/charts.js", include_in_schema=False)
def charts() -> Response:
    """The chart script, from the library (report.html inlines the same file)."""
    return Response(charts_js(), media_type="text/javascript")
