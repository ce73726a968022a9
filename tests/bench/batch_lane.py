"""batch_lane: a hundred stories through the batch lane beside a hundred
through the interactive lane, what each costs and how long the last takes.

Each lane gets a database of its own: the stories are admitted as the api
admits them (at the model's price, or half of it for the batch lane), then
one worker process starts against the fake provider of tests/fakes, served
in this process (its Messages API streams every story at once; its batch
endpoints end a batch AUTO_END_S after its creation). The worker runs both
lanes; only one has work.

The batch lane is run with BATCH_COLLECT_S and BATCH_POLL_INTERVAL_S at 1 s
(their defaults are 60 s), so that the figure measures the lane's own
overhead around a batch that ends quickly, not the collection's wait; a
real provider's batch takes minutes to hours, and the time to the last
story here is no estimate of it.

Both of the fake's APIs answer the same story (the same tokens billed).
Figures: the cost in USD of each lane's hundred stories (twenty with
--quick, whatever the labels say), from the ledger
(llm_calls, billed rows), and its ratio (the batch price factor, if the
stories are alike); and the time from the first admission to the last story
completed, by the database's clock (worker start-up included, for both).
"""

from __future__ import annotations

import asyncio
import uuid
from decimal import Decimal
from typing import Any

import psycopg

from api.admission import admission
from api.store import ApiStore
from shared.config import ApiSettings
from shared.story_request import StoryLane, StoryRequest
from tests.bench.harness import BenchContext, BenchResult, FigureSpec
from tests.fakes.anthropic_batches import BatchPlan, FakeBatches, ItemPlan
from tests.fakes.anthropic_server import FakeAnthropic, FakeAnthropicServer, Plan

NAME = "batch_lane"
STORIES, QUICK_STORIES = 100, 20
LANES: tuple[StoryLane, ...] = ("interactive", "batch")
SPECS = {
    "interactive_cost_usd": FigureSpec("100 stories, interactive lane: cost (ledger)", "USD"),
    "batch_cost_usd": FigureSpec("100 stories, batch lane: cost (ledger)", "USD"),
    "cost_ratio": FigureSpec("batch lane cost / interactive lane cost", "×"),
    "interactive_last_story_s": FigureSpec("100 stories, interactive lane: time to the last story", "s"),
    "batch_last_story_s": FigureSpec(
        "100 stories, batch lane (collect and poll 1 s, batch ends in 2 s): time to the last story", "s"),
}
AUTO_END_S = 2.0
# the same story from both of the fake's APIs, so that the same tokens are billed
STORY = "Title: The Keeper's Cat\n" + " ".join(["sleepy"] * 120)
WORKER_ENV = {"BATCH_COLLECT_S": 1, "BATCH_POLL_INTERVAL_S": 1, "OFFLINE_DELAY_S": 0}

_FIGURES = """
SELECT (SELECT coalesce(sum(cost_usd), 0) FROM llm_calls WHERE billed),
       extract(epoch FROM max(completed_at) - min(created_at))::float8,
       count(*) FILTER (WHERE status = 'completed'), count(*)
FROM story_jobs
"""


def run(ctx: BenchContext, result: BenchResult) -> None:
    stories = QUICK_STORIES if ctx.quick else STORIES
    result.params.update({"stories": stories, "worker_env": WORKER_ENV, "fake_batch_auto_end_s": AUTO_END_S,
                          "provider": "tests/fakes (in the bench's process): streams at once, batches end "
                                      f"{AUTO_END_S:g} s after creation"})
    for run_number in range(1, ctx.runs + 1):
        costs = {}
        for lane in LANES:
            cost, last_s = _one_lane(ctx, lane, stories)
            costs[lane] = cost
            result.add(f"{lane}_cost_usd", cost)
            result.add(f"{lane}_last_story_s", last_s)
            ctx.progress(f"batch_lane run {run_number}/{ctx.runs}: {lane}: {cost:.6f} USD, "
                         f"last story after {last_s:.1f} s")
        result.add("cost_ratio", costs["batch"] / costs["interactive"])


def _one_lane(ctx: BenchContext, lane: StoryLane, stories: int) -> tuple[float, float]:
    fake = FakeAnthropic(default=Plan(text=STORY),
                         batches=FakeBatches(default=BatchPlan(auto_end_s=AUTO_END_S, default_item=ItemPlan(text=STORY))))
    with FakeAnthropicServer(fake) as server, ctx.database(f"batch_lane_{lane}") as bench_db:
        client_id = bench_db.create_client()
        asyncio.run(_admit(bench_db.url, client_id, lane, stories))
        with ctx.processes(bench_db, ANTHROPIC_API_KEY="bench", ANTHROPIC_BASE_URL=server.base_url,
                           **WORKER_ENV) as system:
            worker = system.worker(wait=False)
            bench_db.wait_drained([worker], timeout_s=120)
        row = bench_db.reader.execute(_FIGURES).fetchone()
    assert row is not None
    cost, last_s, completed, total = row
    if completed != total:
        raise RuntimeError(f"{lane} lane: {total - completed} of {total} stories did not complete")
    return float(cost), float(last_s)


async def _admit(url: str, client_id: int, lane: StoryLane, stories: int) -> None:
    """The stories admitted in one statement, as the api admits them: their worst case reserved at their
    lane's price against a day's budget that holds them all."""
    settings = ApiSettings()
    admissions: list[Any] = [
        admission(client_id, uuid.uuid4().hex, StoryRequest(prompt=f"a lighthouse keeper's cat, {n}", lane=lane),
                  settings)
        for n in range(stories)]
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        results = await ApiStore(conn).job_insert_if_admitted(
            admissions=admissions, queue_max=10_000, client_queue_max=10_000, budget_usd=Decimal(1000))
    refused = [r for r in results if r.outcome != "inserted"]
    if refused:
        raise RuntimeError(f"{len(refused)} of {stories} stories were not admitted: {refused[0]}")
