"""The page at GET /, driven in a real headless Chromium against the real processes.

Playwright's own browser download does not work here; Debian's chromium does
(.ci/run installs it). Playwright's sync API cannot run inside an event loop,
so these tests are plain sync tests.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, expect, sync_playwright

from api.page import CONTENT_SECURITY_POLICY
from tests.fakes.anthropic_server import FakeAnthropicServer, Plan
from tests.helpers import create_key_sync
from tests.system.procs import REPO, System

pytestmark = pytest.mark.system

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
# a poll may wait a few seconds, and the machine is shared: be generous
WAIT_MS = 60_000

TITLE = "The Dragon Who Counted Stars"
STORY = (f"Title: {TITLE}\n"
         "Once upon a time a small dragon named Ember could not sleep.\n\n"
         "She counted the stars, one by one, until her eyes grew heavy. The end.")
HOSTILE_TITLE = 'The <img src=x onerror="window.__pwned=3"> Dragon'
HOSTILE_STORY = (f"Title: {HOSTILE_TITLE}\n"
                 'The dragon drew <img src=x onerror="window.__pwned=1"> in the sand.\n\n'
                 "Then she wrote <script>window.__pwned=2</script> and fell asleep.")


@pytest.fixture
def browser() -> Iterator[Browser]:
    """Debian's headless Chromium, through Playwright."""
    if not CHROMIUM.exists():
        pytest.skip("no /usr/bin/chromium: install Debian's chromium package (.ci/run does) to test the page")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture
def llm(fake_llm: FakeAnthropicServer) -> dict[str, Any]:
    """The worker environment that points the SDK at the fake provider."""
    return {"ANTHROPIC_API_KEY": "test", "ANTHROPIC_BASE_URL": fake_llm.base_url}


def open_page(browser: Browser, url: str, console_errors: list[str]) -> Page:
    # a phone's screen: the page is made for reading in bed
    context = browser.new_context(viewport={"width": 390, "height": 844}, device_scale_factor=2, is_mobile=True,
                                  has_touch=True)
    page = context.new_page()

    def keep_error(message: ConsoleMessage) -> None:
        if message.type == "error":
            console_errors.append(message.text)

    page.on("console", keep_error)
    page.on("pageerror", lambda error: console_errors.append(str(error)))
    page.goto(url)
    return page


def save_key(page: Page, api_key: str) -> None:
    page.fill("#api-key", api_key)
    page.click("#key-form button[type=submit]")
    expect(page.locator("#key-saved")).to_be_visible()


def test_page_follows_a_story_from_the_queue_to_its_text(
    system: System, fake_llm: FakeAnthropicServer, llm: dict[str, Any], database_url: str, tmp_path: Path,
    browser: Browser,
) -> None:
    """A parent saves the key, asks for a story, sees its place in the queue, then tokens written, then the story."""
    hold = threading.Event()
    fake_llm.fake.default = Plan(chunks=4, text=STORY, hold=hold)
    api_key = create_key_sync(database_url, "page")
    api = system.api()
    console_errors: list[str] = []
    page = open_page(browser, f"{api.base_url}/", console_errors)
    status = page.locator("#status")

    save_key(page, api_key)
    page.fill("#prompt", "a dragon who can't sleep")
    page.fill("#child-name", "Mia")
    page.select_option("#age", "5")
    page.select_option("#length", "short")
    page.click("#submit")
    # no worker yet: the job waits its turn
    expect(status).to_contain_text("Waiting in line: position 1", timeout=WAIT_MS)
    expect(page.locator("#cancel")).to_be_visible()

    system.worker(**llm, HEARTBEAT_INTERVAL_S=0.5, HEARTBEAT_TIMEOUT_S=10)
    expect(status).to_contain_text("tokens so far", timeout=WAIT_MS)
    hold.set()
    expect(page.locator("#story-title")).to_have_text(TITLE, timeout=WAIT_MS)
    expect(status).to_have_text("The story is ready.")
    expect(page.locator("#story-text p")).to_have_text([
        "Once upon a time a small dragon named Ember could not sleep.",
        "She counted the stars, one by one, until her eyes grew heavy. The end.",
    ])
    expect(page.locator("#submit")).to_be_enabled()

    screenshot = tmp_path / "page.png"
    page.screenshot(path=str(screenshot), full_page=True)
    (REPO / "test-output").mkdir(exist_ok=True)
    shutil.copyfile(screenshot, REPO / "test-output" / "page.png")

    # kept for this tab only: the parent did not ask to keep it on this device
    assert page.evaluate("sessionStorage.getItem('storyjobs.apiKey')") == api_key
    assert page.evaluate("localStorage.getItem('storyjobs.apiKey')") is None
    [call] = fake_llm.fake.billed
    assert "Mia" in call.prompt and "5 years old" in call.prompt
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert conn.execute("SELECT status::text FROM story_jobs").fetchall() == [("completed",)]
    # a Content-Security-Policy violation or a script error would show here
    assert console_errors == []


def test_page_shows_markup_in_a_story_as_text_and_runs_none_of_it(
    system: System, fake_llm: FakeAnthropicServer, llm: dict[str, Any], database_url: str, tmp_path: Path,
    browser: Browser,
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
    expect(page.locator("#status")).to_have_text("The story is ready.", timeout=WAIT_MS)

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


def test_page_cancel_button_cancels_the_waiting_job(system: System, database_url: str, browser: Browser) -> None:
    """Cancel on a queued job makes it failed (cancelled) at the api, and the page says so and allows a new story."""
    api_key = create_key_sync(database_url, "page")
    api = system.api()
    console_errors: list[str] = []
    page = open_page(browser, f"{api.base_url}/", console_errors)

    save_key(page, api_key)
    page.fill("#prompt", "a dragon who can't sleep")
    page.click("#submit")
    expect(page.locator("#status")).to_contain_text("Waiting in line", timeout=WAIT_MS)
    page.click("#cancel")

    expect(page.locator("#status")).to_have_text("Cancelled.", timeout=WAIT_MS)
    expect(page.locator("#cancel")).to_be_hidden()
    expect(page.locator("#submit")).to_be_enabled()
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert conn.execute("SELECT status::text, error_code FROM story_jobs").fetchall() == [("failed", "cancelled")]
    assert console_errors == []


def test_page_shows_why_a_story_could_not_be_written(
    system: System, fake_llm: FakeAnthropicServer, llm: dict[str, Any], database_url: str, browser: Browser,
) -> None:
    """A job that fails shows its error message and code instead of a story."""
    fake_llm.fake.default = Plan(status=400)
    api_key = create_key_sync(database_url, "page")
    api = system.api()
    system.worker(**llm)
    console_errors: list[str] = []
    page = open_page(browser, f"{api.base_url}/", console_errors)

    save_key(page, api_key)
    page.fill("#prompt", "a dragon who can't sleep")
    page.click("#submit")

    expect(page.locator("#status")).to_have_text("The story could not be written.", timeout=WAIT_MS)
    with psycopg.connect(database_url, autocommit=True) as conn:
        [(error_text,)] = conn.execute("SELECT error_text FROM story_jobs WHERE error_code = 'llm_rejected'").fetchall()
    expect(page.locator("#error")).to_have_text(f"{error_text} (llm_rejected)")
    expect(page.locator("#story")).to_be_hidden()
    assert console_errors == []


def test_page_files_are_served_with_their_types_and_security_headers(system: System) -> None:
    """/, the script, the styles and the icon come with their content types, the CSP, nosniff and no-referrer."""
    api = system.api()
    expected_types = {
        "/": "text/html; charset=utf-8",
        "/static/app.js": "text/javascript; charset=utf-8",
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
