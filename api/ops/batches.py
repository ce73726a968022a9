"""GET /ops/api/batches: the batch lane's message batches, newest first,
each with its state, the provider's counts of its requests, its age and
expiry, what its ledger rows cost and what that saved against the
interactive price. Paged by cursor on the primary key: a batch is made at
most every BATCH_COLLECT_S, so the list grows for as long as the database
lives."""

from __future__ import annotations

from typing import Annotated

from litestar import get
from litestar.di import NamedDependency
from litestar.params import Parameter

from api.ops.cursor import Position
from api.ops.schemas import TOKEN_PATTERN, BatchPage, BatchRequestCounts, OpsBatch, usd
from api.problems import problem_responses
from shared.console_rows import OpsBatchRow
from shared.console_store import ConsoleStore
from shared.pricing import BATCH_PRICE_FACTOR, saved_by_batch


def ops_batch(row: OpsBatchRow) -> OpsBatch:
    """A batch as the console answers it (``storyjobs batches`` prints the same)."""
    counts = None
    if row.request_counts is not None:
        counts = BatchRequestCounts(**{name: max(0, int(row.request_counts.get(name, 0))) for name in (
            "processing", "succeeded", "errored", "canceled", "expired")})
    return OpsBatch(
        id=row.id, state=row.state, provider_batch_id=row.provider_batch_id, model=row.model,
        request_count=row.request_count, counts=counts, processing_status=row.processing_status,
        created_at=row.created_at, age_s=round(max(row.age_s, 0.0), 3), sent_at=row.sent_at,
        expires_at=row.expires_at, ended_at=row.ended_at, results_read_at=row.results_read_at,
        cancel_asked_at=row.cancel_asked_at, lost_batch_id=row.lost_batch_id, holder=row.holder,
        billed_requests=row.billed_requests, cost_usd=usd(row.cost_usd), saved_usd=usd(saved_by_batch(row.cost_usd)),
    )


@get(
    "/batches",
    summary="The batch lane's message batches, newest first, with what each cost and saved; paged by cursor",
    description=(
        "Every batch the lane made or found: its state, the provider's id and counts of its requests, its age and "
        "expiry, what its ledger rows cost at the batch price and what that saved against the interactive price. "
        "Follow `next_cursor` until it is null."
    ),
    responses=problem_responses(400, 401, 503),
)
async def list_batches(
    store: NamedDependency[ConsoleStore],
    cursor: Annotated[str | None, Parameter(description="`next_cursor` of the previous page.",
                                            pattern=TOKEN_PATTERN)] = None,
    limit: Annotated[int, Parameter(ge=1, le=200, description="Most batches in the page.")] = 50,
) -> BatchPage:
    before = None if cursor is None else Position.from_token(cursor, "cursor").id
    rows = await store.jobs.ops_batch_list(before_id=before, limit=limit + 1)
    page, more = rows[:limit], len(rows) > limit
    return BatchPage(batches=[ops_batch(row) for row in page],
                     next_cursor=Position(id=page[-1].id).token() if more else None,
                     price_factor=str(BATCH_PRICE_FACTOR))
