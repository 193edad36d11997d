"""The household's page (``reachy-memory web``): its guards over plain HTTP, the command,
the daemon backend, and the page itself in a real browser (Debian's chromium via selenium).

Servers listen on 127.0.0.1 on an ephemeral port and are shut down by the fixtures."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC
from pathlib import Path
from typing import Any

import pytest

from reachy_memory import MemoryStore
from reachy_memory.web.backend import ClientBackend, StoreBackend
from reachy_memory.web.server import MAX_BODY, HouseholdServer, make_server
from tests import browser_util
from tests.daemon_util import ROOT, DaemonProcess

TOKEN = "household-test-token-0123456789abcdef"


@dataclass
class Page:
    server: HouseholdServer
    store: MemoryStore
    base: str

    @property
    def port(self) -> int:
        return self.server.port

    def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                raw: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
        """One request (nothing raised for an error status): status, headers, body."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            payload = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
            sent = {"Host": f"127.0.0.1:{self.port}", **(headers or {})}
            if payload is not None:
                sent.setdefault("Content-Type", "application/json")
            conn.request(method, path, body=payload, headers=sent)
            reply = conn.getresponse()
            return reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read()
        finally:
            conn.close()

    def cookie(self) -> str:
        status, headers, _ = self.request("GET", f"/?token={TOKEN}")
        assert status == 200
        return headers["set-cookie"].split(";", 1)[0]

    def csrf(self, cookie: str) -> str:
        status, _, body = self.request("GET", "/", headers={"Cookie": cookie})
        assert status == 200
        match = re.search(rb'name="csrf-token" content="([0-9a-f]+)"', body)
        assert match is not None
        return match.group(1).decode()

    def post(self, path: str, body: Any, **extra: str) -> tuple[int, dict[str, Any]]:
        cookie = self.cookie()
        headers = {"Cookie": cookie, "X-CSRF-Token": self.csrf(cookie), "Origin": self.base,
                   "Sec-Fetch-Site": "same-origin", **extra}
        status, _, reply = self.request("POST", path, body, headers={k: v for k, v in headers.items() if v})
        return status, json.loads(reply)


def serve(store: MemoryStore) -> tuple[HouseholdServer, threading.Thread]:
    server = make_server(StoreBackend(store, own=False), TOKEN, host="127.0.0.1", port=0, tz=UTC)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    return server, thread


@pytest.fixture
def page(store: MemoryStore) -> Iterator[Page]:
    server, thread = serve(store)
    try:
        yield Page(server, store, f"http://127.0.0.1:{server.port}")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def seed(store: MemoryStore) -> dict[str, str]:
    """A household's memory with unique markers; returns the ids the tests look at."""
    [wife] = store.remember("Sarah loves quokkamarker lasagne", subjects=["my wife Sarah"])
    store.update_person(store.find_person("Sarah").id, aliases=["Sare"])
    [dave] = store.remember("Dave is allergic to zebranut peanuts", subjects=["Dave"])
    [both] = store.remember("Dave and Sarah play tennis on Sundays", subjects=["Dave", "Sarah"])
    [bike] = store.remember("The blue bike in the garage is Dave's", subjects=[])
    said = store.record_turn("user", "My secret is the flamingo password", {"person": "Dave"})
    other = store.record_turn("user", "Dave is coming for dinner, cook something nice", {"person": "Alex"})
    return {"wife": wife.id, "dave": dave.id, "both": both.id, "bike": bike.id, "said": said.id, "other": other.id}


# -- the guards, over plain HTTP -------------------------------------------------------------------


def test_without_the_token_nothing_of_the_memory_is_served(page: Page) -> None:
    seed(page.store)
    status, _, body = page.request("GET", "/")
    assert status == 401 and b"quokkamarker" not in body and b"?token=" in body
    for path in ("/api/overview", "/api/search?q=lasagne", "/api/export", "/api/person?id=x"):
        status, _, body = page.request("GET", path)
        assert status == 401, path
        assert b"quokkamarker" not in body and b"Sarah" not in body
    status, _, body = page.request("GET", "/?token=not-the-token")
    assert status == 403 and b"not valid" in body
    status, _, body = page.request("GET", "/", headers={"Cookie": f"reachy_memory_{page.port}=forged"})
    assert status == 401


def test_the_login_link_sets_a_strict_httponly_cookie_and_leaves_the_token_behind(page: Page) -> None:
    status, headers, body = page.request("GET", f"/?token={TOKEN}")
    assert status == 200
    cookie = headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie
    assert TOKEN not in cookie
    assert headers["refresh"] == "0; url=/"  # on to the page, the token gone from the address
    assert headers["referrer-policy"] == "no-referrer" and headers["cache-control"] == "no-store"
    assert "script-src 'self'" in headers["content-security-policy"]
    status, _, body = page.request("GET", "/", headers={"Cookie": cookie.split(";", 1)[0]})
    assert status == 200 and b'type="search"' in body


def test_changes_need_the_csrf_token_the_page_origin_and_json(page: Page) -> None:
    ids = seed(page.store)
    cookie = page.cookie()
    csrf = page.csrf(cookie)
    body = {"id": ids["dave"]}
    refused = [
        ({"Cookie": cookie}, 403),  # no CSRF token
        ({"Cookie": cookie, "X-CSRF-Token": "0" * 64}, 403),
        ({"Cookie": cookie, "X-CSRF-Token": csrf, "Origin": "http://evil.example"}, 403),
        ({"Cookie": cookie, "X-CSRF-Token": csrf, "Sec-Fetch-Site": "cross-site"}, 403),
        ({"X-CSRF-Token": csrf}, 401),  # no session
    ]
    for headers, expected in refused:
        status, _, reply = page.request("POST", "/api/forget", body, headers=headers)
        assert status == expected, (headers, reply)
    status, _, _ = page.request("POST", "/api/forget", raw=b"id=x", headers={
        "Cookie": cookie, "X-CSRF-Token": csrf, "Content-Type": "application/x-www-form-urlencoded"})
    assert status == 415  # what a cross-site form can send
    status, _, _ = page.request("GET", f"/api/forget?id={ids['dave']}", headers={"Cookie": cookie})
    assert status == 404  # no change by GET
    assert page.store.get(ids["dave"]) is not None  # nothing was forgotten
    status, reply = page.post("/api/forget", body)
    assert status == 200 and reply == {"forgotten": ids["dave"]}
    assert page.store.get(ids["dave"]) is None
    status, reply = page.post("/api/forget", body)
    assert status == 404 and "gone already" in reply["error"]


def test_a_foreign_host_name_is_refused_on_loopback(page: Page) -> None:
    """A site rebinding its name to 127.0.0.1 sends its own Host: refused before anything else."""
    status, _, _ = page.request("GET", f"/?token={TOKEN}", headers={"Host": f"evil.example:{page.port}"})
    assert status == 421
    status, _, _ = page.request("GET", "/", headers={"Host": f"localhost:{page.port}"})
    assert status == 401  # a name of this host: served (the login screen)


def test_bad_input_gets_a_clear_error_and_requests_are_bounded(page: Page) -> None:
    seed(page.store)
    cookie = page.cookie()
    csrf = page.csrf(cookie)
    headers = {"Cookie": cookie, "X-CSRF-Token": csrf}
    status, _, reply = page.request("POST", "/api/forget", raw=b"{not json", headers=headers)
    assert status == 400 and "not JSON" in json.loads(reply)["error"]
    status, _, reply = page.request("POST", "/api/forget", {"id": 7}, headers=headers)
    assert status == 400 and "id must be" in json.loads(reply)["error"]
    status, _, reply = page.request("POST", "/api/pause", {"minutes": "soon"}, headers=headers)
    assert status == 400 and "minutes" in json.loads(reply)["error"]
    status, _, reply = page.request("POST", "/api/pause", {"minutes": 10**9}, headers=headers)
    assert status == 400
    status, _, reply = page.request("POST", "/api/forget", raw=b"x" * (MAX_BODY + 1), headers=headers)
    assert status == 413
    status, _, reply = page.request("GET", "/api/search?q=" + "a" * 600, headers=headers)
    assert status == 400 and "at most" in json.loads(reply)["error"]
    status, _, reply = page.request("GET", "/api/search?q=", headers=headers)
    assert status == 400
    status, _, _ = page.request("GET", "/static/../../etc/passwd", headers=headers)
    assert status == 404
    assert page.store.get_context_window()  # the store is untouched and serving


def test_overview_export_and_person_over_http(page: Page) -> None:
    ids = seed(page.store)
    cookie = page.cookie()
    status, _, body = page.request("GET", "/api/overview", headers={"Cookie": cookie})
    data = json.loads(body)
    sarah = next(p for p in data["people"] if p["name"] == "Sarah")
    assert sarah["relation"] == "wife" and sarah["aliases"] == ["Sare"]
    assert {f["id"] for f in sarah["facts"]} == {ids["wife"], ids["both"]}
    assert [f["id"] for f in data["facts"]] == [ids["bike"]]
    assert [t["id"] for t in data["days"][0]["turns"]] == [ids["said"], ids["other"]]
    assert data["remembering"]["paused"] is False
    status, headers, body = page.request("GET", "/api/export", headers={"Cookie": cookie})
    assert status == 200 and "attachment" in headers["content-disposition"]
    lines = [json.loads(line) for line in body.decode().splitlines()]
    assert {e["id"] for e in lines if e.get("kind") != "person"} == set(ids.values())
    assert {e["name"] for e in lines if e.get("kind") == "person"} == {"Sarah", "Dave"}
    dave = page.store.find_person("Dave")
    status, _, body = page.request("GET", f"/api/person?id={dave.id}", headers={"Cookie": cookie})
    about = json.loads(body)
    assert about["person"]["name"] == "Dave" and [m["id"] for m in about["memories"]] == [ids["dave"]]


# -- the command, and the daemon behind the page ---------------------------------------------------


def _read_link(proc: subprocess.Popen[str], deadline: float) -> str:
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "?token=" in line:
            return line.strip()
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"no login link printed (exit {proc.poll()}): {proc.stderr.read() if proc.stderr else ''}")


def test_the_web_command_makes_a_private_token_file_and_prints_the_login_link(tmp_path: Path) -> None:
    token_file = tmp_path / "secret" / "web.token"
    token_file.parent.mkdir(mode=0o700)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("REACHY_MEMORY_ENDPOINT", None)
    with MemoryStore(tmp_path / "data", embedder=None) as store:
        store.remember("The cat is called Pixelmarker", subjects=[])
    proc = subprocess.Popen([sys.executable, "-m", "reachy_memory.cli", "web", "--data-dir", str(tmp_path / "data"),
                             "--port", "0", "--token-file", str(token_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        link = _read_link(proc, time.monotonic() + 60)
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        match = re.fullmatch(r"http://127\.0\.0\.1:(\d+)/\?token=(\S+)", link)
        assert match is not None and match.group(2) == token
        conn = http.client.HTTPConnection("127.0.0.1", int(match.group(1)), timeout=10)
        conn.request("GET", f"/?token={token}")
        reply = conn.getresponse()
        cookie = reply.getheader("Set-Cookie").split(";", 1)[0]
        reply.read()
        conn.request("GET", "/api/overview", headers={"Cookie": cookie})
        data = json.loads(conn.getresponse().read())
        conn.close()
        assert [f["text"] for f in data["facts"]] == ["The cat is called Pixelmarker"]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0  # stops on SIGTERM, cleanly


def test_the_page_on_the_daemon(tmp_path: Path) -> None:
    """``--endpoint``: the same page through a MemoryClient to a real daemon process."""
    with DaemonProcess(tmp_path, embedding={"enabled": False}) as daemon:
        with daemon.client() as client:
            client.remember("Grandpa Joe fixes clocks", subjects=["Grandpa Joe"])
            client.record_turn("user", "Joe told me a secret about the moonmarker", {"person": "Grandpa Joe"})
        with daemon.client() as client:
            backend = ClientBackend(client, own=False)
            server = make_server(backend, TOKEN, port=0, tz=UTC)
            thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
            thread.start()
            try:
                page = Page(server, None, f"http://127.0.0.1:{server.port}")  # type: ignore[arg-type]
                status, _, body = page.request("GET", "/api/overview", headers={"Cookie": page.cookie()})
                data = json.loads(body)
                assert [p["name"] for p in data["people"]] == ["Grandpa Joe"]
                status, plan = page.post("/api/forget-person", {"id": data["people"][0]["id"], "dry_run": True})
                assert status == 200 and plan["memories_deleted"] == 1 and plan["turns_deleted"] == 1
                status, reply = page.post("/api/pause", {"minutes": 5})
                assert status == 200 and reply["paused"] is True
                assert client.health()["remembering"]["paused"] is True
                status, done = page.post("/api/forget-person", {"id": data["people"][0]["id"]})
                assert status == 200 and done["dry_run"] is False
                assert client.people() == [] and client.export_page()[0] == []
                status, reply = page.post("/api/resume", {})
                assert reply["paused"] is False
            finally:
                server.shutdown()
                server.server_close()
                thread.join(timeout=5)


# -- in a real browser -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    reason = browser_util.missing()
    if reason is not None:
        pytest.skip(reason)
    with browser_util.chromium() as driver:
        yield driver


def _wait(driver: Any, condition: Any, timeout: float = 10.0) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(condition)


def _texts(driver: Any, css: str) -> list[str]:
    """The shown texts of the elements ``css`` selects, read at one moment (the page re-renders)."""
    return driver.execute_script(  # type: ignore[no-any-return]
        "return [...document.querySelectorAll(arguments[0])].map(e => e.innerText.trim())", css)


def _click(driver: Any, element: Any) -> None:
    """Click ``element`` as a person would: scrolled to the middle of the screen first (the
    sticky header covers what the driver scrolls to the top)."""
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", element)
    element.click()


def _confirm(driver: Any, choice: str) -> str:
    """The confirmation dialog's text, after choosing ``choice`` ("yes" forgets, "no" keeps)."""
    from selenium.webdriver.common.by import By

    dialog = _wait(driver, lambda d: d.find_element(By.ID, "confirm") if d.find_element(By.ID, "confirm")
                   .get_attribute("open") is not None else False)
    text = dialog.find_element(By.ID, "confirm-text").text
    _click(driver, driver.find_element(By.ID, f"confirm-{choice}"))
    _wait(driver, lambda d: d.find_element(By.ID, "confirm").get_attribute("open") is None)
    return text


def test_the_household_page_in_a_browser(browser: Any, page: Page) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    ids = seed(page.store)
    driver = browser
    driver.delete_all_cookies()
    driver.get(f"{page.base}/?token={TOKEN}")  # the login link
    _wait(driver, lambda d: d.current_url == f"{page.base}/" and _texts(d, ".person h3"))
    assert "token" not in driver.current_url
    cookie = driver.get_cookie(f"reachy_memory_{page.port}")
    assert cookie["httpOnly"] is True and cookie["sameSite"] == "Strict"

    # the lists: people with aliases and facts, other facts, conversations by day
    assert _texts(driver, ".person h3") == ["Dave", "Sarah"]
    assert "Also called Sare" in _texts(driver, ".person .aliases")
    assert any("quokkamarker" in t for t in _texts(driver, ".person .memory .text"))
    assert any("blue bike" in t for t in _texts(driver, "#facts-list .text"))
    assert _texts(driver, ".day h3") == ["TODAY"]
    assert any("flamingo" in t for t in _texts(driver, "#days .text"))
    assert driver.find_element(By.ID, "status").text == "Remembering"

    # search
    box = driver.find_element(By.ID, "search")
    assert box.get_attribute("type") == "search"
    box.send_keys("lasagne", Keys.ENTER)
    _wait(driver, lambda d: d.find_element(By.ID, "results").is_displayed())
    assert any("quokkamarker" in t for t in _texts(driver, "#results-list .text"))

    # Forget, with confirmation: "Keep" keeps it, "Forget" forgets it
    forget = f'#facts-list button.forget[data-id="{ids["bike"]}"]'
    _click(driver, driver.find_element(By.CSS_SELECTOR, forget))
    assert "blue bike" in _confirm(driver, "no")
    assert page.store.get(ids["bike"]) is not None and driver.find_elements(By.CSS_SELECTOR, forget)
    _click(driver, driver.find_element(By.CSS_SELECTOR, forget))
    _confirm(driver, "yes")
    _wait(driver, lambda d: not d.find_elements(By.CSS_SELECTOR, forget))
    assert page.store.get(ids["bike"]) is None

    # forget a person: the dialog says what goes, then it goes
    dave = page.store.find_person("Dave")
    button = f'.person[data-id="{dave.id}"] button.forget-person'
    _click(driver, driver.find_element(By.CSS_SELECTOR, button))
    said = _confirm(driver, "yes")
    assert "Dave" in said and "1 memory about them" in said and "1 conversation turn" in said
    _wait(driver, lambda d: _texts(d, ".person h3") == ["Sarah"])
    assert page.store.find_person("Dave") is None
    assert page.store.get(ids["dave"]) is None and page.store.get(ids["said"]) is None
    assert "Dave" not in page.store.get(ids["both"]).content  # kept about Sarah, his name removed
    assert not any("flamingo" in t for t in _texts(driver, "#days .text"))

    # pause: shown, and a turn said meanwhile is not kept
    _click(driver, driver.find_element(By.ID, "pause"))
    _wait(driver, lambda d: d.find_element(By.ID, "status").text.startswith("Not remembering until"))
    assert page.store.remembering()["paused"] is True
    turn = page.store.record_turn("user", "The guest's wifi code is toucan42")
    assert page.store.get(turn.id) is None
    assert any(t["content"] == "The guest's wifi code is toucan42" for t in page.store.get_context_window())
    _click(driver, driver.find_element(By.ID, "resume"))
    _wait(driver, lambda d: d.find_element(By.ID, "status").text == "Remembering")
    assert page.store.remembering()["paused"] is False
    assert not driver.get_log("browser") or all(e["level"] != "SEVERE" for e in driver.get_log("browser"))
