"""What the peer queues' worker processes run in the benchmarks: a no-op
task for pgqueuer and for procrastinate (each run by its own CLI), and the
bare claim-then-complete loop, the floor storyjobs is measured against.

The names the harness shares with them live here, so that the harness can
be imported where pgqueuer and procrastinate are not installed."""

PGQUEUER_ENTRYPOINT = "noop"
PGQUEUER_APPLICATION_NAME = "bench-pgqueuer-worker"
PROCRASTINATE_TASK = "noop"
PROCRASTINATE_APPLICATION_NAME = "bench-procrastinate-worker"
BARE_CHANNEL = "storyjobs_bare_pending"
BARE_APPLICATION_NAME = "bench-bare-worker"
