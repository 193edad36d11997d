"""The memory app's settings page (:mod:`reachy_memory.integrations.memory_app`): routes on
the app's FastAPI server, which reachy-mini's ``ReachyMiniApp`` runs at ``custom_app_url``.

No ``from __future__ import annotations`` here: FastAPI reads the handlers' annotations.
"""

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse

if TYPE_CHECKING:
    from reachy_memory.integrations.memory_app import MemoryApp


def add_routes(web: FastAPI, app: "MemoryApp") -> None:
    """The settings page: ``GET /`` (the page), ``GET /status``, ``POST /heard``
    ``{"text": ..., "person": ...}``, ``POST /person`` ``{"name": ...}`` (null: nobody)."""
    async def body(request: Request, field: str, required: bool) -> Any:
        try:
            data = await request.json()
        except ValueError:
            data = None
        value = data.get(field) if isinstance(data, dict) else None
        if (required and not value) or (value is not None and not isinstance(value, str)):
            raise HTTPException(400, f"expected a JSON object with a string {field!r}")
        return value

    @web.get("/", response_class=HTMLResponse)
    async def page() -> str:
        return _PAGE

    @web.get("/status")
    async def status() -> dict[str, Any]:
        return app.status()

    @web.post("/heard")
    async def heard(request: Request) -> dict[str, bool]:
        text = await body(request, "text", True)
        app.hear(text, await body(request, "person", False))
        return {"queued": True}

    @web.post("/person")
    async def person(request: Request) -> dict[str, bool]:
        app.set_person(await body(request, "name", False))
        return {"queued": True}


_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><meta name="viewport" content="width=device-width">
<title>Reachy memory</title>
<style>body{font-family:sans-serif;max-width:40em;margin:2em auto;padding:0 1em}
input{width:70%}pre{background:#f4f4f4;padding:1em}</style></head>
<body><h1>Reachy memory</h1>
<p>Memory daemon: <b id="daemon">...</b>. In front of the robot: <b id="person">nobody</b>.</p>
<form id="heard"><label>Someone said: <input id="text" maxlength="2000" autocomplete="off"></label>
<button>Tell Reachy</button></form>
<form id="who"><label>Who is there: <input id="name" autocomplete="off"></label><button>Set</button></form>
<pre id="counters"></pre>
<script>
async function post(path, data) {
  await fetch(path, {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(data)});
}
document.getElementById("heard").onsubmit = async (e) => {
  e.preventDefault(); const t = document.getElementById("text");
  if (t.value) { await post("heard", {text: t.value}); t.value = ""; }
};
document.getElementById("who").onsubmit = async (e) => {
  e.preventDefault(); await post("person", {name: document.getElementById("name").value || null});
};
async function refresh() {
  try {
    const s = await (await fetch("status")).json();
    document.getElementById("daemon").textContent = s.memory_daemon;
    document.getElementById("person").textContent = s.person || "nobody";
    document.getElementById("counters").textContent = JSON.stringify(s, null, 1);
  } catch (e) { document.getElementById("daemon").textContent = "the app is not answering"; }
}
refresh(); setInterval(refresh, 1000);
</script></body></html>
"""
