"""The operators' console at /ops/, driven in Debian's headless Chromium against
a real api process: what it shows agrees with the database, its lists filter
and page, its actions change exactly what they say, and text that holds
markup stays text.

Playwright's sync API cannot run inside an event loop, so these are plain
sync tests; the history is written beforehand on a thread of its own."""

from __future__ import annotations

import re
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

import httpx
import psycopg
import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, expect

from api.page import CONTENT_SECURITY_POLICY
from api.store import ApiStore
from shared import webhooks
from shared.rows import ROLLUP_BOUNDS_S
from sweeper.store import PgSweeperStore
from tests.support import ops_seed as seed
from tests.support.settings import sweeper_settings
from tests.system.procs import ApiProc, System
from tests.system.screens import capture

pytestmark = [pytest.mark.system, pytest.mark.browser]

WAIT_MS = 30_000
LAPTOP = {"viewport": {"width": 1280, "height": 900}}
PHONE = {"viewport": {"width": 390, "height": 844}, "device_scale_factor": 2, "is_mobile": True, "has_touch": True}

LONG_ERROR = ("429 rate_limit_error: This request would exceed the rate limit for your organization of 50 "
              "requests per minute. For details, refer to the rate limits documentation; retry after 12 seconds.")
HOSTILE = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'


def rows_of(database_url: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        return conn.execute(query, params).fetchall()


def scalar(database_url: str, query: str, *params: Any) -> Any:
    (row,) = rows_of(database_url, query, *params)
    return row[0]


def usd(value: Any) -> str:
    """Money as the console writes it: to the cent from a dollar, four decimals below, $0 for nothing."""
    amount = Decimal(value)
    if amount == 0:
        return "$0"
    if amount >= 1:
        return f"${amount.quantize(Decimal('0.01'), ROUND_HALF_EVEN):,}"
    return f"${amount:.4f}"


async def roll_up_as_a_first_pass(conn: psycopg.AsyncConnection[Any]) -> None:
    """The sweeper's rollup as its first pass makes it: the last 25 hours (sweeper.sql, rollup_last_minute)."""
    gauges = await PgSweeperStore(conn).queue_gauges()
    await PgSweeperStore(conn).record_minutes(sweeper_settings(sweeper_interval_s=3600.0), pending=gauges.pending,
                                              running=gauges.running)


class Console:
    """One browser tab on the console, with the script errors it met."""

    def __init__(self, browser: Browser, api: ApiProc, device: dict[str, Any]) -> None:
        self.errors: list[str] = []
        self.page: Page = browser.new_context(**device).new_page()
        self.page.on("console", self._keep_error)
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.base = f"{api.base_url}/ops/"

    def _keep_error(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.errors.append(message.text)

    def open(self, key: str, hash_: str = "#/") -> Page:
        self.page.goto(self.base + hash_)
        self.page.fill("#key-input", key)
        self.page.click("#key-form button[type=submit]")
        expect(self.page.locator("#nav")).to_be_visible(timeout=WAIT_MS)
        return self.page

    def confirm(self, expected_text: str) -> None:
        dialog = self.page.locator("#confirm")
        expect(dialog).to_be_visible(timeout=WAIT_MS)
        expect(self.page.locator("#confirm-text")).to_contain_text(expected_text)
        self.page.click("#confirm-yes")
        expect(dialog).to_be_hidden()

    def fits_the_screen(self) -> bool:
        width, inner = self.page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
        return bool(width <= inner)

    def in_view(self, selector: str) -> bool:
        """Every element the selector finds lies within the screen's width."""
        width = self.page.evaluate("window.innerWidth")
        boxes = [self.page.locator(selector).nth(n).bounding_box() for n in range(self.page.locator(selector).count())]
        return bool(boxes) and all(box is not None and box["x"] >= 0 and box["x"] + box["width"] <= width
                                   for box in boxes)


def upper_bound(seconds: float) -> float:
    """The rollup bucket's upper bound for a duration: what its percentiles report."""
    return next((bound for bound in ROLLUP_BOUNDS_S if bound > seconds), ROLLUP_BOUNDS_S[-1])


def cell(page: Page, key: str) -> str:
    return page.locator(f'[data-k="{key}"]').inner_text()


def test_the_overview_shows_what_the_database_holds(
    system: System, database_url: str, browser: Browser,
) -> None:
    """Queue, jobs finished, failure ratio, spend, undelivered stories and 429s shown for the last hour and day
    are the counts and sums of the tables, money to the cent or four decimals, today's budget, the rate limiter
    and the writer in use as they stand, and the history (from the sweeper's rollup) draws the minutes that had
    jobs, the queue depth and the wait and run percentiles, with a scale and a time axis, over an hour and a
    week."""

    async def history(conn: psycopg.AsyncConnection[Any]) -> str:
        acme, _ = await seed.client(conn, "acme")
        jobs = [seed.completed(acme, 5 * 3600 + n * 60, cost="0.021000") for n in range(7)]
        jobs += [seed.completed(acme, 600 + n * 120, cost="0.013000") for n in range(5)]
        jobs += [seed.failed(acme, 4 * 3600, "llm_error", calls=[
            seed.Call("rate_limited", billed=False), seed.Call("failed", cost_usd=Decimal("0.004"))])]
        jobs += [seed.failed(acme, 900, "interrupted", calls=[seed.Call("interrupted", cost_usd=Decimal("0.002"))]),
                 seed.failed(acme, 700, "cancelled"), seed.failed(acme, 2 * 86400, "llm_error"),
                 seed.running(acme, 30), seed.pending(acme, 20), seed.pending(acme, 10), seed.pending(acme, 5)]
        await seed.insert_jobs(conn, jobs)
        await conn.execute("INSERT INTO budget_days (client_id, day, spent_usd, reserved_usd) "
                           "VALUES (0, (now() AT TIME ZONE 'UTC')::date, 1.5, 0.25)")
        await roll_up_as_a_first_pass(conn)
        return await seed.operator_key(conn)

    key = seed.seeded(database_url, history)
    api = system.api(QUEUE_MAX=20, BUDGET_USD_PER_DAY=4, LLM_REQUESTS_PER_MINUTE=60)
    console = Console(browser, api, LAPTOP)
    page = console.open(key)
    expect(page.locator('[data-k="jobs.last_day.completed"]')).to_have_text("12", timeout=WAIT_MS)
    assert page.locator("#budget-today").inner_text() == "$1.50 spent + $0.2500 reserved of $4.00: $2.25 left"
    assert page.locator("#writers-now").inner_text() == "anthropic"
    expect(page.locator("#offline-note")).to_be_hidden()
    # whole requests of a bucket of 4.75 s of refill (5 s less the quarter second kept for requests in flight)
    assert page.locator("#limiter-now").inner_text() == "claude-sonnet-5-5: requests 4 of 4 (60/min)"

    def finished(status: str, interval: str, extra: str = "") -> int:
        return int(scalar(database_url, f"SELECT count(*) FROM story_jobs WHERE status = '{status}' {extra} "  # noqa: S608
                                        f"AND completed_at >= now() - interval '{interval}'"))

    assert cell(page, "queue.pending") == "3" and cell(page, "queue.running") == "1"
    assert cell(page, "queue.queue_max") == "20"
    for window, interval in (("last_hour", "1 hour"), ("last_day", "1 day")):
        completed, failed = finished("completed", interval), finished("failed", interval)
        cancelled = finished("failed", interval, "AND error_code = 'cancelled'")
        assert cell(page, f"jobs.{window}.completed") == f"{completed:,}"
        assert cell(page, f"jobs.{window}.failed") == f"{failed:,}"
        assert cell(page, f"jobs.{window}.cancelled") == f"{cancelled:,}"
        ratio = (failed - cancelled) / (completed + failed - cancelled)
        assert cell(page, f"jobs.{window}.failure_ratio") == f"{ratio * 100:.1f} %"
        sent = f"started_at >= now() - interval '{interval}'"
        spend = scalar(database_url, f"SELECT coalesce(sum(cost_usd), 0) FROM llm_calls WHERE billed AND {sent}")
        assert cell(page, f"spend.{window}.usd") == usd(spend)
        billed = scalar(database_url, f"SELECT count(*) FROM llm_calls WHERE billed AND {sent}")
        assert cell(page, f"spend.{window}.billed_calls") == f"{billed:,}"
        limited = scalar(database_url, f"SELECT count(*) FROM llm_calls WHERE outcome = 'rate_limited' AND {sent}")
        assert cell(page, f"provider.{window}.rate_limited") == f"{limited:,}"
        lost = scalar(database_url, "SELECT count(DISTINCT j.id) FROM story_jobs j JOIN llm_calls c ON c.job_id = j.id "
                                    f"AND c.billed WHERE j.status = 'failed' AND j.completed_at >= now() - interval "
                                    f"'{interval}'")
        assert cell(page, f"undelivered.{window}.jobs") == f"{lost:,}"
    assert cell(page, "undelivered.last_day.usd") == usd(scalar(
        database_url, "SELECT sum(c.cost_usd) FROM story_jobs j JOIN llm_calls c ON c.job_id = j.id AND c.billed "
                      "WHERE j.status = 'failed' AND j.completed_at >= now() - interval '1 day'"))
    assert cell(page, "provider.last_day.rate_limited") == "1"
    minutes_with_jobs = scalar(database_url, "SELECT count(DISTINCT date_trunc('minute', completed_at)) FROM story_jobs "
                                             "WHERE status = 'completed' AND completed_at >= "
                                             "date_trunc('minute', now()) - interval '59 minutes'")
    assert minutes_with_jobs == 5
    expect(page.locator("#chart-jobs rect.completed")).to_have_count(minutes_with_jobs)
    assert page.locator("#chart-jobs rect.failed").count() == 2
    # the depth the rollup saw now: one bar, as high as the pending count
    expect(page.locator("#chart-depth rect.pending")).to_have_count(1)
    assert "at most 3 pending" in (page.locator("#chart-depth rect.pending title").text_content() or "")
    # a scale (0, half, top) and six ticks of a time axis under each chart
    assert page.locator("#chart-jobs text.scale").count() == 9
    waits = [float(w) for (w,) in rows_of(database_url, "SELECT extract(epoch FROM started_at - created_at) FROM "
                                                        "story_jobs WHERE started_at >= date_trunc('minute', now()) "
                                                        "- interval '59 minutes'")]
    assert len(waits) == 7
    expect(page.locator("#chart-totals")).to_contain_text(f"Waited p50 {upper_bound(sorted(waits)[3]):.1f} s")
    capture(page, "ops-overview")
    assert console.fits_the_screen()

    page.click("#ranges a[data-range=week]")
    expect(page.locator("#chart-bucket")).to_have_text("one bar per 60 minutes", timeout=WAIT_MS)
    # the first pass recounted the last 25 hours (sweeper.sql, rollup_last_minute)
    hours = scalar(database_url, "SELECT count(DISTINCT date_trunc('hour', completed_at)) FROM story_jobs "
                                 "WHERE status = 'completed' AND completed_at >= date_trunc('minute', now()) "
                                 "- interval '25 hours'")
    expect(page.locator("#chart-jobs rect.completed")).to_have_count(hours)
    assert page.locator("#chart-jobs rect").count() >= hours
    capture(page, "ops-overview-week")
    assert console.errors == []


def test_the_jobs_list_filters_and_pages(system: System, database_url: str, browser: Browser) -> None:
    """Filtering by client and status shows that client's jobs in that status, newest first, 50 at a time with
    an Older button for the rest; the error filter and the time range narrow it further; on a phone the list
    scrolls in its box and the page stays as wide as the screen."""

    async def history(conn: psycopg.AsyncConnection[Any]) -> str:
        acme, _ = await seed.client(conn, "acme")
        globex, _ = await seed.client(conn, "globex")
        jobs = []
        for n in range(80):
            owner = acme if n % 4 else globex
            ago = 20_000 - n * 200
            jobs.append(seed.failed(owner, ago, "timed_out" if n % 5 == 0 else "llm_error") if n % 2
                        else seed.completed(owner, ago))
        await seed.insert_jobs(conn, jobs)
        return await seed.operator_key(conn)

    key = seed.seeded(database_url, history)
    expected = [str(row) for (row,) in rows_of(
        database_url, "SELECT public_id FROM story_jobs j JOIN api_clients c ON c.id = j.client_id "
                      "WHERE c.name = 'acme' AND status = 'failed' ORDER BY j.id DESC")]
    assert len(expected) == 40
    api = system.api()
    console = Console(browser, api, PHONE)
    page = console.open(key, "#/jobs")
    rows = page.locator("#jobs-rows tr")
    expect(rows).to_have_count(50, timeout=WAIT_MS)
    expect(page.locator("#jobs-more")).to_be_visible()
    page.locator("#f-client").select_option(label="acme")
    page.select_option("#f-status", "failed")
    page.click("#filters button[type=submit]")
    expect(rows).to_have_count(40, timeout=WAIT_MS)
    assert rows.evaluate_all("rows => rows.map(r => r.dataset.jobId)") == expected
    expect(page.locator("#jobs-status")).to_have_text("40 jobs: all that match.")
    assert "client_id=" in page.url and "status=failed" in page.url
    assert console.fits_the_screen()
    # status and cost in view on a 390 px screen, no sideways scroll
    assert console.in_view('#jobs-rows td[data-k="status"]') and console.in_view('#jobs-rows td[data-k="cost"]')
    assert page.evaluate("(() => { const box = document.querySelector('#jobs-table').parentElement; "
                         "return box.scrollWidth <= box.clientWidth; })()")
    capture(page, "ops-jobs-phone")

    page.select_option("#f-error", "timed_out")
    page.click("#filters button[type=submit]")
    timed_out = scalar(database_url, "SELECT count(*) FROM story_jobs j JOIN api_clients c ON c.id = j.client_id "
                                     "WHERE c.name = 'acme' AND error_code = 'timed_out'")
    expect(rows).to_have_count(timed_out, timeout=WAIT_MS)
    assert set(page.locator("#jobs-rows td:nth-child(5)").all_inner_texts()) == {"timed_out"}

    # the whole history, 50 at a time, then a time range of it
    page.click("#f-clear")
    expect(rows).to_have_count(50, timeout=WAIT_MS)
    page.click("#jobs-more")
    expect(rows).to_have_count(80, timeout=WAIT_MS)
    expect(page.locator("#jobs-more")).to_be_hidden()
    everything = [str(row) for (row,) in rows_of(database_url, "SELECT public_id FROM story_jobs ORDER BY id DESC")]
    assert rows.evaluate_all("rows => rows.map(r => r.dataset.jobId)") == everything
    (bounds,) = rows_of(
        database_url,
        "SELECT to_char((min(created_at) + interval '1 second') AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS'), "
        "to_char(max(created_at) AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS') FROM "
        "(SELECT created_at FROM story_jobs ORDER BY id DESC OFFSET 10 LIMIT 20) s")
    # the browser runs in the machine's time zone: give it the bounds in local time
    local = page.evaluate("([a, b]) => [a, b].map(t => { const d = new Date(t + 'Z'); "
                          "const p = n => String(n).padStart(2, '0'); return `${d.getFullYear()}-${p(d.getMonth()+1)}-"
                          "${p(d.getDate())}T${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}`; })",
                          list(bounds))
    page.fill("#f-after", local[0])
    page.fill("#f-before", local[1])
    page.click("#filters button[type=submit]")
    # created from one second after the oldest of the 20 to before the newest: the 18 between
    expect(rows).to_have_count(18, timeout=WAIT_MS)
    assert rows.evaluate_all("rows => rows.map(r => r.dataset.jobId)") == everything[11:29]
    assert console.errors == []


def test_a_jobs_page_shows_every_ledger_attempt(system: System, database_url: str, browser: Browser) -> None:
    """A job retried after a 429 shows both requests in its ledger (outcome, billed, tokens, cost, request id),
    its timeline and its story; the list links to it; at 1280 px the ledger, its long error text included,
    fits its box."""

    async def history(conn: psycopg.AsyncConnection[Any]) -> tuple[str, seed.Job]:
        acme, _ = await seed.client(conn, "acme")
        job = seed.completed(acme, 300, cost="0.017500")
        job.calls = [seed.Call("rate_limited", billed=False, error_text=LONG_ERROR), *job.calls]
        await seed.insert_jobs(conn, [job])
        return await seed.operator_key(conn), job

    key, job = seed.seeded(database_url, history)
    api = system.api()
    console = Console(browser, api, LAPTOP)
    page = console.open(key, "#/jobs")
    page.click(f'#jobs-rows tr[data-job-id="{job.public_id}"] a')
    ledger = page.locator("#ledger-rows tr[data-attempt]")
    expect(ledger).to_have_count(2, timeout=WAIT_MS)
    first = ledger.nth(0).locator("td").all_inner_texts()
    second = ledger.nth(1).locator("td").all_inner_texts()
    assert first[:6] == ["1", "rate_limited", "no", "0", "0", "$0"]
    # the error text, whole, on the row under its call; none under the call without one
    expect(page.locator('#ledger-rows tr[data-error-of="1"]')).to_have_text(LONG_ERROR)
    expect(page.locator('#ledger-rows tr[data-error-of="2"]')).to_have_count(0)
    assert second[:7] == ["2", "succeeded", "yes", "300", "900", "$0.0175", str(job.calls[1].request_id)]
    expect(page.locator("#job-id")).to_have_text(str(job.public_id))
    expect(page.locator("#job-status")).to_have_text("completed")
    expect(page.locator('[data-k="job.cost"]')).to_have_text("1 of 2 requests, $0.0175")
    # the summary is the ledger's: what was billed, not what the job's progress counted
    billed_in, billed_out = rows_of(database_url, "SELECT sum(input_tokens), sum(output_tokens) FROM llm_calls "
                                                  "WHERE billed")[0]
    expect(page.locator('[data-k="job.tokens"]')).to_have_text(f"{billed_in:,} in, {billed_out:,} out")
    # times carry their zone
    assert re.search(r" (UTC|GMT[+-]\d+|[A-Z]{3,5})$", page.locator("#job-timeline li").first.inner_text())
    expect(page.locator("#job-timeline li")).to_have_count(4)
    expect(page.locator("#job-story-title")).to_have_text("The Fox")
    expect(page.locator("#job-cancel")).to_be_hidden()
    assert page.evaluate("(() => { const box = document.querySelector('#ledger-table').parentElement; "
                         "return box.scrollWidth <= box.clientWidth; })()")
    capture(page, "ops-job-ledger")
    assert console.errors == []


def test_a_running_jobs_page_shows_the_story_so_far(system: System, database_url: str, browser: Browser) -> None:
    """A running job's page shows its draft under "Story so far", as its client's poll does, with its length
    and when it last grew, and no story yet."""
    draft = "Title: The Fox Who Hums\nOnce upon a time, a fox hummed to the moon.\n\nThe moon hummed"

    async def history(conn: psycopg.AsyncConnection[Any]) -> tuple[str, seed.Job]:
        acme, _ = await seed.client(conn, "acme")
        (job,) = await seed.insert_jobs(conn, [seed.running(acme, 20, worker_id="w1")])
        await conn.execute("INSERT INTO story_draft_chunks (job_id, from_char, chars, text) "
                           "VALUES (%s, 0, 40, %s), (%s, 40, %s, %s)",
                           (job.id, draft[:40], job.id, len(draft) - 40, draft[40:]))
        return await seed.operator_key(conn), job

    key, job = seed.seeded(database_url, history)
    api = system.api()
    console = Console(browser, api, LAPTOP)
    page = console.open(key, f"#/jobs/{job.public_id}")
    expect(page.locator("#job-draft-box")).to_be_visible(timeout=WAIT_MS)
    expect(page.locator("#job-draft-text p")).to_have_text(
        ["Title: The Fox Who Hums\nOnce upon a time, a fox hummed to the moon.", "The moon hummed"])
    expect(page.locator("#job-draft-note")).to_contain_text(f"Still being written: {len(draft)} characters, the last at")
    expect(page.locator("#job-story-box")).to_be_hidden()
    capture(page, "ops-job-draft")
    assert console.errors == []


def test_cancel_one_and_cancel_by_filter_change_exactly_their_jobs(
    system: System, database_url: str, browser: Browser,
) -> None:
    """Cancelling one pending job from its page fails that job only; cancelling the pending jobs matching a
    client filter, after a confirmation that says how many, fails those and leaves running, finished and other
    clients' jobs alone; the clients screen's operator actions list both, newest first."""

    async def history(conn: psycopg.AsyncConnection[Any]) -> tuple[str, int, list[seed.Job]]:
        acme, _ = await seed.client(conn, "acme")
        globex, _ = await seed.client(conn, "globex")
        jobs = await seed.insert_jobs(conn, [
            seed.completed(acme, 900), seed.running(acme, 60), seed.pending(globex, 50), seed.pending(acme, 40),
            seed.pending(globex, 30), seed.pending(acme, 20), seed.pending(acme, 10),
        ])
        return await seed.operator_key(conn, "ada"), acme, jobs

    key, acme, jobs = seed.seeded(database_url, history)
    api = system.api()
    console = Console(browser, api, LAPTOP)
    page = console.open(key, f"#/jobs/{jobs[2].public_id}")
    expect(page.locator("#job-status")).to_have_text("pending", timeout=WAIT_MS)
    page.click("#job-cancel")
    console.confirm(f"Cancel job {jobs[2].public_id}")
    # a cancellation wears its own badge, not a failure's
    expect(page.locator("#job-status .badge.cancelled")).to_have_text("cancelled", timeout=WAIT_MS)
    expect(page.locator("#job-error-code")).to_have_text("cancelled")

    def states() -> list[tuple[str, str | None]]:
        with psycopg.connect(database_url, autocommit=True) as conn:
            return [(status, code) for status, code in conn.execute(
                "SELECT status::text, error_code FROM story_jobs ORDER BY id").fetchall()]

    assert states() == [("completed", None), ("running", None), ("failed", "cancelled"), ("pending", None),
                        ("pending", None), ("pending", None), ("pending", None)]

    page.click("#nav a[data-screen=jobs]")
    page.locator("#f-client").select_option(label="acme")
    page.click("#filters button[type=submit]")
    expect(page.locator("#jobs-rows tr")).to_have_count(5, timeout=WAIT_MS)
    expect(page.locator("#cancel-matching")).to_have_text("Cancel the 3 pending jobs matching this filter…")
    page.click("#cancel-matching")
    console.confirm("Cancel 3 pending jobs of client acme?")
    expect(page.locator("#notice")).to_have_text("Cancelled 3 pending jobs.", timeout=WAIT_MS)
    assert states() == [("completed", None), ("running", None), ("failed", "cancelled"), ("failed", "cancelled"),
                        ("pending", None), ("failed", "cancelled"), ("failed", "cancelled")]
    expect(page.locator("#jobs-rows .badge.pending")).to_have_count(0, timeout=WAIT_MS)
    expect(page.locator("#jobs-rows .badge.cancelled")).to_have_count(3)
    # nothing left to cancel: the action is no longer offered
    expect(page.locator("#cancel-matching")).to_be_hidden()
    logged = [entry for entry in api.events() if str(entry.get("event", "")).startswith("ops.")]
    assert [entry["event"] for entry in logged] == ["ops.job_cancelled", "ops.pending_cancelled"]
    assert all(entry["operator"] == "ada" and entry["operator_key_prefix"] == key.split("_")[1] for entry in logged)

    page.click("#nav a[data-screen=clients]")
    page.click("#actions-log summary")
    actions = page.locator("#actions-rows tr")
    expect(actions).to_have_count(2, timeout=WAIT_MS)
    expect(actions.nth(0).locator("td").nth(2)).to_have_text("pending_cancel")
    expect(actions.nth(0).locator("td").nth(3)).to_have_text(f"client {acme}")
    expect(actions.nth(0).locator("td").nth(4)).to_have_text("3")
    expect(actions.nth(1).locator("td").nth(2)).to_have_text("job_cancel")
    expect(actions.nth(1).locator("td").nth(3)).to_have_text(f"job {str(jobs[2].public_id)[:8]}")
    expect(actions.nth(1).locator("td").nth(4)).to_have_text("1")
    assert console.errors == []


def test_revoking_a_clients_keys_from_the_console_refuses_their_next_request(
    system: System, database_url: str, browser: Browser,
) -> None:
    """The clients screen lists each client's keys; Revoke all keys, once confirmed, makes the client's next
    request a 401 while other clients go on, and the open operator actions section shows the revocation at
    once: who, what, on which client, how many keys."""

    async def clients(conn: psycopg.AsyncConnection[Any]) -> tuple[str, int, str, str]:
        acme_id, acme_key = await seed.client(conn, "acme")
        _, globex_key = await seed.client(conn, "globex")
        return await seed.operator_key(conn, "ada"), acme_id, acme_key, globex_key

    key, acme_id, acme_key, globex_key = seed.seeded(database_url, clients)
    api = system.api()
    console = Console(browser, api, LAPTOP)
    page = console.open(key, "#/clients")
    acme = page.locator("#clients-rows tr", has_text="acme")
    expect(acme.locator(f'li[data-key-prefix="{acme_key.split("_")[1]}"]')).to_contain_text("active since",
                                                                                          timeout=WAIT_MS)
    page.click("#actions-log summary")
    expect(page.locator("#actions-status")).to_have_text("No operator action yet.", timeout=WAIT_MS)
    expect(page.locator("#actions-rows tr")).to_have_count(0)
    acme.locator("button", has_text="Revoke all keys").click()
    console.confirm("Revoke 1 active key of acme")
    expect(acme.locator("li")).to_contain_text("revoked", timeout=WAIT_MS)
    actions = page.locator("#actions-rows tr")
    expect(actions).to_have_count(1, timeout=WAIT_MS)
    expect(actions.locator("td")).to_have_text(
        [re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d "), f"ada ({key.split('_')[1]})", "client_keys_revoke",
         f"client {acme_id}", "1"])
    expect(page.locator("#actions-status")).to_have_text("")
    capture(page, "ops-clients-actions")
    probe = f"{api.base_url}/stories/jobs/00000000-0000-0000-0000-000000000000"
    assert httpx.get(probe, headers={"Authorization": f"Bearer {acme_key}"}).status_code == 401
    assert httpx.get(probe, headers={"Authorization": f"Bearer {globex_key}"}).status_code == 404
    assert console.errors == []


def test_markup_in_stories_errors_and_names_shows_as_text_and_runs_nothing(
    system: System, database_url: str, browser: Browser,
) -> None:
    """A story, an error text, a ledger error, a prompt and a client name holding <img onerror> and <script>
    show those characters as written, on the list and the job's page, and none of it runs."""

    async def history(conn: psycopg.AsyncConnection[Any]) -> tuple[str, seed.Job, seed.Job]:
        evil, _ = await seed.client(conn, f"evil {HOSTILE}")
        story = seed.completed(evil, 200, prompt=f"a dragon {HOSTILE}")
        story.story = seed.Story(f"The {HOSTILE} Dragon", f"It drew {HOSTILE} in the sand.\n\nThen it slept.")
        broken = seed.failed(evil, 100, "llm_error", calls=[seed.Call("failed", error_text=f"provider said {HOSTILE}")])
        broken.error_text = f"the provider answered {HOSTILE}"
        await seed.insert_jobs(conn, [story, broken])
        return await seed.operator_key(conn), story, broken

    key, story, broken = seed.seeded(database_url, history)
    api = system.api()
    console = Console(browser, api, LAPTOP)
    page = console.open(key, "#/jobs")
    expect(page.locator("#jobs-rows tr")).to_have_count(2, timeout=WAIT_MS)
    assert page.locator("#jobs-rows tr").first.locator("td").nth(2).inner_text() == f"evil {HOSTILE}"

    page.goto(console.base + f"#/jobs/{story.public_id}")
    expect(page.locator("#job-story-title")).to_have_text(f"The {HOSTILE} Dragon", timeout=WAIT_MS)
    expect(page.locator("#job-story-text p")).to_have_text([f"It drew {HOSTILE} in the sand.", "Then it slept."])
    expect(page.locator("#job-request")).to_contain_text(f"a dragon {HOSTILE}")

    page.goto(console.base + f"#/jobs/{broken.public_id}")
    expect(page.locator("#job-error-text")).to_have_text(f"the provider answered {HOSTILE}", timeout=WAIT_MS)
    expect(page.locator("#ledger-rows td").last).to_have_text(f"provider said {HOSTILE}")
    page.goto(console.base + "#/clients")
    expect(page.locator("#clients-rows strong").first).to_have_text(f"evil {HOSTILE}", timeout=WAIT_MS)

    assert page.locator("main img, main script").count() == 0
    assert page.evaluate("window.__pwned") is None
    assert console.errors == []


def test_a_client_key_does_not_open_the_console(system: System, database_url: str, browser: Browser) -> None:
    """A client's key typed into the console is refused like any wrong key: the console asks for an operator key
    again and shows no data."""

    async def client(conn: psycopg.AsyncConnection[Any]) -> str:
        _, key = await seed.client(conn, "acme")
        await seed.insert_jobs(conn, [seed.pending(1, 10)])
        return key

    client_key = seed.seeded(database_url, client)
    api = system.api()
    console = Console(browser, api, LAPTOP)
    page = console.page
    page.goto(console.base)
    page.fill("#key-input", client_key)
    page.click("#key-form button[type=submit]")
    expect(page.locator("#error")).to_contain_text("The operator key was refused", timeout=WAIT_MS)
    expect(page.locator("#key-screen")).to_be_visible()
    expect(page.locator("#overview-screen")).to_be_hidden()
    assert page.locator('[data-k="queue.pending"]').inner_text() == ""
    assert page.evaluate("sessionStorage.length + localStorage.length") == 0
    # the refused requests are the browser's own 401 console lines, nothing else
    assert all("401" in error for error in console.errors), console.errors


def test_the_console_files_come_with_the_strict_csp(system: System) -> None:
    """/ops/ and its script and style are served with the CSP, nosniff and no-referrer; the page holds no
    inline script or style, and its files are not reachable as /static/ops.html."""
    api = system.api()
    with httpx.Client(base_url=api.base_url) as client:
        modules = ["ops.js", "ops-ui.js", "ops-overview.js", "ops-jobs.js", "ops-job.js", "ops-clients.js",
                   "ops-workers.js", "ops-batches.js", "ops-actions.js", "ops-webhooks.js", "format.js", "http.js"]
        for path, content_type in (("/ops/", "text/html; charset=utf-8"), ("/ops", "text/html; charset=utf-8"),
                                   *((f"/static/{name}", "text/javascript; charset=utf-8") for name in modules),
                                   ("/static/ops.css", "text/css; charset=utf-8")):
            answer = client.get(path)
            assert answer.status_code == 200, path
            assert answer.headers["content-type"] == content_type, path
            assert answer.headers["content-security-policy"] == CONTENT_SECURITY_POLICY, path
            assert answer.headers["x-content-type-options"] == "nosniff", path
            assert answer.headers["referrer-policy"] == "no-referrer", path
        page = client.get("/ops/").text
        assert "<script>" not in page and "<style" not in page and " style=" not in page
        assert re.search(r"\son[a-z]+=", page) is None
        assert client.get("/static/ops.html").status_code == 404
    assert "default-src 'none'" in CONTENT_SECURITY_POLICY and "script-src 'self'" in CONTENT_SECURITY_POLICY


def test_an_unknown_job_id_after_a_known_one_shows_only_that_it_is_unknown(
    system: System, database_url: str, browser: Browser,
) -> None:
    """A job's page, then an id no job has (typed into the job search): the screen says no such job and shows
    nothing of the previous job; a known id typed into the search opens that job."""

    async def history(conn: psycopg.AsyncConnection[Any]) -> tuple[str, seed.Job]:
        acme, _ = await seed.client(conn, "acme")
        [job] = await seed.insert_jobs(conn, [seed.completed(acme, 300)])
        return await seed.operator_key(conn), job

    key, job = seed.seeded(database_url, history)
    api = system.api()
    console = Console(browser, api, LAPTOP)
    page = console.open(key, f"#/jobs/{job.public_id}")
    expect(page.locator("#job-story-title")).to_have_text("The Fox", timeout=WAIT_MS)

    unknown = "0b6f3c9e-7f3a-4d3c-9c1e-5a7e2b1d9f00"
    page.fill("#find-job-id", unknown)
    page.click("#find-job button[type=submit]")
    expect(page.locator("#job-missing")).to_be_visible(timeout=WAIT_MS)
    expect(page.locator("#job-missing-id")).to_have_text(unknown)
    expect(page.locator("#job-found")).to_be_hidden()
    expect(page.locator("#error")).to_be_hidden()
    assert not page.locator("#job-story-title").is_visible() and not page.locator("#ledger-rows").is_visible()
    capture(page, "ops-job-unknown")

    page.fill("#find-job-id", f"  {str(job.public_id).upper()} ")
    page.click("#find-job button[type=submit]")
    expect(page.locator("#job-id")).to_have_text(str(job.public_id), timeout=WAIT_MS)
    expect(page.locator("#job-missing")).to_be_hidden()
    capture(page, "ops-job")
    assert console.errors == [] or all("404" in error for error in console.errors), console.errors


def test_the_clients_screen_shows_each_clients_spend_budget_jobs_and_failures_today(
    system: System, database_url: str, browser: Browser,
) -> None:
    """Each client's row shows today's spend (UTC) against its own budget or CLIENT_BUDGET_USD_PER_DAY, and the
    jobs it created today with their failures, cancellations aside; on a phone they stay in view."""

    async def history(conn: psycopg.AsyncConnection[Any]) -> str:
        acme, _ = await seed.client(conn, "acme")
        globex, _ = await seed.client(conn, "globex")
        await conn.execute("UPDATE api_clients SET budget_usd_per_day = 2.5 WHERE id = %s", [globex])
        await seed.insert_jobs(conn, [
            seed.completed(acme, 60), seed.completed(acme, 120), seed.failed(acme, 30, "llm_error"),
            seed.failed(acme, 20, "cancelled"), seed.pending(globex, 10),
        ])
        await conn.execute("INSERT INTO budget_days (client_id, day, spent_usd, reserved_usd) VALUES "
                           "(%s, (now() AT TIME ZONE 'UTC')::date, 1.25, 0), "
                           "(%s, (now() AT TIME ZONE 'UTC')::date, 0.004, 0.5)", [acme, globex])
        return await seed.operator_key(conn)

    key = seed.seeded(database_url, history)
    api = system.api(CLIENT_BUDGET_USD_PER_DAY=5)
    console = Console(browser, api, PHONE)
    page = console.open(key, "#/clients")
    acme = page.locator("#clients-rows tr", has_text="acme")
    globex = page.locator("#clients-rows tr", has_text="globex")
    expect(acme.locator('[data-k="spend"]')).to_contain_text("$1.25 spent", timeout=WAIT_MS)
    expect(acme.locator('[data-k="spend"]')).to_contain_text("of $5.00 (25 %)")
    expect(globex.locator('[data-k="spend"]')).to_contain_text("$0.0040 spent + $0.5000 reserved")
    expect(globex.locator('[data-k="spend"]')).to_contain_text("of $2.50 (20 %)")

    def today(name: str) -> tuple[int, int]:
        (row,) = rows_of(database_url, "SELECT count(*), count(*) FILTER (WHERE status = 'failed' AND error_code "
                                       "<> 'cancelled') FROM story_jobs j JOIN api_clients c ON c.id = j.client_id "
                                       "WHERE c.name = %s AND j.created_at >= date_trunc('day', now() AT TIME ZONE "
                                       "'UTC') AT TIME ZONE 'UTC'", name)
        return int(row[0]), int(row[1])

    for row, name in ((acme, "acme"), (globex, "globex")):
        jobs, failures = today(name)
        expect(row.locator('[data-k="jobs"]')).to_have_text(str(jobs))
        expect(row.locator('[data-k="failures"]')).to_have_text(str(failures))
    capture(page, "ops-clients-phone")
    assert console.fits_the_screen() and console.in_view('#clients-rows td[data-k="failures"]')
    assert console.errors == []


def test_the_workers_screen_shows_busy_gone_and_idle_workers_and_the_offline_writer_is_named(
    system: System, database_url: str, browser: Browser,
) -> None:
    """A worker heartbeating its running job is busy, one whose heartbeat is past HEARTBEAT_TIMEOUT_S is gone,
    one seen only by a recent request is idle; a request by the offline writer is said on the overview."""

    async def history(conn: psycopg.AsyncConnection[Any]) -> str:
        acme, _ = await seed.client(conn, "acme")
        await seed.insert_jobs(conn, [
            seed.running(acme, 20, worker_id="w-busy"), seed.running(acme, 300, worker_id="w-gone"),
            seed.completed(acme, 600, worker_id="w-idle"),
        ])
        await conn.execute("UPDATE story_jobs SET heartbeat_at = now() - interval '200 seconds' "
                           "WHERE worker_id = 'w-gone'")
        await conn.execute("UPDATE story_jobs SET heartbeat_at = now() - interval '2 seconds' "
                           "WHERE worker_id = 'w-busy'")
        await conn.execute("UPDATE llm_calls SET provider = 'offline' WHERE worker_id = 'w-idle'")
        return await seed.operator_key(conn)

    key = seed.seeded(database_url, history)
    api = system.api(HEARTBEAT_TIMEOUT_S=60)
    console = Console(browser, api, LAPTOP)
    page = console.open(key, "#/workers")
    for worker, state in (("w-busy", "busy"), ("w-gone", "gone"), ("w-idle", "idle")):
        expect(page.locator(f'#workers-rows tr[data-worker-id="{worker}"] [data-k="state"]')).to_have_text(
            state, timeout=WAIT_MS)
    held = rows_of(database_url, "SELECT public_id::text FROM story_jobs WHERE worker_id = 'w-busy'")
    expect(page.locator('#workers-rows tr[data-worker-id="w-busy"] a')).to_have_count(len(held))
    capture(page, "ops-workers")

    page.click("#nav a[data-screen=overview]")
    expect(page.locator("#offline-note")).to_be_visible(timeout=WAIT_MS)
    expect(page.locator("#writers-now")).to_contain_text("offline writer")
    assert console.errors == []


def test_the_webhooks_screen_lists_endpoints_with_their_deliveries_and_retries_a_dead_one(
    system: System, database_url: str, browser: Browser,
) -> None:
    """With no endpoint the screen says so; then an endpoint shows its client, URL, state and counts and its last
    deliveries (event, job, state, attempts, status code, error as text, last attempt), and on a phone Retry on
    the dead one makes it pending in the database and on the screen."""
    key = seed.seeded(database_url, seed.operator_key)
    api = system.api()
    console = Console(browser, api, PHONE)
    page = console.open(key, "#/webhooks")
    expect(page.locator("#webhooks-empty")).to_have_text("No webhook endpoint yet.", timeout=WAIT_MS)
    expect(page.locator("#webhooks-list article")).to_have_count(0)

    async def endpoint(conn: psycopg.AsyncConnection[Any]) -> tuple[str, int, int, seed.Job]:
        acme, _ = await seed.client(conn, "acme")
        row = await ApiStore(conn).webhook_endpoint_insert(client_id=acme, url="https://hooks.acme.example/in",
                                                           events=webhooks.EVENTS, secret=webhooks.new_secret(),
                                                           max_per_client=10)
        assert row is not None
        done, broken = await seed.insert_jobs(conn, [seed.completed(acme, 600), seed.failed(acme, 300, "llm_error")])
        ids = []
        for job, state, attempts, status, error in (
                (done, "delivered", 1, 200, None), (broken, "dead", 8, 500, f"HTTP 500 {HOSTILE}")):
            cur = await conn.execute(
                "INSERT INTO webhook_deliveries (endpoint_id, client_id, job_id, job_public_id, job_status, "
                "error_code, occurred_at, state, attempts, last_attempt_at, last_status_code, last_error, "
                "delivered_at) "
                "SELECT %s, client_id, %s, %s, %s::job_status, %s, now() - interval '5 minutes', %s, %s, "
                "now() - interval '1 minute', %s, %s, CASE WHEN %s = 'delivered' THEN now() END "
                "FROM webhook_endpoints WHERE id = %s RETURNING id",
                (row.id, job.id, job.public_id, job.status, job.error_code, state, attempts, status, error, state,
                 row.id))
            ids.append(int((await cur.fetchone() or [0])[0]))
        await conn.execute("UPDATE webhook_endpoints SET failing_since = now() WHERE id = %s", (row.id,))
        return str(row.id), ids[0], ids[1], broken

    endpoint_id, delivered_id, dead_id, broken = seed.seeded(database_url, endpoint)
    page.reload()
    card = page.locator(f'#webhooks-list article[data-endpoint-id="{endpoint_id}"]')
    expect(card.locator("h2")).to_have_text("acme", timeout=WAIT_MS)
    expect(page.locator("#webhooks-empty")).to_be_hidden()
    expect(card.locator('[data-k="url"]')).to_have_text("https://hooks.acme.example/in")
    expect(card.locator('[data-k="endpoint-state"]')).to_have_text("failing")
    expect(card.locator('[data-k="counts"]')).to_contain_text("0 pending · 1 dead")
    delivered = card.locator(f'tr[data-delivery-id="{delivered_id}"]')
    dead = card.locator(f'tr[data-delivery-id="{dead_id}"]')
    moment = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ")
    expect(delivered.locator("td")).to_have_text([re.compile(r"^job\.completed\s*[0-9a-f]{8}$"), "delivered", "1",
                                                  "200", moment])
    expect(dead.locator("td")).to_have_text([re.compile(rf"^job\.failed\s*{str(broken.public_id)[:8]}$"),
                                             re.compile(r"^dead\s*Retry$"), "8", "500", moment])
    expect(dead.locator("a")).to_have_attribute("href", f"#/jobs/{broken.public_id}")
    expect(card.locator('[data-k="last-error"]')).to_have_text(f"HTTP 500 {HOSTILE}")
    expect(delivered.locator("button")).to_have_count(0)
    capture(page, "ops-webhooks")
    assert console.fits_the_screen() and console.in_view(f'tr[data-delivery-id="{dead_id}"] button')

    dead.locator("button", has_text="Retry").click()
    expect(dead.locator('[data-k="state"]')).to_have_text("pending", timeout=WAIT_MS)
    expect(page.locator("#notice")).to_contain_text(f"job {str(broken.public_id)[:8]} will be sent again")
    expect(dead.locator("button")).to_have_count(0)
    assert rows_of(database_url, "SELECT state, attempts, next_attempt_at <= now() FROM webhook_deliveries "
                                 "WHERE id = %s", dead_id) == [("pending", 0, True)]
    assert scalar(database_url, "SELECT state FROM webhook_deliveries WHERE id = %s", delivered_id) == "delivered"
    assert page.locator("main img, main script").count() == 0 and page.evaluate("window.__pwned") is None
    assert console.errors == []

    laptop = Console(browser, api, LAPTOP)
    wide = laptop.open(key, "#/webhooks")
    expect(wide.locator(f'tr[data-delivery-id="{dead_id}"] [data-k="state"]')).to_have_text("pending", timeout=WAIT_MS)
    expect(wide.locator(f'tr[data-delivery-id="{dead_id}"] [data-k="last-attempt"]')).to_be_visible()
    capture(wide, "ops-webhooks-laptop")


def test_an_operator_sets_a_clients_weight_from_the_clients_screen(
    system: System, database_url: str, browser: Browser,
) -> None:
    """Each client shows its weight (1 by default); setting acme's to 3 stores it, shows it, says what it does,
    and the operator actions section records who set it on which client."""

    async def clients(conn: psycopg.AsyncConnection[Any]) -> tuple[str, int]:
        acme_id, _ = await seed.client(conn, "acme")
        await seed.client(conn, "globex")
        return await seed.operator_key(conn, "ada"), acme_id

    key, acme_id = seed.seeded(database_url, clients)
    console = Console(browser, system.api(), LAPTOP)
    page = console.open(key, "#/clients")
    acme = page.locator("#clients-rows tr", has_text="acme")
    weight = acme.locator('td[data-k="weight"] input')
    expect(weight).to_have_value("1", timeout=WAIT_MS)
    page.click("#actions-log summary")
    weight.fill("3")
    acme.locator('td[data-k="weight"] button').click()
    expect(page.locator("#notice")).to_contain_text("acme now has weight 3", timeout=WAIT_MS)
    expect(weight).to_have_value("3")
    expect(page.locator("#clients-rows tr", has_text="globex").locator('td[data-k="weight"] input')).to_have_value("1")
    expect(page.locator("#actions-rows tr").first.locator("td")).to_have_text(
        [re.compile(r"^\d{4}-\d\d-\d\d "), f"ada ({key.split('_')[1]})", "client_weight_set",
         f"client {acme_id}, weight 3", "1"], timeout=WAIT_MS)
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert conn.execute("SELECT name, weight FROM api_clients ORDER BY name").fetchall() == [
            ("acme", 3), ("globex", 1)]


def test_the_batches_screen_lists_batches_newest_first_with_their_counts_expiry_cost_and_saving(
    system: System, database_url: str, browser: Browser,
) -> None:
    """The Batches screen lists message batches newest first, 50 at a time with Older for the rest: each one's
    state, the provider's id and counts, its expiry, what its ledger rows cost and what that saved against the
    interactive price; the jobs list shows each job's lane, a batch job's page its batch and when it is due, and
    the overview counts the batch lane apart from the interactive queue; on a phone the batch, its state, counts
    and cost stay in view."""

    async def history(conn: psycopg.AsyncConnection[Any]) -> tuple[str, list[int], list[seed.Job], seed.Job]:
        acme, _ = await seed.client(conn, "acme")
        # 52 old batches whose create the provider refused (nothing billed), then three of today
        await conn.execute(
            "INSERT INTO message_batches (state, model, request_count, fence_at, created_at, ended_at) "
            "SELECT 'refused', 'claude-sonnet-5-5', 1, now() - interval '3 days' + make_interval(mins => g), "
            "now() - interval '3 days' + make_interval(mins => g), now() - interval '3 days' "
            "FROM generate_series(1, 52) g")
        done = await seed.insert_jobs(conn, [seed.completed(acme, 4000 + n, cost=cost)
                                             for n, cost in enumerate(("0.010000", "0.012500", "0.002500"))])
        flying = await seed.insert_jobs(conn, [seed.running(acme, 600), seed.running(acme, 600)])
        [plain] = await seed.insert_jobs(conn, [seed.pending(acme, 30)])
        ended = await seed.batch(conn, "ended", done, created_ago_s=7200, provider_batch_id="msgbatch_0001ended",
                                 counts={"succeeded": 3}, processing_status="ended")
        sent = await seed.batch(conn, "sent", flying, created_ago_s=600, provider_batch_id="msgbatch_0002flying",
                                counts={"processing": 2}, processing_status="in_progress")
        intent = await seed.batch(conn, "intent", [], created_ago_s=30)
        return await seed.operator_key(conn), [intent, sent, ended], [*done, *flying], plain

    key, (intent, sent, ended), batch_jobs, plain = seed.seeded(database_url, history)
    api = system.api()
    console = Console(browser, api, LAPTOP)
    page = console.open(key, "#/batches")
    rows = page.locator("#batches-rows tr")
    expect(rows).to_have_count(50, timeout=WAIT_MS)
    assert rows.evaluate_all("rows => rows.slice(0, 3).map(r => Number(r.dataset.batchId))") == [intent, sent, ended]
    newest_first = [int(row) for (row,) in rows_of(database_url, "SELECT id FROM message_batches ORDER BY id DESC")]
    page.click("#batches-more")
    expect(rows).to_have_count(55, timeout=WAIT_MS)
    expect(page.locator("#batches-more")).to_be_hidden()
    assert rows.evaluate_all("rows => rows.map(r => Number(r.dataset.batchId))") == newest_first

    def shown(batch_id: int, key_: str) -> str:
        return page.locator(f'#batches-rows tr[data-batch-id="{batch_id}"] [data-k="{key_}"]').inner_text()

    cost = scalar(database_url, "SELECT sum(cost_usd) FROM llm_calls WHERE batch_id = %s AND billed", ended)
    assert cost == Decimal("0.025")
    assert (shown(ended, "state"), shown(ended, "counts"), shown(ended, "cost"), shown(ended, "saved")) == (
        "ended", "3 succeeded", usd(cost), usd(cost))
    assert "msgbatch_0001ended" in shown(ended, "batch")
    assert (shown(sent, "state"), shown(sent, "counts"), shown(sent, "cost")) == ("sent", "2 processing", "$0")
    assert re.search(r"\nin 23\.\d h$", shown(sent, "expires")), shown(sent, "expires")
    assert (shown(intent, "state"), shown(intent, "counts")) == ("intent", "0 requests")
    refused = newest_first[-1]
    assert (shown(refused, "state"), shown(refused, "counts"), shown(refused, "cost")) == ("refused", "1 request", "$0")
    expect(page.locator("#batches-status")).to_have_text(
        f"55 batches shown: {usd(cost)} at 50 % of the interactive price, {usd(cost)} saved.")
    capture(page, "ops-batches")
    assert console.fits_the_screen() and console.in_view('#batches-rows td[data-k="saved"]')

    # each job's lane in the list; a batch job's batch and due time on its page
    page.click("#nav a[data-screen=jobs]")
    expect(page.locator("#jobs-rows tr")).to_have_count(6, timeout=WAIT_MS)
    lanes = dict(zip(page.locator("#jobs-rows tr").evaluate_all("rows => rows.map(r => r.dataset.jobId)"),
                     page.locator('#jobs-rows td[data-k="lane"]').all_inner_texts(), strict=True))
    assert lanes == {**{str(job.public_id): "batch" for job in batch_jobs}, str(plain.public_id): "interactive"}
    page.goto(console.base + f"#/jobs/{batch_jobs[3].public_id}")
    expect(page.locator('[data-k="job.batch"]')).to_have_text(f"#{sent} sent (in_progress), msgbatch_0002flying",
                                                              timeout=WAIT_MS)
    expect(page.locator('[data-k="job.lane"]')).to_contain_text("batch")
    expires = scalar(database_url, "SELECT expires_at FROM message_batches WHERE id = %s", sent)
    due = page.evaluate("iso => { const t = new Date(iso); const p = n => String(n).padStart(2, '0'); "
                        "return `${t.getFullYear()}-${p(t.getMonth() + 1)}-${p(t.getDate())} ${p(t.getHours())}:"
                        "${p(t.getMinutes())}:${p(t.getSeconds())}`; }", expires.isoformat())
    expect(page.locator('[data-k="job.due_by"]')).to_contain_text(due)
    capture(page, "ops-job-batch")
    page.click('[data-k="job.batch"] a')
    expect(page.locator("#batches-rows tr").first).to_be_visible(timeout=WAIT_MS)

    page.click("#nav a[data-screen=overview]")
    expect(page.locator('[data-k="queue.batch_live"]')).to_have_text("2", timeout=WAIT_MS)
    assert cell(page, "queue.pending") == "1" and cell(page, "queue.running") == "0"

    phone = Console(browser, api, PHONE)
    small = phone.open(key, "#/batches")
    expect(small.locator("#batches-rows tr")).to_have_count(50, timeout=WAIT_MS)
    assert phone.fits_the_screen()
    capture(small, "ops-batches-phone")
    for column in ("batch", "state", "counts", "cost"):
        assert phone.in_view(f'#batches-rows tr[data-batch-id="{ended}"] td[data-k="{column}"]'), column
    assert console.errors == [] and phone.errors == []
