"""API fuzzing: schemathesis generates requests from the live OpenAPI schema of a real `hfport serve` on loopback
and checks every response: no 5xx, and status code, content type, headers and body as the schema documents them.

Bounded and repeatable: MAX_EXAMPLES per operation, derandomized (a fixed seed), no example database, a hard
time cap for the whole run. Nothing is excluded: job submissions cannot start long jobs here, because the only
model folder and data lie where generated strings do not reach, and the server's limits are set small."""

from __future__ import annotations

import json
import time

import pytest
import schemathesis  # a dev dependency: missing, the test fails rather than skips

from tests.test_server import Server

MAX_EXAMPLES = 20  # per operation and mode (schema-valid data, then schema-violating data)
TIME_CAP_S = 100.0  # the whole run; the test fails (naming what was left) rather than run on past it
TOKEN = "fuzz-token"
CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_headers_conformance", "response_schema_conformance")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz")
    allowed = base / "allowed"
    allowed.mkdir()
    srv = Server(base / "data", allowed, workers=1, HFPORT_API_TOKEN=TOKEN, HFPORT_MAX_REQUEST_BYTES=str(64 * 1024),
                 HFPORT_MAX_UPLOAD_BYTES=str(64 * 1024), HFPORT_PREDICT_MAX_INPUTS="8",
                 HFPORT_PREDICT_MAX_CHARS="2000", HFPORT_PREDICT_TIMEOUT_S="10").start()
    yield srv
    srv.stop()


def fuzz(op, mode, body):
    """A hypothesis test over the operation's generated cases: derandomized, no database, bounded."""
    from hypothesis import HealthCheck, Phase, given, settings

    @settings(max_examples=MAX_EXAMPLES, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case):
        body(case)

    return run


def test_fuzz_openapi_no_5xx_no_schema_violations(live):
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

    failures: list[str] = []
    counts: dict[str, int] = {}
    unfuzzable: list[str] = []  # negative mode for operations with no input to break
    started = time.monotonic()
    session = requests.Session()
    session.headers.update(auth)

    def _one(case, label: str) -> None:
        counts[label] += 1
        try:
            case.call_and_validate(base_url=live.url, session=session, checks=checks, timeout=30)
        except AssertionError as e:  # schemathesis' FailureGroup is one; keep going, report them all
            failures.append(f"{label}: {str(e)[:1500]}")

    from schemathesis import GenerationMode

    for op in operations:
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
    assert all(n >= 1 for k, n in counts.items() if "(positive)" in k), counts
    assert all(u.startswith(("GET /health ", "GET / ")) for u in unfuzzable), unfuzzable
    assert live.proc.poll() is None, "the server died under fuzzing:\n" + live.read_log()
    log = live.read_log()
    assert "Traceback" not in log and "unhandled error" not in log, log
