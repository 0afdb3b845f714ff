"""GET /docs works on a host without internet: the page names only this server's URLs, and those answer with Swagger
UI's script, stylesheet and icon from the installed swagger-ui-bundle-v2 package (FastAPI's default page loads them
from a CDN, and is blank offline)."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

from server.app import create_app
from server.settings import Settings


def test_docs_page_and_its_assets_are_served_locally(tmp_path):
    app = create_app(Settings(data_dir=tmp_path / "data", api_token="t0ken"), run_worker=False)
    with TestClient(app) as client:
        auth = {"Authorization": "Bearer t0ken"}
        assert client.get("/docs").status_code == 401  # the page and the schema stay behind the token
        page = client.get("/docs", headers=auth)
        assert page.status_code == 200, page.text
        urls = re.findall(r'(?:src|href)="([^"]+)"', page.text) + re.findall(r"url: '([^']+)'", page.text)
        assert urls and all(u.startswith("/") and not u.startswith("//") for u in urls), urls
        types = {}
        for url in urls:
            r = client.get(url, headers=auth)
            assert r.status_code == 200 and r.content, (url, r.status_code)
            types[url.rsplit(".", 1)[-1]] = (r.headers["content-type"], r.content)
        assert types["js"][0].startswith("text/javascript") and b"SwaggerUIBundle" in types["js"][1]
        assert types["css"][0].startswith("text/css") and b".swagger-ui" in types["css"][1]
        assert types["png"][0] == "image/png" and types["json"][1].startswith(b"{")
        assert client.get("/docs/assets/index.html", headers=auth).status_code == 404  # only the page's own files
        assert client.get("/docs/assets/..%2F..%2Fsettings.py", headers=auth).status_code == 404
