"""Screenshots of the pages, written by the browser tests so that a change to
the pages can be looked at: test-output/screens/<name>.png (docs/pages.md)."""

from __future__ import annotations

from playwright.sync_api import Page

from tests.system.procs import REPO

SCREENS = REPO / "test-output" / "screens"


def capture(page: Page, name: str) -> None:
    """The whole page as it stands, as test-output/screens/<name>.png."""
    SCREENS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENS / f"{name}.png"), full_page=True)
