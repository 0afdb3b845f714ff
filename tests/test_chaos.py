"""Chaos, bounded and on loopback: a real PostgreSQL, 2 API processes (`hfport serve --role api`) and 2 workers
(`--role worker`) sharing one data dir. 8 clients submit tiny fine-tune jobs round-robin across the APIs; in the
middle, one worker is killed with SIGKILL while it runs a job (that job's process dies with it) and one API process
is killed too (clients fail over; a replacement starts). Every job ends `succeeded` exactly once, none is lost, the
killed worker's job is requeued by the lease rule and resumed from its checkpoint by a surviving worker (its log
says so), and every API process lists the same jobs and models. An SSE stream read from one API resumes on another
with Last-Event-ID.

Clients submit with an Idempotency-Key and retry on a refused connection, a timeout or a dropped answer (on the next
API process, with the same key): a retry never makes a second job. Every fifth submission first gives up after
50 ms, so retries really happen; the job count proves none was doubled.

With a `partition` (tests/test_partition.py; scripts/chaos.py, as root), a third worker runs in its own network
namespace and its link to PostgreSQL is cut mid-job: its job is taken over once the lease runs out, the cut-off
attempt writes nothing after its death, and the worker rejoins when the link comes back.

CI runs HFPORT_CHAOS_JOBS jobs (default 12); scripts/chaos.py runs 40 and the 1-vs-2-worker figures. The
deployment and the scenario are tests/cluster.py's."""

from __future__ import annotations

import json
import os

from tests.cluster import run_chaos
from tests.pgserver import fresh_db_name


def test_chaos(pg_server, tmp_path, minilm_path):
    n_jobs = int(os.environ.get("HFPORT_CHAOS_JOBS", "12"))
    figures = run_chaos(tmp_path / "data", pg_server.create_database(fresh_db_name()), minilm_path, n_jobs)
    print(json.dumps(figures))
