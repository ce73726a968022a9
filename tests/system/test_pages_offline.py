"""Every page the api serves, loaded in Debian's headless Chromium with the
network to anything but 127.0.0.1 cut: each one renders from what the package
ships, no request leaves the machine, and no Content-Security-Policy
violation is reported. The API documentation pages are off unless asked for."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from playwright.sync_api import Browser, Page, Route, expect, sync_playwright

from shared import keys
from tests.support import ops_seed as seed
from tests.support.database import create_key_sync
from tests.system.procs import ApiProc, System

pytestmark = pytest.mark.system

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
WAIT_MS = 60_000
# each violation the page reports, kept where the test can read it
RECORD_VIOLATIONS = """
window.__violations = [];
document.addEventListener("securitypolicyviolation", (event) => {
  window.__violations.push(`${event.violatedDirective} ${event.blockedURI}`);
});
"""


@pytest.fixture
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.skip("no /usr/bin/chromium: install Debian's chromium package (.ci/run does)")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield launched
        launched.close()


class OfflinePage:
    """A page whose requests to anything but 127.0.0.1 are aborted and recorded, with the CSP violations and
    console messages it reports."""

    def __init__(self, browser: Browser) -> None:
        self.outside: list[str] = []
        self.console: list[str] = []
        context = browser.new_context()
        context.route("**/*", self._route)
        context.add_init_script(RECORD_VIOLATIONS)
        self.page: Page = context.new_page()
        self.page.on("console", lambda message: self.console.append(f"{message.type}: {message.text}"))
        self.page.on("pageerror", lambda error: self.console.append(f"pageerror: {error}"))

    def _route(self, route: Route) -> None:
        url = route.request.url
        if urlsplit(url).hostname == "127.0.0.1" or url.startswith(("data:", "blob:")):
            route.continue_()
        else:
            self.outside.append(url)
            route.abort()

    def violations(self) -> list[str]:
        found: list[str] = self.page.evaluate("window.__violations")
        return found + [line for line in self.console if "Content Security Policy" in line]


def _check(offline: OfflinePage) -> None:
    offline.page.wait_for_load_state("networkidle")
    assert offline.outside == []
    assert offline.violations() == []


@pytest.fixture
def api(system: System) -> ApiProc:
    return system.api(API_DOCS_PAGES="true")


@pytest.mark.parametrize(("path", "rendered"), [
    ("/schema/swagger", ".swagger-ui .info .title"),
    ("/schema/redoc", "h1:has-text('storyjobs')"),
    ("/schema/rapidoc", "rapi-doc >> text=storyjobs"),
])
def test_a_documentation_page_renders_from_shipped_files_alone(
    api: ApiProc, browser: Browser, path: str, rendered: str
) -> None:
    """The viewer renders the api's document, with nothing requested from another origin and no CSP
    violation."""
    offline = OfflinePage(browser)
    offline.page.goto(api.base_url + path)
    expect(offline.page.locator(rendered).first).to_be_visible(timeout=WAIT_MS)
    _check(offline)


def test_the_parents_page_and_the_console_load_offline_and_keep_keys_for_the_tab(
    api: ApiProc, database_url: str, browser: Browser
) -> None:
    """The parents' page and the console, keys entered without "keep", load nothing from elsewhere, report no
    CSP violation, keep their keys in sessionStorage only, and the console shows the operators' recent
    actions."""
    client_key = create_key_sync(database_url, "parent")

    async def operator(conn: Any) -> tuple[str, int]:
        acme, _ = await seed.client(conn, "acme")
        return await seed.operator_key(conn, "ada"), acme

    operator_key, acme = seed.seeded(database_url, operator)
    with httpx.Client(base_url=api.base_url) as client:
        revoked = client.post(f"/ops/api/clients/{acme}/revoke-keys",
                              headers={"Authorization": f"Bearer {operator_key}"})
        assert revoked.status_code == 200, revoked.text

    parents = OfflinePage(browser)
    parents.page.goto(api.base_url + "/")
    parents.page.fill("#api-key", client_key)
    parents.page.click("#key-form button[type=submit]")
    expect(parents.page.locator("#key-saved")).to_be_visible(timeout=WAIT_MS)
    assert parents.page.evaluate("[sessionStorage.getItem('storyjobs.apiKey'), localStorage.length]") == [
        client_key, 0]
    _check(parents)

    console = OfflinePage(browser)
    console.page.goto(api.base_url + "/ops/")
    console.page.fill("#key-input", operator_key)
    console.page.click("#key-form button[type=submit]")
    expect(console.page.locator("#overview-screen")).to_be_visible(timeout=WAIT_MS)
    assert console.page.evaluate("[sessionStorage.getItem('storyjobs.operatorKey'), localStorage.length]") == [
        operator_key, 0]
    console.page.goto(api.base_url + "/ops/#/clients")
    # the clients' rows render above the log: clicked before they land, the
    # click can meet the row that moved under it instead of the summary
    expect(console.page.locator("#clients-rows tr", has_text="acme")).to_be_visible(timeout=WAIT_MS)
    console.page.click("#actions-log summary")
    expect(console.page.locator("#actions-log")).to_have_attribute("open", "")
    row = console.page.locator("#actions-rows tr").first
    expect(row).to_contain_text("client_keys_revoke", timeout=WAIT_MS)
    expect(row).to_contain_text(f"ada ({keys.prefix_of(operator_key)})")
    _check(console)


def test_the_documentation_pages_are_off_unless_asked_for(system: System) -> None:
    """Without API_DOCS_PAGES the pages and their files are 404; the OpenAPI document is still served."""
    api = system.api()
    with httpx.Client(base_url=api.base_url) as client:
        for path in ("/schema/swagger", "/schema/redoc", "/schema/rapidoc", "/schema/elements",
                     "/schema/assets/swagger-ui-bundle.js"):
            assert client.get(path).status_code == 404, path
        assert client.get("/schema/openapi.json").status_code == 200


def test_the_cancel_by_filter_dialog_names_the_filter_it_sends_not_the_forms_selection(
    api: ApiProc, database_url: str, browser: Browser
) -> None:
    """Jobs filtered by client acme, then globex chosen in the form without filtering again: the confirmation
    names acme, whose pending jobs the cancel would send, and the count is acme's."""

    async def history(conn: Any) -> str:
        acme, _ = await seed.client(conn, "acme")
        globex, _ = await seed.client(conn, "globex")
        await seed.insert_jobs(conn, [seed.pending(acme, 30), seed.pending(globex, 20), seed.pending(acme, 10)])
        return await seed.operator_key(conn, "ada")

    key = seed.seeded(database_url, history)
    console = OfflinePage(browser)
    page = console.page
    page.goto(api.base_url + "/ops/")
    page.fill("#key-input", key)
    page.click("#key-form button[type=submit]")
    expect(page.locator("#overview-screen")).to_be_visible(timeout=WAIT_MS)
    page.goto(api.base_url + "/ops/#/jobs")
    page.locator("#f-client").select_option(label="acme")
    page.click("#filters button[type=submit]")
    expect(page.locator("#jobs-rows tr")).to_have_count(2, timeout=WAIT_MS)
    page.locator("#f-client").select_option(label="globex")
    page.click("#cancel-matching")
    expect(page.locator("#confirm-text")).to_have_text(
        "Cancel 2 pending jobs of client acme? Jobs that arrive from now on are not affected.", timeout=WAIT_MS)
    page.click("#confirm-no")
    _check(console)
