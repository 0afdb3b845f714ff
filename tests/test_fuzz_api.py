"""API fuzzing: schemathesis generates requests from the live OpenAPI schema of a real `hfport serve` on loopback
and checks every response: no 5xx, and status code, content type, headers and body as the schema documents them.

Every route is covered: the app's routes (walked in-process, schema or not) are the schema's operations plus
NOT_IN_SCHEMA (each with its reason), and the operations fuzzed (at least one request answered each) are all of the
schema's: TEI, OpenAI, native and jobs. A tiny model is served as the default, so the TEI and OpenAI routes run
tokenization and inference instead of answering "no model".

Bounded and repeatable: MAX_EXAMPLES per operation, derandomized (a fixed seed), no example database, a hard
time cap for the whole run. Nothing is excluded: job submissions cannot start long jobs here, because the only
model folder and data lie where generated strings do not reach, and the server's limits are set small."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import schemathesis  # a dev dependency: missing, the test fails rather than skips

from tests.test_reliability import walk_routes
from tests.test_server import Server
from tests.tiny import save_hf

MAX_EXAMPLES = 20  # per operation and mode (schema-valid data, then schema-violating data)
TIME_CAP_S = 100.0  # the whole run; the test fails (naming what was left) rather than run on past it
TOKEN = "fuzz-token"
CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_headers_conformance", "response_schema_conformance")


# routes outside the OpenAPI schema, and why they are not fuzzed from it
NOT_IN_SCHEMA = {
    ("GET", "/openapi.json"): "the schema itself (the fuzzer reads it)",
    ("GET", "/docs"): "the Swagger page over the schema: static HTML, no input",
    ("GET", "/static/charts.js"): "a static file of the package, no input",
    ("GET", "/docs/assets/{name}"): "Swagger UI's files for /docs, from a fixed list (tests/test_docs_offline.py)",
}
# schema operations not fuzzed, and why (none: every documented operation gets requests)
NOT_FUZZED: dict[tuple[str, str], str] = {}
TINY_MODEL = "emb"


@pytest.fixture(scope="module")
def live(tmp_path_factory, minilm_path):
    base = tmp_path_factory.mktemp("fuzz")
    allowed = base / "allowed"
    allowed.mkdir()
    # a tiny random BERT with MiniLM's tokenizer, outside the allowed dirs (generated paths cannot reach it)
    model = base / "models" / TINY_MODEL
    save_hf("bert", "base", model, vocab_size=30522)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(minilm_path / name, model / name)
    srv = Server(base / "data", allowed, workers=1, HFPORT_API_TOKEN=TOKEN, HFPORT_MAX_REQUEST_BYTES=str(64 * 1024),
                 HFPORT_MAX_DATA_BYTES=str(64 * 1024), HFPORT_PREDICT_MAX_INPUTS="8",
                 HFPORT_PREDICT_MAX_CHARS="2000", HFPORT_PREDICT_TIMEOUT_S="10",
                 HFPORT_MODELS=f"{TINY_MODEL}={model}", HFPORT_BATCH_TOKEN_BUDGETS="[]").start()
    yield srv
    srv.stop()


def app_routes(tmp_path) -> set[tuple[str, str]]:
    """(method, path) of every route the app serves, in the schema or not (built in-process, no worker)."""
    from fastapi.routing import APIRoute
    from starlette.routing import Route

    from server.app import create_app
    from server.settings import Settings

    app = create_app(Settings(data_dir=tmp_path / "routes", api_token=TOKEN), run_worker=False)
    return walk_routes(app.routes, (APIRoute, Route))


def fuzz(op, mode, body):
    """A hypothesis test over the operation's generated cases: derandomized, no database, bounded."""
    from hypothesis import HealthCheck, Phase, given, settings

    @settings(max_examples=MAX_EXAMPLES, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case):
        body(case)

    return run


def test_fuzz_openapi_no_5xx_no_schema_violations(live, tmp_path):
    import requests
    from schemathesis.checks import CHECKS as REGISTRY  # the registry of built-in checks, by name
    from schemathesis.checks import load_all_checks

    auth = {"Authorization": f"Bearer {TOKEN}"}
    schema = schemathesis.openapi.from_url(f"{live.url}/openapi.json", headers=auth, timeout=30)
    load_all_checks()
    checks = [REGISTRY.get_one(name) for name in CHECKS]
    operations = [result.ok() for result in schema.get_all_operations()]
    spec = json.loads(requests.get(f"{live.url}/openapi.json", headers=auth, timeout=30).text)
    documented = {(m.upper(), p) for p, methods in spec["paths"].items() for m in methods}
    assert {(op.method.upper(), op.path) for op in operations} == documented, "schemathesis missed operations"
    routes = app_routes(tmp_path)
    assert routes - documented == set(NOT_IN_SCHEMA), ("routes the schema does not document, without a reason",
                                                       sorted(routes - documented - set(NOT_IN_SCHEMA)))
    assert documented <= routes, sorted(documented - routes)
    assert set(NOT_FUZZED) <= documented

    failures: list[str] = []
    counts: dict[str, int] = {}
    unfuzzable: list[str] = []  # negative mode for operations with no input to break
    started = time.monotonic()
    session = requests.Session()
    session.headers.update(auth)

    def _one(case, label: str) -> None:
        counts[label] += 1
        try:
            response = case.call_and_validate(base_url=live.url, session=session, checks=checks, timeout=30)
        except AssertionError as e:  # schemathesis' FailureGroup is one; keep going, report them all
            failures.append(f"{label}: {str(e)[:1500]}")
            return
        key = (case.operation.method.upper(), case.operation.path)
        answered[key] = answered.get(key, 0) + 1
        if response.status_code < 300:
            succeeded[key] = succeeded.get(key, 0) + 1

    from schemathesis import GenerationMode

    answered: dict[tuple[str, str], int] = {}  # operation -> responses validated (any status but 5xx)
    succeeded: dict[tuple[str, str], int] = {}  # operation -> 2xx among them
    for op in operations:
        if (op.method.upper(), op.path) in NOT_FUZZED:
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            label = f"{op.method.upper()} {op.path} ({mode.value})"
            if time.monotonic() - started > TIME_CAP_S:
                failures.append(f"{label}: not fuzzed, the {TIME_CAP_S:.0f} s cap was reached")
                continue
            counts[label] = 0
            try:
                fuzz(op, mode, lambda case, label=label: _one(case, label))()
            except Exception as e:  # only "nothing to negate" is acceptable, checked below
                if mode is GenerationMode.POSITIVE or counts[label]:
                    raise
                unfuzzable.append(f"{label}: {type(e).__name__}")
    elapsed = time.monotonic() - started
    print(f"fuzzed {len(counts)} operation/mode pairs, {sum(counts.values())} requests in {elapsed:.1f} s: {counts}"
          f"; no negative cases possible: {unfuzzable}")
    assert not failures, f"{len(failures)} failing example(s):\n" + "\n\n".join(failures[:10])
    # every documented operation was exercised: TEI, OpenAI, native and jobs alike
    assert set(answered) == documented - set(NOT_FUZZED), sorted(documented - set(NOT_FUZZED) - set(answered))
    # and the served model answered: TEI's and OpenAI's embeddings ran inference on generated inputs
    print("2xx per operation:", {f"{m} {p}": n for (m, p), n in sorted(succeeded.items())})
    assert succeeded.get(("POST", "/embed")) and succeeded.get(("POST", "/v1/embeddings")), succeeded
    assert all(n >= 1 for k, n in counts.items() if "(positive)" in k), counts
    assert all(u.startswith(("GET /health ", "GET / ")) for u in unfuzzable), unfuzzable
    assert live.proc.poll() is None, "the server died under fuzzing:\n" + live.read_log()
    log = live.read_log()
    assert "Traceback" not in log and "unhandled error" not in log, log
