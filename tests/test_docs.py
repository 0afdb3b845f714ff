"""The documentation cannot rot (issue 45, item 3): the site under docs/ builds with `mkdocs build --strict` (a broken
link, a missing anchor or a page left out of mkdocs.yml's nav fails it), offline (the built pages load nothing from
another host), the README stays a short guide (at most 300 lines, the two-command quick start) whose links and
anchors resolve, and every repository path the pages name in backticks exists.

mkdocs and mkdocs-material are in the dev extra. Without them the build test skips, saying so; under CI=true that is a
failure, as a missing package would otherwise hide a broken site."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

try:  # markdown comes with mkdocs (the dev extra); the tests that need it say so when it is missing
    from markdown.extensions.toc import slugify
except ImportError:
    slugify = None

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, ROOT / "CONTRIBUTING.md", *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 300  # the bound: the README guides, the topic pages under docs/ hold the detail

# a repository path in backticks: `hfport/nn/int8.py`, `scripts/bench.py`, `tests/test_ddp.py`, `docs/benchmarks.md`
PATH_IN_BACKTICKS = re.compile(r"`((?:hfport|server|scripts|tests|examples|docs)/[^`\s]*)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")  # a markdown link's target: [text](target)


def _needs_mkdocs() -> None:
    missing = [m for m in ("mkdocs", "material") if importlib.util.find_spec(m) is None]
    if missing:
        why = f"{', '.join(missing)} not installed (pip install -e '.[dev]')"
        if os.environ.get("CI"):
            pytest.fail(f"the docs build must run under CI: {why}")
        pytest.skip(why)


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension (mkdocs' default) gives a heading."""
    return slugify(heading, "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # a `# comment` is no heading
    return {_slug(m.group(1).strip()) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def test_site_builds_strict_and_offline(tmp_path):
    _needs_mkdocs()
    site = tmp_path / "site"
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
               "--site-dir", str(site)]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # material's notice about mkdocs 2.0
    assert run.returncode == 0, run.stdout + run.stderr
    pages = sorted(site.rglob("*.html"))
    assert {p.stem for p in DOCS.glob("*.md")} <= {p.parent.name for p in pages} | {"index"}
    for page in pages:  # stylesheets, scripts and fonts all come from the site itself
        html = page.read_text(encoding="utf-8")
        loads = re.findall(r"<(?:link|script)\b[^>]*\b(?:href|src)=\"(?:https?:)?//[^\"]+\"", html)
        assert not loads, f"{page.relative_to(site)} loads from another host: {loads}"


def test_readme_is_a_short_guide():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to a page under docs/"
    text = "\n".join(lines)
    quick = re.search(r"## Quick start\n+```bash\n(.*?)```", text, re.S)
    assert quick, "README.md has no Quick start block"
    assert [line.split("#")[0].strip() for line in quick.group(1).splitlines()] == ["make demo", "make test"]
    assert "HFPORT_AUTO_TRUNCATE" in text  # the truncation setting is stated where users start


@pytest.mark.parametrize("page", [README, ROOT / "CONTRIBUTING.md"], ids=lambda p: p.name)
def test_links_and_anchors_resolve(page):
    """mkdocs checks the pages under docs/; the README and CONTRIBUTING.md sit outside the site, so this checks
    theirs: every relative link names a file that exists, and a #anchor one of its headings."""
    _needs_mkdocs()
    broken = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT)}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_paths_the_pages_name_exist():
    missing = []
    for page in PAGES:
        for path in PATH_IN_BACKTICKS.findall(page.read_text(encoding="utf-8")):
            if any(c in path for c in "<{*"):  # a pattern such as hfport/models/<family>.py
                continue
            if not (ROOT / path.split("::")[0]).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "paths named in the docs that do not exist: " + ", ".join(missing)
