"""Real headless Chromium for the dashboard tests (Playwright driving the system's /usr/bin/chromium).

When Chromium or Playwright is missing the tests that need them are *skipped with the reason*
(``make test`` installs both as root on Debian: ``apt-get install -y chromium``, ``pip install
playwright``); they never pass without a browser.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.support.services import ROOT

CHROMIUM = os.environ.get("RELAY_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = ROOT / "test-artifacts"


def chromium_or_skip() -> str:
    path = CHROMIUM if Path(CHROMIUM).is_file() else shutil.which("chromium")
    if not path:
        pytest.skip(
            f"no Chromium at {CHROMIUM}: the browser test needs it (`apt-get install -y chromium`; "
            f"`make test` installs it when run as root)"
        )
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("the playwright package is not installed (`pip install -e '.[test]'` installs it)")
    return path


@pytest.fixture(scope="module")
def browser():
    path = chromium_or_skip()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=ARGS, headless=True)
        yield b
        b.close()


def screenshot(page, name: str) -> Path:
    """Save a full-page screenshot under test-artifacts/ (git-ignored) and return its path."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=True)
    return path
