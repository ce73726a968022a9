"""ceiling: the claim-and-complete rate of the database alone, the limit the
drain is compared with.

pgbench, 4 clients, over a bulk-inserted backlog, no Python in the loop:

* claim, then complete: the design's bare claim statement (its id captured
  with \\gset), in the worker's claim order (created_at, id: the order of the
  live-jobs index), and a guarded completion, two commits per job;
* one statement per job: the completion of the previous job and the claim of
  the next in one CTE (as the round statement once did, without the story and
  ledger rows), one commit per job.

jobs/s = completed jobs / (last completed_at - first started_at), by the
database's clock, as in the drain.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.bench.harness import BenchContext, BenchResult, FigureSpec

NAME = "ceiling"
CLIENTS = 4
SPECS = {
    "claim_complete_jobs_per_s": FigureSpec(f"pgbench, {CLIENTS} clients: claim, then complete", "jobs/s"),
    "one_statement_jobs_per_s": FigureSpec(f"pgbench, {CLIENTS} clients: complete + claim in one statement",
                                           "jobs/s"),
}

CLAIM_THEN_COMPLETE = """\
UPDATE story_jobs SET status = 'running', started_at = now(), heartbeat_at = now(),
       worker_id = 'pgbench-' || :client_id
WHERE id = (SELECT id FROM story_jobs WHERE status = 'pending' ORDER BY created_at, id LIMIT 1
            FOR UPDATE SKIP LOCKED)
  AND status = 'pending'
RETURNING id AS job_id \\gset
UPDATE story_jobs SET status = 'completed', completed_at = now(), story_id = gen_random_uuid()
WHERE id = :job_id AND status = 'running' AND worker_id = 'pgbench-' || :client_id;
"""

# :job_id is the job this client claimed last time (-D job_id=0 at first); the
# data-modifying CTE runs whether or not the main statement reads it
COMPLETE_AND_CLAIM = """\
WITH completed AS (
    UPDATE story_jobs SET status = 'completed', completed_at = now(), story_id = gen_random_uuid()
    WHERE id = :job_id AND status = 'running' AND worker_id = 'pgbench-' || :client_id
    RETURNING id
),
claimable AS MATERIALIZED (
    SELECT id FROM story_jobs WHERE status = 'pending' ORDER BY created_at, id LIMIT 1
    FOR NO KEY UPDATE SKIP LOCKED
)
UPDATE story_jobs j SET status = 'running', started_at = now(), heartbeat_at = now(),
       worker_id = 'pgbench-' || :client_id
FROM claimable
WHERE j.id = claimable.id AND j.status = 'pending'
RETURNING j.id AS job_id \\gset
"""

_TIMING = """
SELECT count(*) AS completed,
       extract(epoch FROM max(completed_at) - min(started_at))::float8 AS span_s
FROM story_jobs WHERE status = 'completed'
"""


def run(ctx: BenchContext, result: BenchResult) -> None:
    jobs = 1_000 if ctx.quick else 10_000
    pgbench = shutil.which("pgbench")
    result.params.update({"jobs": jobs, "clients": CLIENTS, "pgbench": pgbench})
    if pgbench is None:
        result.error = "pgbench is not installed (Debian: postgresql-client)"
        return
    with tempfile.TemporaryDirectory(prefix="storyjobs-bench-pgbench-") as scripts:
        claim_then_complete = Path(scripts) / "claim_then_complete.sql"
        claim_then_complete.write_text(CLAIM_THEN_COMPLETE)
        complete_and_claim = Path(scripts) / "complete_and_claim.sql"
        complete_and_claim.write_text(COMPLETE_AND_CLAIM)
        for run_number in range(1, ctx.runs + 1):
            for key, script in (("claim_complete_jobs_per_s", claim_then_complete),
                                ("one_statement_jobs_per_s", complete_and_claim)):
                rate = _pgbench_once(ctx, pgbench, script, jobs)
                result.add(key, rate)
                ctx.progress(f"ceiling run {run_number}/{ctx.runs}: {SPECS[key].label}: {rate:,.0f} jobs/s")


def _pgbench_once(ctx: BenchContext, pgbench: str, script: Path, jobs: int) -> float:
    with ctx.database("ceiling") as bench_db:
        bench_db.insert_pending(bench_db.create_client(), jobs)
        # every client runs exactly its share: together they claim every job once
        command = [pgbench, "--no-vacuum", "--client", str(CLIENTS), "--jobs", "2",
                   "--transactions", str(jobs // CLIENTS), "--define", "job_id=0", "--file", str(script),
                   bench_db.url]
        finished = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        if finished.returncode != 0:
            raise RuntimeError(f"pgbench failed ({finished.returncode}):\n{finished.stderr[-2000:]}")
        with bench_db.connect() as conn:
            row = conn.execute(_TIMING).fetchone()
    assert row is not None
    completed, span_s = row
    rate: float = completed / span_s
    return rate
