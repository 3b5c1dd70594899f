"""A real browser for the chat page's tests: Debian's `chromium` driven by Python playwright.

Playwright's own browser download is not used (and not reachable): the system executable is launched with the
flags a locked-down CI machine needs. Screenshots go to $KESTREL_SCREENSHOT_DIR (default tests/artifacts/webui);
the paths are listed at the end of the pytest run (tests/conftest.py prints SCREENSHOTS).
"""
from __future__ import annotations

import os
import shutil

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOTS: list[str] = []   # every screenshot this run saved


def screenshot_dir() -> str:
    d = os.environ.get("KESTREL_SCREENSHOT_DIR") or os.path.join(REPO, "tests", "artifacts", "webui")
    os.makedirs(d, exist_ok=True)
    return d


def save_screenshot(page, name: str) -> str:
    path = os.path.join(screenshot_dir(), name + ".png")
    page.screenshot(path=path)
    SCREENSHOTS.append(path)
    return path


def launch(playwright, extra_args: tuple[str, ...] = ()):
    """Chromium; `extra_args` such as --host-resolver-rules="MAP name 127.0.0.1" (a name for a loopback server:
    the tests' stand-in for DNS, rebinding included)."""
    assert os.path.exists(CHROMIUM), "chromium is not installed (scripts/test.sh installs the Debian package)"
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS + list(extra_args))
