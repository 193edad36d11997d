"""The operations table (``daemon/operations.py``) is the one source of the protocol surface:
the server, both clients and the generated reference must not drift from it."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest

from reachy_memory import ValidationError
from reachy_memory import client as client_module
from reachy_memory.daemon.handlers import HANDLERS
from reachy_memory.daemon.operations import OPERATIONS, check_args, protocol_doc

ROOT = Path(__file__).resolve().parents[1]


def test_every_operation_has_a_server_handler_and_nothing_else_does() -> None:
    assert set(HANDLERS) == set(OPERATIONS)


def test_every_operation_has_a_client_method_and_every_client_method_an_operation() -> None:
    methods = inspect.getmembers(client_module._Api, inspect.isfunction)
    public = {name for name, _ in methods if not name.startswith("_")}
    wanted = {op.client_method for op in OPERATIONS.values()}
    assert wanted <= public, f"operations without a client method: {sorted(wanted - public)}"
    assert public <= wanted, f"client methods without an operation: {sorted(public - wanted)}"


def test_the_protocol_reference_is_generated_from_the_table() -> None:
    on_disk = (ROOT / "docs" / "PROTOCOL.md").read_text()
    assert on_disk == protocol_doc(), "run: python -m reachy_memory.daemon.operations > docs/PROTOCOL.md"


def test_every_lane_is_known() -> None:
    assert {op.lane for op in OPERATIONS.values()} <= {"inline", "embed", "engine", "background"}
    assert OPERATIONS["ping"].lane == "inline" and OPERATIONS["search"].lane == "embed"
    assert OPERATIONS["backup"].lane == "background"  # a backup of 100k memories must not stop the engine


@pytest.mark.parametrize(("op", "args", "field"), [
    ("get", {}, "id"),  # a required argument missing
    ("get", {"id": 3}, "id"),  # wrong type
    ("get", {"id": "a", "extra": 1}, "args"),  # an unknown argument
    ("get", {1: "a"}, "args"),  # a non-string key
    ("search", {"query": "q", "limit": True}, "limit"),  # a bool is not an int
    ("search", {"query": "q", "min_score": float("nan")}, "min_score"),  # NaN is not a number here
    ("search", {"query": "q", "where": []}, "where"),  # a list is not a map
    ("remember", {"content": "x", "shared": "yes"}, "shared"),  # a string is not a bool
])
def test_bad_arguments_name_the_field(op: str, args: dict[Any, Any], field: str) -> None:
    with pytest.raises(ValidationError) as err:
        check_args(OPERATIONS[op], args)
    assert err.value.field == field


def test_defaults_are_filled_and_optional_nones_dropped() -> None:
    got = check_args(OPERATIONS["search"], {"query": "tea", "about": None})
    assert got == {"query": "tea", "limit": 5, "min_score": 0.3, "include_superseded": False}


def test_search_defaults_are_stated_once() -> None:
    from reachy_memory import MemoryStore
    from reachy_memory.cli import _parser
    from reachy_memory.model import SEARCH_LIMIT, SEARCH_MIN_SCORE

    table = {a.name: a.default for a in OPERATIONS["search"].args}
    assert (table["limit"], table["min_score"]) == (SEARCH_LIMIT, SEARCH_MIN_SCORE)
    for fn in (MemoryStore.search, client_module._Api.search):
        params = inspect.signature(fn).parameters
        assert (params["limit"].default, params["min_score"].default) == (SEARCH_LIMIT, SEARCH_MIN_SCORE)
    cli = _parser().parse_args(["search", "tea"])
    assert (cli.limit, cli.min_score) == (SEARCH_LIMIT, SEARCH_MIN_SCORE)


def test_clients_retry_exactly_the_operations_the_table_calls_idempotent() -> None:
    assert {op.name for op in OPERATIONS.values() if op.idempotent} == client_module._IDEMPOTENT
    assert not OPERATIONS["forget"].idempotent and not OPERATIONS["remember"].idempotent
    assert {"record_turn", "remember"} == client_module._IDEMPOTENT_WITH_ID  # retried only when sent with its ids
    assert all("id" in {a.name for a in OPERATIONS[name].args} for name in client_module._IDEMPOTENT_WITH_ID)


def test_cli_commands_reach_only_operations_of_the_table() -> None:
    import ast

    tree = ast.parse((ROOT / "reachy_memory" / "cli.py").read_text())
    called = {node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call)
              and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
              and node.func.value.id == "c"}
    methods = {op.client_method for op in OPERATIONS.values()}
    assert called and called <= methods, f"CLI calls outside the table: {sorted(called - methods)}"


@pytest.mark.parametrize("row", [
    {"lane": "inline"},  # answered on the I/O thread, so never a write
    {"capped": True},  # only a read's reply is capped (a write's is bounded by its request)
    {"read": True, "retry": "no"},  # a read is always safe to send again
    {"retry": "with_id"},  # retried when it carries its id, but it takes none
    {"lane": "nowhere"},
])
def test_a_row_that_contradicts_itself_is_refused(row: dict[str, Any]) -> None:
    from reachy_memory.daemon.operations import Op

    with pytest.raises(ValueError):
        Op("frob", **({"lane": "engine", "args": (), "result": "null", "doc": ""} | row))


def test_a_handler_needs_a_row_and_a_row_one_handler() -> None:
    from reachy_memory.daemon.handlers import handles

    with pytest.raises(RuntimeError, match="no such row"):
        handles("no_such_op")(lambda d, job: None)
    with pytest.raises(RuntimeError, match="second handler"):
        handles("ping")(lambda d, job: None)


@pytest.mark.timeout(60)
def test_an_op_is_one_row_and_one_handler(config: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What adding an op takes: a row and a handler function.  The daemon then checks its
    arguments, runs it on its lane and caps its reply from the row alone."""
    import threading

    from reachy_memory import MemoryClient, MemoryStore, TooLargeError
    from reachy_memory.daemon import handlers, operations
    from reachy_memory.daemon.server import Daemon

    row = operations._read("repeat", "engine", [operations._req("text", operations.STR),
                                                operations._opt("times", operations.INT, 1)],
                           "str", "The text, repeated.", capped=True)
    monkeypatch.setitem(operations.OPERATIONS, row.name, row)
    ran_on: list[str] = []

    def repeat(d: Any, job: Any) -> str:
        ran_on.append(threading.current_thread().name)
        return str(job.args["text"] * job.args["times"])

    monkeypatch.setitem(handlers.HANDLERS, row.name, handlers.Handler(repeat))
    daemon = Daemon(config, store=MemoryStore(config=config, embedder=None), endpoint=f"ipc://{tmp_path}/m.sock",
                    clock_sync=lambda: None)
    serving = threading.Thread(target=daemon.serve, daemon=True)
    serving.start()
    try:
        with MemoryClient(daemon.endpoint, config=config, timeout=10) as c:
            assert c._call("repeat", {"text": "ab", "times": 3}) == "ababab"
            assert c._call("repeat", {"text": "ab"}) == "ab"  # the row's default
            with pytest.raises(ValidationError) as err:
                c._call("repeat", {"text": 3})
            assert err.value.field == "text"
            with pytest.raises(TooLargeError):  # capped: over server.max_reply_bytes
                c._call("repeat", {"text": "x" * 1000, "times": config.server.max_reply_bytes // 1000 + 1})
    finally:
        daemon.stop()
        serving.join(10)
    assert not serving.is_alive()
    assert ran_on == ["engine"] * 3  # the bad call never reached it
