"""The benchmark suite: ``python -m tests.bench`` (``make bench``).

Each benchmark runs the real entrypoints (``python -m api|worker``) or the
real query functions against a fresh migrated database on the Postgres of
tests/support/postgres_server.py, repeats its measurement (``--runs``, default 3) and reports
the median with min and max. Jobs are timed by the database's own clock
(created_at, started_at, completed_at), so process start-up is not counted.
Results go to tests/bench/results/ as JSON and a Markdown table that sets
each figure next to its target.
"""
