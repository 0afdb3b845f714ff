"""The documentation cannot rot (issue 45, item 3): the site under docs/ builds with `mkdocs build --strict` (a broken
link, a missing anchor or a page left out of mkdocs.yml's nav fails it), offline (the built pages load nothing from
another host), the README stays a short guide (at most 300 lines, the two-command quick start) whose links and
anchors resolve, every repository path the pages name in backticks exists, and every `hfport` command line the pages
show (in bash blocks and in `hfport ...` code spans) names a subcommand the CLI has, only flags that subcommand takes,
and, for finetune, `--set` keys that are FinetuneConfig fields or transformers' names for them (nothing is run).

mkdocs and mkdocs-material are in the dev extra. Without them the build test skips, saying so; under CI=true that is a
failure, as a missing package would otherwise hide a broken site."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer.main

from hfport.cli import app
from hfport.train.aliases import ALIASES
from hfport.train.config import FinetuneConfig

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


# shell words that end a command: what follows them is another command
SHELL_SEPARATORS = {"|", "||", "&", "&&", ";", ">", ">>", "<", "(", ")"}


def hfport_invocations(line: str) -> list[list[str]]:
    """The argument lists of every `hfport` command in a shell command line: `hfport X ...`, `python -m hfport X`,
    `accelerate launch ... -m hfport X`, `VAR=value hfport X`, and inside a quoted `bash -c '...'`. Comments are
    dropped; a [bracketed] optional part counts as written."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    tokens = list(lexer)
    found = []
    for i, token in enumerate(tokens):
        if token != "hfport" and re.search(r"(^|\s)hfport\s", token):  # bash -c '... hfport finetune ...'
            found += hfport_invocations(token)
        starts = i == 0 or tokens[i - 1] in SHELL_SEPARATORS or tokens[i - 1] == "-m" or "=" in tokens[i - 1]
        if token == "hfport" and starts:
            args = []
            for t in tokens[i + 1:]:
                if t in SHELL_SEPARATORS:
                    break
                args.append(t.strip("[]"))
            found.append(args)
    return found


def documented_commands(text: str) -> list[list[str]]:
    """hfport argument lists in a page's bash blocks (a line continued with a backslash, or a quoted JSON body that
    runs on over lines, is one command) and in its `hfport ...` code spans."""
    found = []
    for block in re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", text, re.S):
        pending = ""
        for line in re.sub(r"\\\n", " ", block).splitlines():
            pending += ("\n" if pending else "") + line
            try:
                shlex.split(pending, comments=True)
            except ValueError:  # an open quote: the command goes on over the next line
                continue
            found += hfport_invocations(pending)
            pending = ""
        assert not pending, f"a bash block ends inside a quote: {pending!r}"
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`(hfport [^`]+)`", prose):
        found += hfport_invocations(span)
    return found


@functools.cache
def cli_commands() -> dict[str, Any]:
    """The `hfport` subcommands as click builds them from the typer app: name -> command."""
    return typer.main.get_command(app).commands


def command_problems(args: list[str]) -> list[str]:
    """What in one documented `hfport` argument list the CLI does not take: an unknown subcommand, a flag the
    subcommand has no option for, a finetune `--set` key that is no config field."""
    commands = cli_commands()
    if not args or args[0] not in commands:
        return [f"no subcommand {args[0] if args else ''!r} (the CLI has {sorted(commands)})"]
    command = commands[args[0]]
    takes = set(command.context_settings.get("help_option_names", ["--help"]))
    for param in command.params:
        takes |= {*param.opts, *param.secondary_opts}
    problems = [f"{args[0]}: no option {flag}" for a in args[1:] if a.startswith("-") and a != "-"
                for flag in [a.split("=", 1)[0]] if flag not in takes]
    if args[0] == "finetune":
        keys = [v.split("=", 1)[0] for flag, v in zip(args, args[1:]) if flag == "--set"]
        fields = set(FinetuneConfig.model_fields) | {k for k, alias in ALIASES.items() if alias.field or alias.expand}
        problems += [f"finetune: --set {key}: no such option" for key in keys if key not in fields]
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_documented_hfport_commands_exist(page):
    """A renamed or removed subcommand, flag or fine-tune option breaks this test instead of the page's reader."""
    problems = [f"`hfport {' '.join(args)}`: {problem}" for args in documented_commands(page.read_text("utf-8"))
                for problem in command_problems(args)]
    assert not problems, f"{page.relative_to(ROOT)}: " + "; ".join(problems)


def test_documented_commands_are_found_and_checked():
    """The parser sees the forms the pages use, and the check catches what it is for."""
    text = """```bash
export MODEL=x   # a comment with hfport finetune --nope
HFPORT_PREDICT_DTYPE=int8 hfport serve --model m
hfport finetune --model m --train t.csv \\
    --output-dir run [--set scheduler=cosine]
curl -X POST localhost:8000/jobs -d '{"config":
     {"model": "m"}}' && python -m hfport info m --json
srun bash -c 'accelerate launch --multi_gpu -m hfport finetune --config run.yaml'
```
Text with `hfport predict DIR --file model.onnx` and `hfport/cli.py`."""
    assert documented_commands(text) == [
        ["serve", "--model", "m"], ["finetune", "--model", "m", "--train", "t.csv", "--output-dir", "run", "--set",
                                    "scheduler=cosine"],
        ["info", "m", "--json"], ["finetune", "--config", "run.yaml"], ["predict", "DIR", "--file", "model.onnx"]]
    assert all(not command_problems(args) for args in documented_commands(text))
    assert command_problems(["predict", "m", "--taks", "x"]) == ["predict: no option --taks"]
    assert command_problems(["fine-tune"])[0].startswith("no subcommand 'fine-tune'")
    assert command_problems(["finetune", "--set", "learning_rate=1", "--set", "lern_rate=1"]) == [
        "finetune: --set lern_rate: no such option"]
    assert command_problems(["predict", "-h"]) == ["predict: no option -h"]  # only finetune takes -h
    assert command_problems(["finetune", "-h", "--no-group-by-length"]) == []
