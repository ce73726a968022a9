"""The operators' console's JSON endpoints, under /ops/api (the page that
uses them: api/page.py, api/static/ops.*), one module per subject: overview,
history, workers, jobs, batches, clients, actions, webhooks. Who may call them:
guard.py; their bodies: schemas.py; the jobs list's paging: paging.py and
cursor.py; the filters they share: params.py.
"""

from __future__ import annotations

from litestar import Router
from litestar.datastructures import CacheControlHeader
from litestar.di import Provide

from api.ops import actions, batches, clients, history, jobs, overview, webhooks, workers
from api.ops.guard import (
    provide_operator,
    provide_operator_store,
    refuse_unknown_query,
    require_operator_key,
)
from api.options import with_options

ROUTES = Router(
    "/ops/api",
    route_handlers=with_options([
        overview.get_overview, history.get_history, workers.list_workers, jobs.list_jobs,
        jobs.get_job_detail, jobs.cancel_job, jobs.count_pending, jobs.cancel_pending,
        batches.list_batches,
        clients.list_clients, clients.revoke_client_keys, clients.set_client_weight, clients.revoke_key,
        actions.list_actions,
        webhooks.ops_list_endpoints, webhooks.ops_retry_delivery]),
    guards=[require_operator_key, refuse_unknown_query],
    dependencies={"store": Provide(provide_operator_store),
                  "operator": Provide(provide_operator, sync_to_thread=False)},
    tags=["ops"],
    security=[{"OperatorKey": []}],
    cache_control=CacheControlHeader(no_store=True),
)
