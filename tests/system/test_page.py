"""The page at GET /, driven in a real headless Chromium against the real processes.

Playwright's sync API cannot run inside an event loop, so these tests are
plain sync tests. Each screen a parent meets is captured in
test-output/screens/ (tests/system/screens.py).
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import httpx
import psycopg
import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, Request, Response, expect

from api.page import CONTENT_SECURITY_POLICY
from tests.fakes.anthropic_server import FakeAnthropicServer, Plan
from tests.support.database import create_key_sync
from tests.support.waiting import wait_until_sync
from tests.system.procs import System
from tests.system.screens import capture

pytestmark = [pytest.mark.system, pytest.mark.browser]

# a poll may wait a few seconds, and the machine is shared: be generous
WAIT_MS = 60_000
PHONE: dict[str, Any] = {"viewport": {"width": 390, "height": 844}, "device_scale_factor": 2, "is_mobile": True,
                         "has_touch": True}

TITLE = "The Dragon Who Counted Stars"
STORY = (f"Title: {TITLE}\n"
         "Once upon a time a small dragon named Ember could not sleep.\n\n"
         "She counted the stars, one by one, until her eyes grew heavy. The end.")
HOSTILE_TITLE = 'The <img src=x onerror="window.__pwned=3"> Dragon'
HOSTILE_STORY = (f"Title: {HOSTILE_TITLE}\n"
                 'The dragon drew <img src=x onerror="window.__pwned=1"> in the sand.\n\n'
                 "Then she wrote <script>window.__pwned=2</script> and fell asleep.")
BUSY = "Lots of stories are being written right now. We'll keep trying."


@pytest.fixture
def llm(fake_llm: FakeAnthropicServer) -> dict[str, Any]:
    """The worker environment that points the SDK at the fake provider."""
    return {"ANTHROPIC_API_KEY": "test", "ANTHROPIC_BASE_URL": fake_llm.base_url}


def open_page(browser: Browser, url: str, console_errors: list[str], **context: Any) -> Page:
    # a phone's screen: the page is made for reading in bed
    page = browser.new_context(**{**PHONE, **context}).new_page()

    def keep_error(message: ConsoleMessage) -> None:
        # the browser logs every 4xx a script meets (the key check's 404 among them):
        # a network note, not a script error
        if message.type == "error" and not message.text.startswith("Failed to load resource"):
            console_errors.append(message.text)

    page.on("console", keep_error)
    page.on("pageerror", lambda error: console_errors.append(str(error)))
    page.goto(url)
    return page


def save_key(page: Page, api_key: str) -> None:
    page.fill("#api-key", api_key)
    page.click("#key-form button[type=submit]")
    expect(page.locator("#key-saved")).to_be_visible(timeout=WAIT_MS)


def jobs_of(database_url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        return conn.execute("SELECT status::text, error_code, idempotency_key FROM story_jobs ORDER BY id").fetchall()


def test_page_follows_a_story_from_the_queue_to_its_text_with_a_bar_and_a_percentage(
    system: System, fake_llm: FakeAnthropicServer, llm: dict[str, Any], database_url: str, browser: Browser,
) -> None:
    """A parent saves the key, asks for a story, sees it next in line, then a determinate bar and a percentage
    that only grow, then the story; the language offered first is the browser's, and the story is asked in it."""
    hold = threading.Event()
    # 60 chunks of 5 words: 300 output tokens of a short story's 440 expected
    fake_llm.fake.default = Plan(chunks=60, duration_s=6, hold=hold)
    api_key = create_key_sync(database_url, "page")
    api = system.api()
    console_errors: list[str] = []
    page = open_page(browser, f"{api.base_url}/", console_errors, locale="fr-FR")
    status = page.locator("#status")
    capture(page, "page-key")

    save_key(page, api_key)
    expect(page.locator("#language")).to_have_value("fr-FR")
    page.fill("#prompt", "un dragon qui ne trouve pas le sommeil")
    page.fill("#child-name", "Mia")
    page.select_option("#age", "5")
    page.select_option("#length", "short")
    capture(page, "page-form")
    page.click("#submit")
    # no worker yet: the job waits its turn
    expect(status).to_contain_text("Your story is next in line.", timeout=WAIT_MS)
    expect(page.locator("#progress")).to_have_attribute("value", "0")
    expect(page.locator("#cancel")).to_be_visible()
    capture(page, "page-waiting")

    system.worker(**llm, HEARTBEAT_INTERVAL_S=0.5, HEARTBEAT_TIMEOUT_S=10)
    expect(status).to_contain_text("% done", timeout=WAIT_MS)
    seen: list[int] = []

    def past_half_way() -> bool:
        """Samples the bar, keeping each value it shows."""
        value = int(page.locator("#progress").get_attribute("value") or 0)
        if not seen or value != seen[-1]:
            seen.append(value)
        return seen[-1] >= 50

    wait_until_sync(past_half_way, timeout=30, interval=0.2, what="the bar to pass half way")
    expect(status).to_contain_text(f"Writing your story… {seen[-1]} % done.")
    expect(page.locator("#percent")).to_have_text(f"{seen[-1]} %")
    capture(page, "page-writing")
    hold.set()
    expect(page.locator("#story-title")).to_be_visible(timeout=WAIT_MS)
    expect(status).to_have_text("Your story is ready.")
    expect(page.locator("#progress")).to_be_hidden()
    expect(page.locator("#submit")).to_be_enabled()
    capture(page, "page-story")

    assert seen == sorted(seen) and seen[-1] >= 50 and seen[-1] < 100, seen
    [call] = fake_llm.fake.billed
    assert "Mia" in call.prompt and "5 years old" in call.prompt and "'fr-FR'" in call.prompt
    assert [row[:2] for row in jobs_of(database_url)] == [("completed", None)]
    # a Content-Security-Policy violation or a script error would show here
    assert console_errors == []


def test_page_under_a_full_queue_keeps_trying_with_the_same_key_until_it_frees(
    system: System, fake_llm: FakeAnthropicServer, llm: dict[str, Any], database_url: str, browser: Browser,
) -> None:
    """With the queue full for 20 s the page keeps asking with one Idempotency-Key, honouring Retry-After, says
    one plain message with the seconds to the next try, and shows the story once the queue frees."""
    hold = threading.Event()
    fake_llm.fake.queue_for("blocker", Plan(chunks=2, hold=hold))
    fake_llm.fake.default = Plan(chunks=4, text=STORY)
    api_key = create_key_sync(database_url, "page")
    api = system.api(QUEUE_MAX=1)
    system.worker(**llm, HEARTBEAT_INTERVAL_S=0.5, HEARTBEAT_TIMEOUT_S=30)
    other = create_key_sync(database_url, "other")
    with httpx.Client(base_url=api.base_url, headers={"Authorization": f"Bearer {other}"}) as client:
        for n in range(2):
            answer = client.post("/stories/generate", json={"prompt": f"blocker {n}"},
                                 headers={"Idempotency-Key": f"blocker-{n}"})
            assert answer.status_code == 202
            if n == 0:
                fake_llm.fake.wait_for(lambda fake: len(fake.calls) == 1)
    # one job running (held), one pending: the queue is full
    console_errors: list[str] = []
    page = open_page(browser, f"{api.base_url}/", console_errors)
    posts: list[tuple[float, str]] = []
    answers: list[tuple[float, int, str | None]] = []

    def keep_post(request: Request) -> None:
        if request.method == "POST":
            posts.append((time.monotonic(), request.headers["idempotency-key"]))

    def keep_answer(response: Response) -> None:
        if response.request.method == "POST":
            answers.append((time.monotonic(), response.status, response.headers.get("retry-after")))

    page.on("request", keep_post)
    page.on("response", keep_answer)
    save_key(page, api_key)
    page.fill("#prompt", "a dragon who can't sleep")
    page.click("#submit")
    status = page.locator("#status")
    expect(status).to_contain_text(BUSY, timeout=WAIT_MS)
    expect(status).to_contain_text(re.compile(r"Next try in \d+ s\."))
    expect(page.locator("#details")).to_be_hidden()
    expect(page.locator("#retry")).to_be_hidden()
    expect(page.locator("#key-message")).to_be_hidden()
    capture(page, "page-queue-full")
    freed = threading.Timer(20, hold.set)
    freed.start()
    try:
        expect(page.locator("#story-title")).to_have_text(TITLE, timeout=90_000)
    finally:
        freed.cancel()
    expect(status).to_have_text("Your story is ready.")

    refused = [answer for answer in answers if answer[1] == 429]
    assert len(refused) >= 2 and answers[-1][1] == 202
    # the api's Retry-After, honoured: no try came before the previous answer asked
    assert all(retry_after is not None and int(retry_after) >= 1 for _, _, retry_after in refused)
    for (answered_at, _, retry_after), (sent_at, _) in zip(answers, posts[1:], strict=False):
        assert sent_at - answered_at >= min(int(retry_after or 0), 30) - 0.2
    assert posts[-1][0] - posts[0][0] >= 15
    assert {key for _, key in posts} == {posts[0][1]}
    assert [row[0] for row in jobs_of(database_url)] == ["completed", "completed", "completed"]
    assert console_errors == []


def test_page_says_a_failure_in_plain_words_and_try_again_writes_the_story(
    system: System, fake_llm: FakeAnthropicServer, llm: dict[str, Any], database_url: str, browser: Browser,
) -> None:
    """A story whose stream breaks shows a parent's message and the code on a details line; Try again asks
    with a new key (the first job certainly failed) and shows the story."""
    fake_llm.fake.queue(Plan(chunks=6, drop_after=2))
    fake_llm.fake.default = Plan(chunks=4, text=STORY)
    api_key = create_key_sync(database_url, "page")
    api = system.api()
    system.worker(**llm)
    console_errors: list[str] = []
    page = open_page(browser, f"{api.base_url}/", console_errors)

    save_key(page, api_key)
    page.fill("#prompt", "a dragon who can't sleep")
    page.click("#submit")

    status = page.locator("#status")
    expect(status).to_have_text("The storyteller stopped in the middle of your story.", timeout=WAIT_MS)
    expect(page.locator("#details")).to_contain_text("llm_error")
    assert "RemoteProtocolError" not in status.inner_text() and "LLM" not in status.inner_text()
    expect(page.locator("#story")).to_be_hidden()
    expect(page.locator("#retry")).to_be_visible()
    capture(page, "page-failed")

    page.click("#retry")
    expect(page.locator("#story-title")).to_have_text(TITLE, timeout=WAIT_MS)
    expect(page.locator("#details")).to_be_hidden()
    expect(page.locator("#retry")).to_be_hidden()
    jobs = jobs_of(database_url)
    assert [row[:2] for row in jobs] == [("failed", "llm_error"), ("completed", None)]
    assert jobs[0][2] != jobs[1][2]
    assert console_errors == []


KEY_IN_STORAGE = "[sessionStorage.getItem('storyjobs.apiKey'), localStorage.getItem('storyjobs.apiKey')]"


def test_page_checks_a_key_when_it_is_saved_and_keeps_it_for_the_tab_unless_asked(
    system: System, database_url: str, browser: Browser
) -> None:
    """A key the api does not know is refused at once and not kept; a known one is kept in this tab's
    sessionStorage, so another tab asks for it again, and in localStorage only with "keep it on this device"."""
    api_key = create_key_sync(database_url, "page")
    api = system.api()
    console_errors: list[str] = []
    page = open_page(browser, f"{api.base_url}/", console_errors)

    page.fill("#api-key", "sj_notakey_000000000000000000000000")
    page.click("#key-form button[type=submit]")
    expect(page.locator("#key-message")).to_have_text("This key was not accepted. Check it and enter it again.",
                                                      timeout=WAIT_MS)
    expect(page.locator("#key-saved")).to_be_hidden()
    assert page.evaluate(KEY_IN_STORAGE) == [None, None]
    capture(page, "page-key-refused")

    save_key(page, api_key)
    expect(page.locator("#key-message")).to_be_hidden()
    assert page.evaluate(KEY_IN_STORAGE) == [api_key, None]
    other_tab = page.context.new_page()
    other_tab.goto(f"{api.base_url}/")
    expect(other_tab.locator("#key-form")).to_be_visible(timeout=WAIT_MS)
    expect(other_tab.locator("#key-saved")).to_be_hidden()
    other_tab.close()

    page.click("#change-key")
    page.check("#key-keep")
    save_key(page, api_key)
    assert page.evaluate(KEY_IN_STORAGE) == [None, api_key]
    other_tab = page.context.new_page()
    other_tab.goto(f"{api.base_url}/")
    expect(other_tab.locator("#key-saved")).to_be_visible(timeout=WAIT_MS)

    page.click("#change-key")
    assert page.evaluate(KEY_IN_STORAGE) == [None, None]
    assert console_errors == []


def test_page_time_left_moves_smoothly_and_never_says_one_seconds(
    system: System, browser: Browser,
) -> None:
    """The estimate shown follows jumping api estimates by a few seconds at a time and is said in round words."""
    api = system.api()
    page = open_page(browser, f"{api.base_url}/", [])
    # the api's estimates of a real run, one poll every 2 s
    shown = page.evaluate("""async () => {
        const { Remaining, timeLeftText } = await import('/static/app.js');
        const remaining = new Remaining();
        const out = [];
        [18, 20, 28, 42, 4, 1, 2].forEach((next, i) => {
            const value = remaining.update(next, i * 2000);
            out.push([value, timeLeftText(value)]);
        });
        out.push([1, timeLeftText(1)], [70, timeLeftText(70)], [300, timeLeftText(300)]);
        return out;
    }""")
    values = [value for value, _ in shown[:7]]
    for before, after in zip(values, values[1:], strict=False):
        counted = before - 2  # two seconds passed between polls
        assert counted - max(3, counted * 0.25) - 1e-9 <= after <= counted + 3 + 1e-9, values
    assert not any(re.search(r"\b1 seconds?\b", text) for _, text in shown), shown
    assert [text for _, text in shown[-3:]] == [" Almost there.", " About a minute left.", " About 5 minutes left."]


def test_page_shows_markup_in_a_story_as_text_and_runs_none_of_it(
    system: System, fake_llm: FakeAnthropicServer, llm: dict[str, Any], database_url: str, browser: Browser,
) -> None:
    """A story holding <img onerror> and <script> shows them as literal text and runs nothing; / carries the CSP."""
    fake_llm.fake.default = Plan(chunks=4, text=HOSTILE_STORY)
    api_key = create_key_sync(database_url, "page")
    api = system.api()
    system.worker(**llm)
    console_errors: list[str] = []
    page = open_page(browser, f"{api.base_url}/", console_errors)

    save_key(page, api_key)
    page.fill("#prompt", "a dragon who draws in the sand")
    page.click("#submit")
    expect(page.locator("#status")).to_have_text("Your story is ready.", timeout=WAIT_MS)

    expect(page.locator("#story-title")).to_have_text(HOSTILE_TITLE)
    story_text = page.inner_text("#story-text")
    assert 'The dragon drew <img src=x onerror="window.__pwned=1"> in the sand.' in story_text
    assert "<script>window.__pwned=2</script>" in story_text
    assert page.locator("#story img, #story script").count() == 0
    assert page.evaluate("window.__pwned") is None
    assert console_errors == []

    answer = httpx.get(f"{api.base_url}/")
    assert answer.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert "script-src 'self'" in CONTENT_SECURITY_POLICY and "default-src 'none'" in CONTENT_SECURITY_POLICY


LONG_STORY = (f"Title: {TITLE}\n"
              + "\n\n".join(f"Paragraph {n}: the small dragon counted star after star, and each star winked back "
                            "at her, slower and slower, as the night grew soft and quiet around the hill."
                            for n in range(1, 7))
              + " The end.")


def test_page_shows_the_story_growing_with_a_sign_and_switches_cleanly_to_the_final_text(
    system: System, fake_llm: FakeAnthropicServer, llm: dict[str, Any], database_url: str, browser: Browser,
) -> None:
    """While the story streams, the page shows its title and its words growing under a "Still being written"
    sign, asking only for the text after what it holds and revalidating with the last ETag (some polls are
    answered 304); once it is ready, the sign goes and the final text stands in the same place."""
    hold = threading.Event()
    fake_llm.fake.default = Plan(chunks=30, duration_s=8, text=LONG_STORY, hold=hold)
    api_key = create_key_sync(database_url, "page")
    api = system.api(DRAFT_INTERVAL_S=0.5)
    system.worker(**llm, HEARTBEAT_INTERVAL_S=0.5, HEARTBEAT_TIMEOUT_S=10, DRAFT_INTERVAL_S=0.5)
    console_errors: list[str] = []
    page = open_page(browser, f"{api.base_url}/", console_errors)
    polls: list[tuple[str, int]] = []

    def keep_poll(response: Response) -> None:
        if "/stories/jobs/" in response.url and response.request.method == "GET":
            polls.append((response.url, response.status))

    page.on("response", keep_poll)
    save_key(page, api_key)
    page.fill("#prompt", "a dragon who counts stars")
    page.click("#submit")
    sign = page.locator("#story-writing")
    expect(sign).to_be_visible(timeout=WAIT_MS)
    expect(sign).to_have_text("Still being written…")
    expect(page.locator("#story")).to_have_class(re.compile(r"\bwriting\b"))
    expect(page.locator("#story-title")).to_have_text(TITLE, timeout=WAIT_MS)
    first = page.locator("#story-text").inner_text()
    wait_until_sync(lambda: len(page.locator("#story-text").inner_text()) > len(first) + 100, timeout=30,
                    interval=0.2, what="the story to grow on the page")
    expect(page.locator("#status")).to_contain_text("% done")
    capture(page, "page-draft")
    # the whole text streamed, the end held back: nothing shown changes, and the polls are answered 304
    def answered_304() -> bool:
        page.wait_for_timeout(100)  # Playwright's events are delivered while it runs
        return any(status == 304 for _, status in polls)

    wait_until_sync(answered_304, timeout=30, interval=0.1, what="a poll answered 304")
    hold.set()
    expect(page.locator("#status")).to_have_text("Your story is ready.", timeout=WAIT_MS)
    expect(sign).to_be_hidden()
    expect(page.locator("#story")).not_to_have_class(re.compile(r"\bwriting\b"))
    expect(page.locator("#story-title")).to_have_text(TITLE)
    paragraphs = page.locator("#story-text p").all_inner_texts()
    assert paragraphs == [p.strip() for p in LONG_STORY.partition("\n")[2].split("\n\n")]
    capture(page, "page-draft-ready")
    # each poll asked from what the page held, and none failed (but the key's check, on a job that is none)
    job_polls = [(url, status) for url, status in polls if "since=" in url]
    assert any(re.search(r"since=[1-9]", url) for url, _ in job_polls), polls
    assert all(status in (200, 304) for _, status in job_polls), polls
    assert console_errors == []


def test_page_cancel_button_cancels_the_waiting_job(system: System, database_url: str, browser: Browser) -> None:
    """Cancel on a queued job makes it failed (cancelled) at the api, and the page says so and allows a new story."""
    api_key = create_key_sync(database_url, "page")
    api = system.api()
    console_errors: list[str] = []
    page = open_page(browser, f"{api.base_url}/", console_errors)

    save_key(page, api_key)
    page.fill("#prompt", "a dragon who can't sleep")
    page.click("#submit")
    expect(page.locator("#status")).to_contain_text("next in line", timeout=WAIT_MS)
    page.click("#cancel")

    expect(page.locator("#status")).to_have_text("Cancelled.", timeout=WAIT_MS)
    expect(page.locator("#cancel")).to_be_hidden()
    expect(page.locator("#submit")).to_be_enabled()
    assert [row[:2] for row in jobs_of(database_url)] == [("failed", "cancelled")]
    assert console_errors == []


def test_page_files_are_served_with_their_types_and_security_headers(system: System) -> None:
    """/, the scripts, the styles and the icon come with their content types, the CSP, nosniff and no-referrer."""
    api = system.api()
    expected_types = {
        "/": "text/html; charset=utf-8",
        "/static/app.js": "text/javascript; charset=utf-8",
        "/static/http.js": "text/javascript; charset=utf-8",
        "/static/base.css": "text/css; charset=utf-8",
        "/static/style.css": "text/css; charset=utf-8",
        "/static/icon.svg": "image/svg+xml",
    }
    with httpx.Client(base_url=api.base_url) as client:
        for path, content_type in expected_types.items():
            answer = client.get(path)
            assert answer.status_code == 200, path
            assert answer.headers["content-type"] == content_type, path
            assert answer.headers["content-security-policy"] == CONTENT_SECURITY_POLICY, path
            assert answer.headers["x-content-type-options"] == "nosniff", path
            assert answer.headers["referrer-policy"] == "no-referrer", path
        index = client.get("/").text
        assert 'name="viewport"' in index and "<script>" not in index and "<style" not in index
        assert client.get("/static/index.html").status_code == 404
        assert client.get("/static/..%2Fpage.py").status_code == 404
        assert "/" not in client.get("/schema/openapi.json").json()["paths"]


def test_page_offers_the_batch_lane_says_when_the_story_is_due_and_shows_it_when_its_batch_ends(
    system: System, database_url: str, browser: Browser,
) -> None:
    """"Tonight is fine" sends "lane": "batch": the page says the story waits for the next batch at half the
    price and when it is due at the latest (the api's due_by, in the parent's time), asks again only as often as
    the api's Retry-After says (above the page's own 5 s), and shows the story once its batch (the offline batch
    writer) has ended."""
    api_key = create_key_sync(database_url, "page")
    lane: dict[str, Any] = {"BATCH_COLLECT_S": 2, "BATCH_POLL_INTERVAL_S": 7, "OFFLINE_DELAY_S": 1}
    api = system.api(**lane)
    console_errors: list[str] = []
    page = open_page(browser, f"{api.base_url}/", console_errors)
    polls: list[float] = []
    page.on("request", lambda request: polls.append(time.monotonic())
            if request.method == "GET" and "/stories/jobs/" in request.url and "00000000-" not in request.url
            else None)

    save_key(page, api_key)
    page.fill("#prompt", "a whale who hums the tide to sleep")
    expect(page.locator("label", has=page.locator("#tonight"))).to_have_text(
        "Tonight is fine: within the day, half the price; usually within the hour")
    page.check("#tonight")
    capture(page, "page-batch-form")
    page.click("#submit")
    status = page.locator("#status")
    # no worker yet: the job waits for a batch
    expect(status).to_contain_text("Your story will be written with the next batch of stories, at half the price.",
                                   timeout=WAIT_MS)
    [(job_id, lane_, request_lane)] = query(database_url, "SELECT public_id::text, lane::text, request->>'lane' "
                                                          "FROM story_jobs")
    assert (lane_, request_lane) == ("batch", "batch")
    due_by = httpx.get(f"{api.base_url}/stories/jobs/{job_id}",
                       headers={"Authorization": f"Bearer {api_key}"}).json()["due_by"]
    due = page.evaluate("async (iso) => (await import('/static/app.js')).dueText(iso)", due_by)
    assert re.fullmatch(r"by \w{3} \d\d:\d\d( [AP]M)?", due), due
    expect(status).to_contain_text(f"It will be ready {due} at the latest, usually within the hour.")
    expect(page.locator("#progress")).to_be_hidden()
    expect(page.locator("#cancel")).to_be_visible()
    capture(page, "page-batch-waiting")

    system.worker(**lane)
    expect(page.locator("#story-title")).to_be_visible(timeout=WAIT_MS)
    expect(status).to_have_text("Your story is ready.")
    capture(page, "page-batch-story")
    assert query(database_url, "SELECT j.status::text, b.state FROM story_jobs j "
                               "JOIN message_batches b ON b.id = j.batch_id") == [("completed", "ended")]
    # the api asked for 7 s between polls of a batch job, more than an interactive job's 5 s at most
    gaps = [later - earlier for earlier, later in zip(polls, polls[1:], strict=False)]
    assert gaps and min(gaps) >= 6.8, gaps
    assert console_errors == []


def query(database_url: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        return conn.execute(sql).fetchall()
