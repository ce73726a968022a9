"""``python -m tests.bench.peer_apps.bare_worker``: the floor of the peer
comparison, the bare claim-then-complete loop.

Two statements per job, as DESIGN.md describes the claim: claim one pending
row of story_jobs picked ``FOR UPDATE SKIP LOCKED``, then complete it with a
guarded update (status and worker_id). No story row, no ledger, no heartbeat,
no metrics, no logs: what any queue on this table must at least do. With
``--batch N`` the claim takes up to N rows and one guarded update completes
them all.

When a claim finds nothing it waits for ``NOTIFY storyjobs_bare_pending`` (sent
by whoever enqueues) or for the poll interval, whichever comes first, as the
storyjobs worker does. SIGTERM ends it at once: it holds nothing worth
finishing.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import psycopg

from tests.bench.peer_apps import BARE_APPLICATION_NAME as APPLICATION_NAME
from tests.bench.peer_apps import BARE_CHANNEL as CHANNEL

CLAIM_ONE = """
UPDATE story_jobs SET status = 'running', started_at = now(), heartbeat_at = now(),
       worker_id = %(worker_id)s
WHERE id = (SELECT id FROM story_jobs WHERE status = 'pending' ORDER BY created_at, id LIMIT 1
            FOR UPDATE SKIP LOCKED)
  AND status = 'pending'
RETURNING id
"""

COMPLETE_ONE = """
UPDATE story_jobs SET status = 'completed', completed_at = now(), story_id = gen_random_uuid()
WHERE id = %(id)s AND status = 'running' AND worker_id = %(worker_id)s
"""

CLAIM_MANY = """
UPDATE story_jobs SET status = 'running', started_at = now(), heartbeat_at = now(),
       worker_id = %(worker_id)s
WHERE id = ANY (ARRAY(SELECT id FROM story_jobs WHERE status = 'pending' ORDER BY created_at, id
                      LIMIT %(limit)s FOR UPDATE SKIP LOCKED))
  AND status = 'pending'
RETURNING id
"""

COMPLETE_MANY = """
UPDATE story_jobs SET status = 'completed', completed_at = now(), story_id = gen_random_uuid()
WHERE id = ANY (%(ids)s) AND status = 'running' AND worker_id = %(worker_id)s
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.peer_apps.bare_worker")
    parser.add_argument("--batch", type=int, default=1, help="rows one claim may take (default 1)")
    parser.add_argument("--poll-interval", type=float, default=5.0,
                        help="seconds to wait for a NOTIFY before claiming again (default 5)")
    return parser.parse_args(argv)


def run(url: str, *, batch: int, poll_interval_s: float) -> None:
    worker_id = f"bare-{os.getpid()}"
    with psycopg.connect(url, autocommit=True, application_name=APPLICATION_NAME) as conn:
        woken = False

        def notified(_: psycopg.Notify) -> None:
            nonlocal woken
            woken = True

        conn.add_notify_handler(notified)
        conn.execute(f"LISTEN {CHANNEL}")
        params: dict[str, Any] = {"worker_id": worker_id, "limit": batch}
        while True:
            woken = False
            if batch == 1:
                row = conn.execute(CLAIM_ONE, params).fetchone()
                if row is not None:
                    conn.execute(COMPLETE_ONE, {"id": row[0], "worker_id": worker_id})
                    continue
            else:
                ids = [row[0] for row in conn.execute(CLAIM_MANY, params).fetchall()]
                if ids:
                    conn.execute(COMPLETE_MANY, {"ids": ids, "worker_id": worker_id})
                    continue
            # a NOTIFY that came in during the claim already set woken
            if not woken:
                for _ in conn.notifies(timeout=poll_interval_s, stop_after=1):
                    pass


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run(os.environ["DATABASE_URL"], batch=args.batch, poll_interval_s=args.poll_interval)


if __name__ == "__main__":
    main()
