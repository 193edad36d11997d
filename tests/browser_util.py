"""A real browser for the household page's tests: Debian's chromium, driven by selenium.

:func:`chromium` starts a headless Chromium with a fresh profile, at a phone's size by
default; :func:`missing` says why none can be started (the tests skip with that reason).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

PHONE = (390, 844)  # CSS pixels: a common phone
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage")


def _binary() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def missing() -> str | None:
    """Why no browser can be driven here (None: one can)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install 'reachy-memory[test]')"
    if _binary() is None:
        return "chromium is not installed (apt-get install chromium chromium-driver)"
    if shutil.which("chromedriver") is None:
        return "chromedriver is not installed (apt-get install chromium-driver)"
    return None


@contextmanager
def chromium(size: tuple[int, int] = PHONE) -> Iterator[Any]:
    """A headless Chromium (selenium WebDriver) with a fresh profile, its viewport ``size``
    CSS pixels (a phone's: touch, mobile layout); quit and its profile removed on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="reachy-memory-chromium-")
    options = webdriver.ChromeOptions()
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.binary_location = _binary() or "chromium"
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    try:
        driver.set_page_load_timeout(30)
        driver.set_script_timeout(30)
        width, height = size
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                               {"width": width, "height": height, "deviceScaleFactor": 2, "mobile": True})
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
