"""GET /ops/api/workers: the workers seen in the last hour, busy (from their
jobs' heartbeats), gone, or idle."""

from __future__ import annotations

from litestar import get
from litestar.di import NamedDependency

from api.deps import ApiState
from api.ops.schemas import Worker, Workers
from api.problems import problem_responses
from shared.console_rows import WorkerRow
from shared.console_store import ConsoleStore


def _worker(row: WorkerRow, timeout_s: float) -> Worker:
    if not row.running:
        state = "idle"
    elif row.heartbeat_age_s is not None and row.heartbeat_age_s > timeout_s:
        state = "gone"
    else:
        state = "busy"
    return Worker(worker_id=row.worker_id, state=state, running=row.running, last_heartbeat_at=row.last_heartbeat_at,
                  heartbeat_age_s=None if row.heartbeat_age_s is None else round(row.heartbeat_age_s, 1),
                  last_request_at=row.last_request_at, job_ids=row.job_ids)


@get(
    "/workers",
    summary="The workers seen in the last hour: busy (from their jobs' heartbeats), gone, or idle",
    responses=problem_responses(400, 401, 503),
)
async def list_workers(api_state: NamedDependency[ApiState], store: NamedDependency[ConsoleStore]) -> Workers:
    timeout_s = api_state.settings.heartbeat_timeout_s
    rows = await store.stats.ops_workers()
    return Workers(heartbeat_timeout_s=timeout_s, workers=[_worker(row, timeout_s) for row in rows])
