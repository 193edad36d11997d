"""Screenshot of the household page on a phone-sized screen: docs/household-page.png.

Opens a store with an example household in a temporary directory (lexical-only: no model
needed), serves the page on 127.0.0.1 (an ephemeral port), logs a headless Chromium in with
the login link and saves the page as a 390x844 phone shows it (2x pixels).

    python -m tools.web_screenshot [OUT.png]
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from datetime import UTC
from pathlib import Path

from reachy_memory import MemoryStore
from reachy_memory.web.backend import StoreBackend
from reachy_memory.web.server import make_server
from tests import browser_util

OUT = Path(__file__).resolve().parents[1] / "docs" / "household-page.png"
TOKEN = "screenshot-token-0123456789abcdef"


def example(store: MemoryStore) -> None:
    """A small household: a wife, a grandmother, a neighbour, a few turns."""
    store.remember("Sarah loves Italian food, lasagne most of all", subjects=["my wife Sarah"])
    store.update_person(store.find_person("Sarah").id, aliases=["Sare"])
    store.remember("Sarah's birthday is on 12 March", subjects=["Sarah"])
    store.remember("Grandma Rose takes her tea with honey", subjects=["Grandma Rose"])
    store.remember("Dave from next door is allergic to peanuts", subjects=["Dave"])
    store.remember("The recycling goes out on Tuesday evenings", subjects=[])
    store.record_turn("user", "Dave is coming for dinner on Friday", {"person": "Alex"})
    store.record_turn("assistant", "Noted! Remember that Dave is allergic to peanuts.")


def main(out: Path = OUT) -> None:
    if (reason := browser_util.missing()) is not None:
        sys.exit(f"no browser: {reason}")
    with tempfile.TemporaryDirectory() as tmp, MemoryStore(Path(tmp) / "data", embedder=None) as store:
        example(store)
        server = make_server(StoreBackend(store, own=False), TOKEN, port=0, tz=UTC)
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        try:
            with browser_util.chromium() as driver:
                driver.get(f"http://127.0.0.1:{server.port}/?token={TOKEN}")
                deadline = time.monotonic() + 15
                while not driver.execute_script("return document.querySelectorAll('.person').length"):
                    if time.monotonic() > deadline:
                        sys.exit("the page did not load")
                    time.sleep(0.1)
                driver.save_screenshot(str(out))
        finally:
            server.shutdown()
            server.server_close()
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
