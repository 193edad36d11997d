"""Conversation-app tools, loaded and called the way Pollen's reachy_mini_conversation_app
does it (its ``tools/core_tools.py`` and ``openai_realtime.py`` at commit 8c3005a, 2026-01-26,
the loader of its release 0.2.2). The shipped profile and its tools, loaded by the loader of
the app's release 1.0.0: tests/test_conversation_profile.py.

Its loader: for each line of ``profiles/<p>/tools.txt`` (``#`` comments and blank lines
skipped) it imports ``reachy_mini_conversation_app.profiles.<p>.<line>``, else
``reachy_mini_conversation_app.tools.<line>``; then ``{cls.name: cls() for cls in
<every concrete subclass of Tool, recursively>}`` and the specs are ``tool.spec()``.
Its dispatcher: ``args = json.loads(args_json or "{}")``, ``{}`` when that fails or is not
an object; ``await tool(deps, **args)``; an exception becomes ``{"error": "Type: msg"}``;
an unknown name ``{"error": "unknown tool: <name>"}``; the handler then sends
``json.dumps(result)`` to the model.

Runs without the conversation app and without reachy-mini; a real daemon serves.
"""

from __future__ import annotations

import abc
import asyncio
import inspect
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from reachy_memory import (
    BusyError,
    ClosedError,
    Config,
    DaemonUnavailableError,
    Memory,
    MemoryStore,
    MemoryType,
    ReachyMemoryError,
    RequestTimeoutError,
    ValidationError,
)
from reachy_memory.daemon import protocol as proto
from reachy_memory.integrations.conversation import (
    MAX_ERROR_CHARS,
    TOOL_CLASSES,
    TOOLS_TXT,
    ForgetMemory,
    MemoryTool,
    Recall,
    Remember,
    SearchMemories,
    StoreMemory,
    aclose_default,
    app_tool_classes,
)
from reachy_memory.integrations.tools import MAX_LIMIT, TOOLS, TOOLS_BY_NAME, DaemonBackend, LocalBackend
from tests.daemon_util import DaemonProcess

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Deps:
    """Shaped like the app's ToolDependencies (a plain dataclass: an app may set other
    attributes on it, such as ``memory_owner``). The app requires the first two."""

    reachy_mini: Any = None
    movement_manager: Any = None
    camera_worker: Any = None
    vision_manager: Any = None
    head_wobbler: Any = None
    motion_duration_s: float = 1.0


class AppTool(abc.ABC):
    """Shaped like the app's ``Tool`` base: three class attributes, ``spec()``, abstract ``__call__``."""

    name: str
    description: str
    parameters_schema: dict[str, Any]

    def spec(self) -> dict[str, Any]:
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters_schema}

    @abc.abstractmethod
    async def __call__(self, deps: Any, **kwargs: Any) -> dict[str, Any]: ...


def concrete_subclasses(base: type) -> list[Any]:
    """The app's registry walk: every non-abstract subclass, recursively (not only direct ones)."""
    found: list[Any] = []
    cls: Any
    for cls in base.__subclasses__():
        if not inspect.isabstract(cls):
            found.append(cls)
        found.extend(concrete_subclasses(cls))
    return found


def app_registry(tool_base: type) -> dict[str, Any]:
    """``ALL_TOOLS`` as the app builds it: each class made with no arguments, keyed by ``name``."""
    return {cls.name: cls() for cls in concrete_subclasses(tool_base)}


def app_args(args_json: str | None) -> dict[str, Any]:
    """The app's ``_safe_load_obj``: bad JSON or a non-object gives ``{}``, never an exception."""
    try:
        parsed = json.loads(args_json or "{}")
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


async def app_dispatch(registry: dict[str, Any], tool_name: str, args_json: str, deps: Any) -> dict[str, Any]:
    """The app's ``dispatch_tool_call``, then the handler's ``json.dumps`` of the result.

    The app turns an exception into ``{"error": "Type: msg"}``; here it is marked
    UNCAUGHT, since our tools are meant to answer errors themselves."""
    tool = registry.get(tool_name)
    if not tool:
        return {"error": f"unknown tool: {tool_name}"}
    try:
        result: dict[str, Any] = await tool(deps, **app_args(args_json))
    except Exception as exc:
        return {"error": f"UNCAUGHT {type(exc).__name__}: {exc}"}
    json.dumps(result)  # the handler sends this as the function_call_output: it must not raise
    return result


async def dispatch(tool: MemoryTool, args_json: str, deps: Any = None) -> dict[str, Any]:
    """One tool through the app's dispatcher."""
    try:
        return await app_dispatch({tool.name: tool}, tool.name, args_json, deps or Deps())
    finally:  # open ZeroMQ sockets would keep the test process from exiting
        await tool.aclose()
        await aclose_default()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path_factory.mktemp("conv")) as d:
        yield d


def run(coro: Any) -> Any:
    return asyncio.run(coro)


HOUSEHOLD_NAMES = ["forget_person", "pause_remembering", "resume_remembering"]  # tests/test_household.py


def test_specs_follow_the_app_interface_and_the_tool_table() -> None:
    assert [c.name for c in TOOL_CLASSES] == ["search_memories", "store_memory", "forget_memory", "remember",
                                              "recall", "memory_context", *HOUSEHOLD_NAMES]
    for cls, table in zip(TOOL_CLASSES, TOOLS, strict=True):
        spec = cls().spec()
        assert spec == {"type": "function", "name": table.name, "description": table.description,
                        "parameters": table.parameters_schema()}
        assert spec["parameters"]["type"] == "object"
        json.dumps(spec)  # the app sends it to the model as JSON
    search = SearchMemories.parameters_schema
    assert search["required"] == ["query"]
    assert search["properties"]["memory_type"]["enum"] == ["conversation", "fact", "context", None]
    assert search["properties"]["memory_type"]["type"] == ["string", "null"]  # null is taken: omitted
    assert search["properties"]["limit"]["maximum"] == MAX_LIMIT
    assert StoreMemory.parameters_schema["properties"]["memory_type"]["default"] == "fact"
    assert "forever" in StoreMemory.description and "30 days" in StoreMemory.description
    assert TOOLS_TXT.splitlines()[1:] == ["search_memories", "store_memory", "forget_memory", "remember", "recall",
                                          "memory_context", *HOUSEHOLD_NAMES]


def test_store_search_forget_through_the_dispatcher(daemon: DaemonProcess) -> None:
    async def scenario() -> list[dict[str, Any]]:
        tools = [cls(config=daemon.config) for cls in TOOL_CLASSES]
        search, store, forget = tools[:3]
        stored = await dispatch(store, '{"content": "Sarah is allergic to peanuts", "metadata": {"person": "Sarah"}}')
        found = await dispatch(search, '{"query": "what is Sarah allergic to?", "memory_type": "fact", "limit": 3}')
        gone = await dispatch(forget, json.dumps({"memory_id": stored["id"]}))
        again = await dispatch(forget, json.dumps({"memory_id": stored["id"]}))
        after = await dispatch(search, '{"query": "Sarah peanuts"}')
        for tool in tools:
            await tool.aclose()
        return [stored, found, gone, again, after]

    stored, found, gone, again, after = run(scenario())
    assert stored["type"] == "fact" and stored["content"] == "Sarah is allergic to peanuts"
    assert set(stored) == {"id", "content", "type", "created_at"}
    assert found["count"] == 1 and found["results"][0]["id"] == stored["id"]
    assert set(found["results"][0]) == {"id", "content", "type", "score", "created_at", "metadata"}
    assert found["results"][0]["metadata"] == {"person": "Sarah"}
    assert gone == {"success": True, "id": stored["id"]}
    assert again == {"success": False, "id": stored["id"]}
    assert after["results"] == [] and "Nothing" in after["message"]


@pytest.mark.parametrize(("tool_cls", "args_json", "expect"), [
    (SearchMemories, '{"query": "x", "memory_type": "dream"}', "memory_type must be one of"),  # not a type
    (SearchMemories, "{}", "query is required"),  # the model forgot the argument
    (SearchMemories, '{"query": "x", "limit": 0}', "limit must be between"),  # out of range
    (SearchMemories, '{"query": "x", "limit": "five"}', "limit must be an integer"),  # wrong JSON type
    (StoreMemory, '{"content": "   "}', "must not be empty"),  # blank content
    (StoreMemory, '{"content": "x", "metadata": "person=Sarah"}', "metadata must be an object"),  # not a dict
    (StoreMemory, '{"content": "x", "metadata": {"nested": {"a": 1}}}', "ValidationError"),  # refused by the daemon
    (ForgetMemory, '{"memory_id": 42}', "memory_id must be a string"),  # wrong JSON type
    # a note's aliases not a list: was "RemoteError: TypeError: object of type 'int' has no len()"
    (Remember, '{"facts": [{"content": "x", "name": "n", "aliases": 5}]}', "ValidationError: aliases must be a list"),
])
def test_bad_arguments_come_back_as_error_dicts(daemon: DaemonProcess, tool_cls: type[MemoryTool],
                                                args_json: str, expect: str) -> None:
    result = run(dispatch(tool_cls(config=daemon.config), args_json))
    assert set(result) == {"error"} and expect in result["error"] and "UNCAUGHT" not in result["error"]


def test_daemon_errors_keep_the_daemon_message(daemon: DaemonProcess) -> None:
    result = run(dispatch(StoreMemory(config=daemon.config), json.dumps({"content": "x" * 20_000})))
    assert result["error"].startswith("TooLargeError:") and "16000" in result["error"]


def test_extra_dispatcher_keys_and_case_are_tolerated(daemon: DaemonProcess) -> None:
    args = '{"content": "The kitchen light is broken", "memory_type": "Context", "tool_manager": null}'
    result = run(dispatch(StoreMemory(config=daemon.config), args))
    assert result["type"] == "context"


def test_arguments_named_deps_or_self_are_refused_not_raised(daemon: DaemonProcess) -> None:
    # __call__(self, deps, **kwargs) raised TypeError ("got multiple values for argument
    # 'deps'") before its try block: the app's dispatcher splats the model's arguments; then
    # they were ignored, while the schema said additionalProperties: false
    args = '{"content": "The porch light is on a timer", "deps": {"memory": 1}, "self": "x"}'
    result = run(dispatch(StoreMemory(config=daemon.config), args))
    assert result == {"error": "ValidationError: store_memory: unknown arguments 'deps', 'self'; it takes content, "
                               "memory_type, metadata"}


def test_an_error_echoing_a_huge_value_is_cut(daemon: DaemonProcess) -> None:
    # a model's million-character bad value came back whole (1,000,066 characters) into the conversation
    result = run(dispatch(SearchMemories(config=daemon.config), json.dumps({"query": ["x" * 1_000_000]})))
    assert set(result) == {"error"} and len(result["error"]) == MAX_ERROR_CHARS
    assert result["error"].startswith("ValidationError: search_memories: query must be a string, got ['xxx")
    assert result["error"].endswith("... (1000066 characters in all)")


def test_default_client_comes_from_the_environment(daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REACHY_MEMORY_CONFIG", str(daemon.config_path))
    result = run(dispatch(StoreMemory(), '{"content": "Reachy lives in the living room"}'))  # the app calls cls()
    assert result["type"] == "fact"


def test_no_daemon_says_how_to_start_one(tmp_path: Path) -> None:
    absent = DaemonProcess(tmp_path)  # configured, never started
    result = run(dispatch(SearchMemories(config=absent.config), '{"query": "anything"}'))
    assert "DaemonUnavailableError" in result["error"] and "reachy-memory serve" in result["error"]


def test_app_registry_finds_mixed_in_tools(daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REACHY_MEMORY_CONFIG", str(daemon.config_path))
    classes = app_tool_classes(AppTool)
    registry = app_registry(AppTool)
    assert set(registry) == {"search_memories", "store_memory", "forget_memory", "remember", "recall",
                             "memory_context", *HOUSEHOLD_NAMES}
    assert all(isinstance(t, AppTool) for t in registry.values())
    stored = run(dispatch(registry["store_memory"], '{"content": "Alex plays the cello"}'))
    assert stored["content"] == "Alex plays the cello"
    del classes


# -- docs/ROBOT.md: the owner's way from the app's memory to this one ------------------------


def robot_md_conversation_section() -> str:
    text = (ROOT / "docs" / "ROBOT.md").read_text(encoding="utf-8")
    return text.split("## Conversation app (Pollen's reachy_mini_conversation_app)\n", 1)[1].split("\n## ", 1)[0]


def test_robot_md_walks_an_owner_from_the_apps_memory_to_this_one() -> None:
    # ROBOT.md had the owner write five tool files, tools.txt and instructions by hand into the
    # app's package, for an old app commit, and never named the external profiles directory.
    flat = " ".join(robot_md_conversation_section().split())
    for says in ("release 1.0.0", "reachy-memory conversation-profile install",
                 "REACHY_MINI_EXTERNAL_PROFILES_DIRECTORY",
                 "REACHY_MINI_EXTERNAL_TOOLS_DIRECTORY", "REACHY_MINI_CUSTOM_PROFILE=reachy_memory",
                 "reachy-memory import ~/.local/share/reachy_mini_conversation_app/memory.v1.json",
                 "mcp-servers add reachy_memory http://127.0.0.1:8766/mcp --token-env REACHY_MEMORY_MCP_TOKEN",
                 "Install reachy-memory into the app's Python environment", "No module named 'reachy_memory'",
                 "systemd/reachy-memory-mcp.service", "memory_context"):
        assert says in flat, says
    from reachy_memory.integrations.conversation_profile import PROFILE_TOOLS

    for name in PROFILE_TOOLS:
        assert f"`{name}`" in flat, name
    assert "8766" in (ROOT / "systemd" / "reachy-memory-mcp.service").read_text()


def test_remember_and_recall_through_the_dispatcher(daemon: DaemonProcess) -> None:
    async def scenario() -> list[dict[str, Any]]:
        remember, recall = Remember(config=daemon.config), Recall(config=daemon.config)
        stored = await dispatch(remember, '{"content": "my brother Leo is vegetarian", "subjects": ["my brother Leo"]}')
        found = await dispatch(recall, '{"query": "what does Leo eat?", "about": "my brother"}')
        bad = await dispatch(remember, '{"subjects": "Leo"}')
        for tool in (remember, recall):
            await tool.aclose()
        return [stored, found, bad]

    stored, found, bad = run(scenario())
    assert stored["count"] == 1 and stored["stored"][0]["subjects"]
    assert found["count"] >= 1 and found["results"][0]["about"] == ["Leo"]
    assert "subjects must be a list" in bad["error"]


def test_a_stored_fact_supersedes_the_one_it_contradicts_and_links_its_person(daemon: DaemonProcess) -> None:
    # store_memory is what the MCP instructions steer an LLM to for facts: it left "likes tea"
    # beside "likes coffee" (supersession ran only in remember), and metadata.person linked nobody.
    async def scenario() -> list[dict[str, Any]]:
        store, search, recall = StoreMemory(config=daemon.config), SearchMemories(config=daemon.config), \
            Recall(config=daemon.config)
        await dispatch(store, '{"content": "User\'s favorite drink is tea"}')
        newer = await dispatch(store, '{"content": "User\'s favorite drink is coffee"}')
        found = await dispatch(search, '{"query": "favorite drink", "memory_type": "fact"}')
        await dispatch(store, '{"content": "Her birthday is in May", "metadata": {"person": "Ines"}}')
        about = await dispatch(recall, '{"query": "birthday", "about": "Ines"}')
        for tool in (store, search, recall):
            await tool.aclose()
        return [newer, found, about]

    newer, found, about = run(scenario())
    assert set(newer) == {"id", "content", "type", "created_at"} and newer["type"] == "fact"
    assert [r["content"] for r in found["results"]] == ["User's favorite drink is coffee"]
    assert about["results"][0]["content"] == "Her birthday is in May" and about["results"][0]["about"] == ["Ines"]


@pytest.mark.parametrize("person", ["she", "her", "user", "Reachy", "x" * 150, "Sam\n", "my " + "w" * 60])
def test_a_fact_whose_metadata_person_names_nobody_is_still_stored(config: Config, person: str) -> None:
    # store_memory used to store any metadata.person; routed through remember, a pronoun or an
    # over-long value was refused (ValidationError / TooLargeError: the fact was lost), and "user"
    # or the robot's name became a person filling every prompt's Known people.
    async def scenario() -> tuple[dict[str, Any], list[str]]:
        backend = LocalBackend(MemoryStore(config=config, embedder=None))
        try:
            stored = await TOOLS_BY_NAME["store_memory"].run(
                backend, {"content": "likes green tea", "metadata": {"person": person}})
            return stored, [p.display_name for p in backend.memory_store.people()]
        finally:
            await backend.aclose()

    stored, people = run(scenario())
    assert stored["type"] == "fact" and stored["content"] == "likes green tea"
    assert people == []


@pytest.mark.parametrize("content", [
    "Trash day is Monday",  # a word capitalised because it starts the sentence
    "Paris is lovely in spring",  # a place at the start, no preposition before it
    "Google Home is in the kitchen",  # a brand
])
def test_a_stored_fact_makes_no_person_of_a_capitalised_word(config: Config, content: str) -> None:
    # store_memory reads who a fact is about from metadata.person only, not from the sentence
    async def scenario() -> list[str]:
        backend = LocalBackend(MemoryStore(config=config, embedder=None))
        try:
            await TOOLS_BY_NAME["store_memory"].run(backend, {"content": content, "metadata": None})
            return [p.display_name for p in backend.memory_store.people()]
        finally:
            await backend.aclose()

    assert run(scenario()) == []


def test_stored_facts_about_different_people_do_not_supersede_each_other(config: Config, embedder: Any) -> None:
    # since store_memory stores a fact without metadata.person about nobody, all such facts
    # were one subject: "Dad does not like coffee" hid "Mom likes coffee" (a negation flip)
    async def scenario() -> tuple[bool, bool]:
        backend = LocalBackend(MemoryStore(config=config, embedder=embedder))
        store = TOOLS_BY_NAME["store_memory"]
        try:
            mom = await store.run(backend, {"content": "Mom likes coffee", "metadata": None})
            await store.run(backend, {"content": "Dad does not like coffee", "metadata": None})
            kept = backend.memory_store.get(mom["id"])
            await store.run(backend, {"content": "Mom does not like coffee", "metadata": None})
            changed = backend.memory_store.get(mom["id"])
            assert kept is not None and changed is not None
            return kept.superseded_at is None, changed.superseded_at is not None
        finally:
            await backend.aclose()

    assert run(scenario()) == (True, True)  # the same person's newer fact still supersedes


def test_an_empty_subjects_array_from_a_model_is_read_as_omitted(config: Config) -> None:
    # models often send [] for an optional array; to remember, [] means "about nobody", so
    # "she" would have lost the person of the fact before
    async def scenario() -> list[tuple[str, ...]]:
        backend = LocalBackend(MemoryStore(config=config, embedder=None))
        try:
            tool = TOOLS_BY_NAME["remember"]
            await tool.run(backend, {"content": "my wife's name is Sarah", "subjects": ["my wife"]})
            one = await tool.run(backend, {"content": "she likes Italian food", "subjects": []})
            batch = await tool.run(backend, {"facts": [{"content": "Sarah likes tea", "subjects": []}]})
            return [tuple(one["stored"][0]["subjects"]), tuple(batch["stored"][0]["subjects"])]
        finally:
            await backend.aclose()

    she, named = run(scenario())
    assert she and she == named  # both linked to Sarah


def test_recall_about_someone_unknown_keeps_only_what_names_them(config: Config) -> None:
    # The store answers an unknown person unfiltered (spec 004): a model read "Loves spicy food"
    # as Bob's. Now only hits whose metadata.person names them are kept (spec 000's way).
    async def scenario() -> tuple[list[str], list[str]]:
        backend = LocalBackend(MemoryStore(config=config, embedder=None))
        try:
            backend.memory_store.store("Loves spicy food", "fact")
            backend.memory_store.store("Enjoys spicy jazz food", "fact", {"person": "bob"})
            recall = TOOLS_BY_NAME["recall"]
            bob = await recall.run(backend, {"query": "spicy food", "about": "Bob"})
            zed = await recall.run(backend, {"query": "spicy food", "about": "Zed"})
            return [h["content"] for h in bob], [h["content"] for h in zed]
        finally:
            await backend.aclose()

    bob, zed = run(scenario())
    assert bob == ["Enjoys spicy jazz food"] and zed == []


@pytest.mark.parametrize("wrapped", [
    '"{id}"',  # quoted
    " {id}\n",  # whitespace and a newline
    "`{id}`",  # backticks
])
def test_forget_memory_takes_the_id_a_model_wraps(config: Config, wrapped: str) -> None:
    # It answered success false ("already forgotten") and the memory stayed.
    async def scenario() -> tuple[dict[str, Any], int]:
        backend = LocalBackend(MemoryStore(config=config, embedder=None))
        try:
            memory = backend.memory_store.store("the door code is 1234", "fact")
            result = await TOOLS_BY_NAME["forget_memory"].run(backend, {"memory_id": wrapped.format(id=memory.id)})
            return result, len(backend.memory_store)
        finally:
            await backend.aclose()

    result, left = run(scenario())
    assert result["success"] is True and left == 0


@pytest.mark.parametrize("wrapped", [
    '"{id}"',  # quoted: made a person named after the id ("8B05907C88Ad...")
    " {id}\n",  # whitespace and a newline: the store refused the newline
    "`{id}`",  # backticks: made a person too
])
def test_remember_and_recall_take_the_person_id_a_model_wraps(config: Config, wrapped: str) -> None:
    # forget_memory unwrapped memory ids; subjects and about, holding person ids from earlier
    # results, were taken as written.
    async def scenario() -> tuple[list[str], list[str], int]:
        backend = LocalBackend(MemoryStore(config=config, embedder=None))
        try:
            ann = backend.memory_store.add_person("Ann")
            pid = wrapped.format(id=ann.id)
            stored = await TOOLS_BY_NAME["remember"].run(backend, {"content": "Likes green tea", "subjects": [pid]})
            facts = await TOOLS_BY_NAME["remember"].run(backend, {"facts": [{"content": "Plays chess",
                                                                             "subjects": [pid]}]})
            hits = await TOOLS_BY_NAME["recall"].run(backend, {"query": "green tea", "about": pid})
            subjects = [*stored["stored"][0]["subjects"], *facts["stored"][0]["subjects"]]
            return subjects, [h["content"] for h in hits], len(backend.memory_store.people())
        finally:
            await backend.aclose()

    subjects, hits, people = run(scenario())
    assert len(set(subjects)) == 1 and people == 1 and hits == ["Likes green tea"]


class _SlowClient:
    """Stands for an AsyncMemoryClient whose call times out; ``ping`` answers or not."""

    endpoint, timeout = "tcp://127.0.0.1:9", 5.0

    def __init__(self, answers_ping: bool) -> None:
        self.answers_ping = answers_ping

    async def search(self, *args: Any, **kwargs: Any) -> Any:
        raise RequestTimeoutError("timed out")

    async def ping(self, *, timeout: float | None = None) -> Any:
        if not self.answers_ping:
            raise RequestTimeoutError("timed out")
        return {"pong": True}


@pytest.mark.parametrize(("answers_ping", "error", "says"), [
    (True, RequestTimeoutError, "running but did not finish"),  # busy: the call may still complete
    (False, DaemonUnavailableError, "no reachy-memory daemon"),  # down or stuck
])
def test_a_timeout_says_busy_when_the_daemon_still_answers(answers_ping: bool, error: type, says: str) -> None:
    # A slow but running daemon was reported as "not running, start it", and the write completed.
    backend = DaemonBackend(_SlowClient(answers_ping), own=False)  # type: ignore[arg-type]
    with pytest.raises(error, match=says):
        run(backend.search("tea", None, 5))


class _GoneClient(_SlowClient):
    """A client whose calls time out and whose ping gets no answer: the daemon stopped."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:9") -> None:
        super().__init__(answers_ping=False)
        self.endpoint, self.calls = endpoint, 0
        self.ids: list[Any] = []  # the id each store was sent with

    async def search(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        raise RequestTimeoutError("timed out")

    async def store(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        self.ids.append(kwargs.get("id"))
        raise RequestTimeoutError("timed out")


def test_a_store_cut_by_a_restart_says_it_may_have_been_kept() -> None:
    # A daemon stopped (a restart) after the store reached it may have journaled it: "no daemon
    # answered, start it" led the model to store it again, a duplicate (the busy case said so).
    # Sent again (with its id) while it stays away, it still cannot be known: said so.
    client = _GoneClient()
    backend = DaemonBackend(client, own=False, retry_for=0.3)  # type: ignore[arg-type]
    with pytest.raises(DaemonUnavailableError, match="may have been kept: search for it before storing it again"):
        run(backend.store("Tom likes tea", "fact", None))
    assert client.calls > 1 and len(set(client.ids)) == 1 and client.ids[0]  # sent again, with one id
    with pytest.raises(DaemonUnavailableError) as raised:
        run(backend.search("tea", None, 5))
    assert "kept" not in str(raised.value)  # a read has nothing to check


def test_the_socket_a_killed_daemon_left_is_answered_at_once(tmp_path: Path) -> None:
    # Only a missing socket file was answered at once: the one a killed daemon leaves (until
    # systemd's restart binds again) made every tool call wait its timeout and a ping.
    import socket

    path = tmp_path / "memory.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as left:
        left.bind(str(path))  # a socket file nobody accepts on
        client = _GoneClient(f"ipc://{path}")
        backend = DaemonBackend(client, own=False)  # type: ignore[arg-type]
        with pytest.raises(DaemonUnavailableError, match="no reachy-memory daemon is listening"):
            run(backend.search("tea", None, 5))
    assert client.calls == 0


class _RestartingClient(_SlowClient):
    """A daemon that restarts under a tool's write: each store or remember before the
    ``answer_at``-th fails as ``failures`` says (cycled), then it answers; every call kept."""

    def __init__(self, failures: list[ReachyMemoryError], answer_at: int) -> None:
        super().__init__(answers_ping=True)
        self.failures, self.answer_at = failures, answer_at
        self.sent: list[dict[str, Any]] = []

    async def _write(self, kwargs: dict[str, Any], memories: list[Memory]) -> Any:
        self.sent.append(kwargs)
        if len(self.sent) < self.answer_at:
            raise self.failures[(len(self.sent) - 1) % len(self.failures)]
        return memories

    async def store(self, content: str, *args: Any, **kwargs: Any) -> Any:
        [memory] = await self._write(kwargs, [_memory(kwargs["id"] or "made-by-the-client", content)])
        return memory

    async def remember(self, **kwargs: Any) -> Any:
        facts = kwargs.get("facts") or [{"content": kwargs["content"], "id": kwargs.get("id")}]
        return await self._write(kwargs, [_memory(f.get("id") or "made-by-the-daemon", f["content"]) for f in facts])


def _memory(memory_id: str, content: str) -> Memory:
    return Memory(memory_id, content, MemoryType.FACT, datetime.now(UTC))


NOT_NOW = [DaemonUnavailableError("no daemon"), RequestTimeoutError("no reply"), BusyError("queue full")]


@pytest.mark.parametrize(("tool", "args"), [
    ("store_memory", {"content": "Tom likes tea", "memory_type": "conversation"}),  # store
    ("store_memory", {"content": "Tom likes tea"}),  # a fact: remember
    ("remember", {"content": "Tom likes tea"}),
    ("remember", {"facts": [{"content": "Tom likes tea"}, {"content": "Ann likes coffee"}]}),
])
def test_a_tool_write_is_sent_again_with_its_ids_until_the_daemon_answers(tool: str, args: dict[str, Any]) -> None:
    # A tool's write cut off by a daemon restart answered the model "it may have been kept":
    # a model storing it again made a duplicate. Now the call carries ids made for it and is
    # sent again (same ids: the daemon keeps it once) until the daemon is back: kept, said so.
    client = _RestartingClient(NOT_NOW, answer_at=4)
    backend = DaemonBackend(client, own=False)  # type: ignore[arg-type]  # sent again for its timeout (5 s)
    result = run(TOOLS_BY_NAME[tool].run(backend, args))
    sent = [{k: v for k, v in kwargs.items() if k != "timeout"} for kwargs in client.sent]
    assert len(sent) == 4 and all(s == sent[0] for s in sent)  # the same write, the same ids, each time
    ids = [f["id"] for f in sent[0]["facts"]] if sent[0].get("facts") else [sent[0]["id"]]
    assert all(isinstance(i, str) and len(i) == 32 for i in ids) and len(set(ids)) == len(ids)
    stored = result["stored"] if tool == "remember" else [result]
    assert [m["id"] for m in stored] == ids  # the answer: kept, with its ids
    with pytest.raises(ValidationError, match="takes no id"):  # the ids are the tool's, never a model's
        run(TOOLS_BY_NAME["remember"].run(backend, {"facts": [{"content": "Tom likes tea", "id": "a-model's"}]}))
    for bad in (-1, math.nan, True, "5"):
        with pytest.raises(ValidationError, match="retry_for"):
            DaemonBackend(client, own=False, retry_for=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("failure", "says"), [
    (DaemonUnavailableError("no daemon"), "no reachy-memory daemon listened for 0.3 s"),  # never sent
    (BusyError("queue full"), "queue full; sent again for 0.3 s"),  # refused each time
])
def test_a_tool_write_no_daemon_took_says_it_was_not_stored(tmp_path: Path, failure: ReachyMemoryError,
                                                            says: str) -> None:
    # "may have been kept" was said whenever a store failed; when no attempt can have been
    # kept (no daemon listened, or each was refused) the answer is definite: not stored.
    client = _RestartingClient([failure], answer_at=10**9)
    client.timeout = 0.3  # sent again for as long
    if isinstance(failure, DaemonUnavailableError):
        client.endpoint = f"ipc://{tmp_path}/memory.sock"  # no socket there: never sent
    backend = DaemonBackend(client, own=False)  # type: ignore[arg-type]
    with pytest.raises(type(failure)) as raised:
        run(TOOLS_BY_NAME["store_memory"].run(backend, {"content": "Tom likes tea"}))
    assert says in raised.value.message and raised.value.message.count("the memory was not stored") == 1
    assert "may have been kept" not in raised.value.message
    if isinstance(failure, DaemonUnavailableError):
        assert client.sent == []  # never sent: nothing listened
    else:
        assert len(client.sent) > 1  # sent again, refused each time


@pytest.mark.parametrize("tool", ["store_memory", "remember"])
def test_a_tool_write_on_a_closed_client_ends_at_once_and_a_stopping_daemon_is_waited_for(tool: str) -> None:
    # ClosedError's code is "unavailable", a "not now" code: a write on a client closed by the
    # app (aclose, from another task) was sent again until retry_for (each attempt refused at
    # once), then said "sent again for 3 s: the memory was not stored".
    client = _RestartingClient([ClosedError("AsyncMemoryClient is closed")], answer_at=10**9)
    backend = DaemonBackend(client, own=False, retry_for=3.0)  # type: ignore[arg-type]
    started = time.monotonic()
    with pytest.raises(ClosedError, match="AsyncMemoryClient is closed"):
        run(TOOLS_BY_NAME[tool].run(backend, {"content": "Tom likes tea"}))
    assert time.monotonic() - started < 1.0 and len(client.sent) == 1
    # The daemon's own ClosedError (its store closing while it stops: a restart) is "not now".
    with pytest.raises(ClosedError) as raised:  # as the client gets it
        proto.raise_for({"ok": False, "error": {"code": "unavailable", "type": "ClosedError",
                                                "message": "this MemoryStore is closed"}})
    client = _RestartingClient([raised.value], answer_at=3)
    backend = DaemonBackend(client, own=False)  # type: ignore[arg-type]
    result = run(TOOLS_BY_NAME[tool].run(backend, {"content": "Tom likes tea"}))
    assert len(client.sent) == 3 and "Tom likes tea" in json.dumps(result)


class _OldDaemonClient(_RestartingClient):
    """A daemon from before ``remember`` took ids: it refuses them (storing nothing)."""

    def __init__(self) -> None:
        super().__init__([], answer_at=1)

    async def remember(self, **kwargs: Any) -> Any:
        if "id" in kwargs:
            self.sent.append(kwargs)
            raise ValidationError("remember: unknown arguments ['id']", field="args")
        if any("id" in f for f in kwargs.get("facts") or []):
            self.sent.append(kwargs)
            raise ValidationError("unknown fact keys: ['id']", field="facts")
        return await super().remember(**kwargs)


@pytest.mark.parametrize("args", [{"content": "Tom likes tea"},
                                  {"facts": [{"content": "Tom likes tea"}, {"content": "Ann likes coffee"}]}])
def test_a_daemon_from_before_the_ids_gets_the_write_once_without_them(args: dict[str, Any]) -> None:
    client = _OldDaemonClient()
    backend = DaemonBackend(client, own=False)  # type: ignore[arg-type]
    result = run(TOOLS_BY_NAME["remember"].run(backend, args))
    assert result["count"] == len(args.get("facts", [1]))
    first, again = client.sent  # with its ids (refused), then once without
    assert "id" in first or all("id" in f for f in first["facts"] or [])
    assert "id" not in again and not any("id" in f for f in again.get("facts") or [])


def test_recall_about_someone_unknown_looks_past_the_limit(config: Config) -> None:
    # Filtering the first `limit` unfiltered hits found nothing when others outranked them.
    async def scenario() -> list[str]:
        backend = LocalBackend(MemoryStore(config=config, embedder=None))
        try:
            for i in range(5):  # as relevant as Bob's, and stored first: ahead of it in the ranking
                backend.memory_store.store(f"Ann eats pizza {i}", "fact", {"person": "Ann"})
            backend.memory_store.store("Bob likes pizza a lot", "fact", {"person": "Bob"})
            hits = await TOOLS_BY_NAME["recall"].run(backend, {"query": "pizza", "about": "Bob", "limit": 3})
            return [h["content"] for h in hits]
        finally:
            await backend.aclose()

    assert run(scenario()) == ["Bob likes pizza a lot"]


# -- the current user (owner), bound by the application ---------------------------------------


@pytest.fixture(scope="module")
def owners_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A daemon of its own, so these tests' memories never reach the others' searches."""
    with DaemonProcess(tmp_path_factory.mktemp("owners")) as d:
        yield d


@pytest.fixture(params=["local", "daemon"])
def open_backend(request: pytest.FixtureRequest, config: Config) -> Callable[[str | None], Any]:
    """Opens a backend bound to an owner (call it inside the event loop): a store in this
    process (lexical-only: fast), or a real daemon with the real model."""
    if request.param == "local":
        return lambda owner: LocalBackend(MemoryStore(config=config, embedder=None), owner=owner)
    daemon = request.getfixturevalue("owners_daemon")
    return lambda owner: DaemonBackend.from_config(daemon.config, owner=owner)


async def _contents(backend: Any, tool: str, query: str) -> list[str]:
    return [h["content"] for h in await TOOLS_BY_NAME[tool].run(backend, {"query": query, "limit": 10})]


def test_two_owners_see_their_own_facts_and_shared_and_unscoped_ones(open_backend: Callable[..., Any]) -> None:
    # Without the feature no tool took an owner: every fact was unscoped and each user saw
    # the other's "favourite colour"; `shared` did nothing.
    async def scenario() -> dict[str, Any]:
        backend = open_backend("ann")
        store, remember = TOOLS_BY_NAME["store_memory"], TOOLS_BY_NAME["remember"]
        try:
            green = await store.run(backend, {"content": "My favourite colour is green"})
            await remember.run(backend, {"content": "The wifi password is on the fridge", "shared": True})
            await store.run(backend, {"content": "The garden gate sticks today", "memory_type": "context"})
            await store.run(backend, {"content": "Ann said she is secretly job hunting", "memory_type": "conversation"})
            await remember.run(backend.for_owner(None), {"content": "The boiler is in the cellar", "subjects": []})
            backend.owner = "ben"  # another person starts talking: the next call is theirs
            await store.run(backend, {"content": "My favourite colour is red"})
            seen = {"ben": await _contents(backend, "search_memories", "favourite colour"),
                    "ben recall": await _contents(backend, "recall", "favourite colour"),
                    "ben shared": await _contents(backend, "search_memories", "wifi password fridge"),
                    "ben unscoped": await _contents(backend, "recall", "boiler cellar"),
                    "ben context": await _contents(backend, "search_memories", "garden gate sticks"),
                    "ben turns": await _contents(backend, "search_memories", "secretly job hunting"),
                    "ben forgets": await TOOLS_BY_NAME["forget_memory"].run(backend, {"memory_id": green["id"]})}
            backend.owner = "ann"
            seen["ann"] = await _contents(backend, "recall", "favourite colour")
            seen["nobody"] = await _contents(backend.for_owner(None), "search_memories", "favourite colour")
            seen["ann still"] = await _contents(backend, "search_memories", "favourite colour")
            seen["ann context"] = (await _contents(backend, "search_memories", "garden gate sticks")
                                   + await _contents(backend, "search_memories", "secretly job hunting"))
            return seen
        finally:
            await backend.aclose()

    seen = run(scenario())
    green, red = "My favourite colour is green", "My favourite colour is red"
    assert red in seen["ben"] and green not in seen["ben"]
    assert red in seen["ben recall"] and green not in seen["ben recall"]
    assert seen["ben shared"][0] == "The wifi password is on the fridge"  # ann's, shared with the household
    assert seen["ben unscoped"][0] == "The boiler is in the cellar"  # stored with no owner
    # store_memory of a context or conversation memory is the bound user's too (was: unscoped, ben saw both)
    assert "The garden gate sticks today" not in seen["ben context"]
    assert "Ann said she is secretly job hunting" not in seen["ben turns"]
    assert {"The garden gate sticks today", "Ann said she is secretly job hunting"} <= set(seen["ann context"])
    assert seen["ben forgets"]["success"] is False  # ann's own fact: refused...
    assert green in seen["ann still"] and red not in seen["ann still"]  # ...and still there
    assert green in seen["ann"] and red not in seen["ann"]
    assert {green, red} <= set(seen["nobody"])  # unbound: every user's, as before


# (who stores it, shared, who forgets it, success): a bound backend forgets only what its user sees
FORGET_CASES = [
    ("cas", False, "dov", False),  # another user's own fact: refused, as an unknown id would be
    ("cas", True, "dov", True),  # a household (shared) fact: any user may forget it
    (None, False, "dov", True),  # an unscoped fact: as before
    ("cas", False, "cas", True),  # one's own fact
    ("cas", False, None, True),  # an unbound backend: as before, anything
]


@pytest.mark.parametrize(("writer", "shared", "forgetter", "success"), FORGET_CASES)
def test_forget_memory_refuses_another_users_own_memory(open_backend: Callable[..., Any], writer: str | None,
                                                        shared: bool, forgetter: str | None, success: bool) -> None:
    async def scenario() -> tuple[dict[str, Any], dict[str, Any], bool]:
        backend = open_backend(writer)
        try:
            [m] = await backend.remember({"content": f"The door code is {writer}-{shared}-{forgetter}",
                                          "shared": shared, "subjects": []})
            forget = TOOLS_BY_NAME["forget_memory"]
            result = await forget.run(backend.for_owner(forgetter), {"memory_id": m.id})
            unknown = await forget.run(backend.for_owner(forgetter), {"memory_id": "no-such-memory"})
            left = await backend.for_owner(None).search("door code", None, 50)
            return result | {"stored": m.id}, unknown, m.id in {h.memory.id for h in left}
        finally:
            await backend.aclose()

    result, unknown, still_there = run(scenario())
    assert result == {"success": success, "id": result["stored"], "stored": result["stored"]}
    assert still_there is not success
    assert unknown == {"success": False, "id": "no-such-memory"}  # the refusal's reply: no id confirmed


@pytest.mark.parametrize(("owner", "says"), [
    ("", "owner must be a string of 1 to 200 characters"),  # empty: the store refuses it as a memory's owner
    ("x" * 201, "owner must be a string of 1 to 200 characters"),  # longer than the store's 200 characters
    (42, "owner must be a string of 1 to 200 characters"),  # not a string
    # a lone surrogate (a broken JSON escape, an undecodable argv byte): was bound, searches
    # ran, then every fact stored failed with "a text to store is not valid Unicode"
    ("al\ud800ice", "owner is not valid Unicode: a lone surrogate at character 2"),
])
def test_a_bad_owner_is_refused_before_any_call(config: Config, owner: Any, says: str) -> None:
    store = MemoryStore(config=config, embedder=None)
    backend = LocalBackend(store)
    try:
        for bind in (lambda: LocalBackend(store, owner=owner), lambda: SearchMemories(owner=owner),
                     lambda: DaemonBackend.from_config(config, owner=owner), lambda: backend.for_owner(owner)):
            with pytest.raises(ValidationError, match=says):
                bind()
    finally:
        store.close()


@dataclass
class OwnerDeps(Deps):
    """The app's deps with the two attributes an app sets: its memory and who is speaking."""

    memory: Any = None
    memory_owner: Any = None


def test_conversation_tools_follow_deps_memory_owner_at_run_time(config: Config) -> None:
    async def scenario() -> dict[str, Any]:
        backend = LocalBackend(MemoryStore(config=config, embedder=None))
        deps, remember, search = OwnerDeps(memory=backend), Remember(), SearchMemories()
        try:
            deps.memory_owner = "eva"
            await remember(deps, content="My bike is blue")
            deps.memory_owner = "fay"  # recognition says another person speaks now
            await remember(deps, content="My bike is black")
            seen = {"fay": await search(deps, query="bike"), "eva by constructor": await SearchMemories(
                owner="eva")(deps, query="bike")}  # the constructor's owner wins over deps
            deps.memory_owner = "eva"
            seen["eva"] = await search(deps, query="bike")
            deps.memory_owner = None
            seen["nobody"] = await search(deps, query="bike")
            deps.memory_owner = ""
            seen["bad"] = await search(deps, query="bike")
            seen["unbound backend"] = backend.owner  # the tools bound views, never the app's backend
            seen["custom"] = await SearchMemories(owner="eva")(OwnerDeps(memory=_SlowClient(True)), query="bike")
            return seen
        finally:
            await backend.aclose()

    seen = run(scenario())
    texts = {k: sorted(r["content"] for r in v["results"]) for k, v in seen.items() if isinstance(v, dict)
             and "results" in v}
    assert texts["fay"] == ["My bike is black"] and texts["eva"] == ["My bike is blue"]
    assert texts["eva by constructor"] == ["My bike is blue"]
    assert texts["nobody"] == ["My bike is black", "My bike is blue"]
    assert seen["bad"]["error"].startswith("ValidationError: owner must be a string")
    assert seen["unbound backend"] is None
    assert seen["custom"]["error"].startswith("ConfigError:") and "cannot be bound to a user" in seen["custom"]["error"]


def test_recall_serves_the_user_bound_when_the_call_starts(config: Config) -> None:
    # recall makes two backend calls (knows, then recall). Each read backend.owner: the app
    # switching it (recognition on the same loop) between them served bob's call with
    # alice's facts ("Carol likes red wine", found by its metadata.person).
    async def scenario() -> list[dict[str, Any]]:
        backend = LocalBackend(MemoryStore(config=config, embedder=None))
        try:
            await TOOLS_BY_NAME["store_memory"].run(backend.for_owner("alice"), {
                "content": "Carol likes red wine", "metadata": {"person": "Carol"}})
            backend.owner = "bob"
            knows = backend.knows

            async def knows_then_alice_speaks(reference: str) -> bool:
                known = await knows(reference)
                backend.owner = "alice"  # between the tool's two calls
                return known

            backend.knows = knows_then_alice_speaks  # type: ignore[method-assign]
            return await TOOLS_BY_NAME["recall"].run(backend, {"query": "wine", "about": "Carol"})  # type: ignore[no-any-return]
        finally:
            await backend.aclose()

    assert run(scenario()) == []


# (who binds the tool, a note name in a fact, what comes back): note names are one namespace for the
# store, so a bound user could test another user's note names and get their memory ids
NOTE_CASES = [
    ("bob", "diary", "not available to a user-bound tool"),  # alice's note: was "already used by memory <id>"
    ("bob", "my list", "not available to a user-bound tool"),  # a free name: the same answer, no oracle
    ("alice", "diary", "not available to a user-bound tool"),  # the bound owner too (names are not hers alone)
    (None, "my list", None),  # unbound: named notes as before
]


@pytest.mark.parametrize(("owner", "name", "error"), NOTE_CASES)
def test_a_bound_remember_takes_no_note_name(config: Config, owner: str | None, name: str,
                                            error: str | None) -> None:
    async def scenario() -> tuple[str, dict[str, Any], Any]:
        backend = LocalBackend(MemoryStore(config=config, embedder=None))
        try:
            [diary] = await backend.for_owner("alice").remember({"content": "I hate my job", "name": "diary"})
            result = await Remember(backend, owner=owner)(Deps(), facts=[{"content": "Buy milk", "name": name,
                                                                           "subjects": []}])
            return diary.id, result, await backend._run(backend.memory_store.note, name)
        finally:
            await backend.aclose()

    diary, result, note = run(scenario())
    if error is None:
        assert result["count"] == 1 and note.content == "Buy milk"
    else:
        assert error in result["error"] and diary not in result["error"]
        assert note is None or note.id == diary  # nothing stored


def test_descriptions_state_the_configured_retention(tmp_path: Path) -> None:
    """They said conversation memories are "kept 30 days" whatever ``memory.conversation_ttl_days``
    was: a robot configured for 7 days told its model 30."""
    for sub in ("d", "none", "local"):
        (tmp_path / sub).mkdir()
    with DaemonProcess(tmp_path / "d", memory={"conversation_ttl_days": 7}, embedding={"enabled": False}) as d:
        here = replace(d.config, memory=replace(d.config.memory, conversation_ttl_days=30.0))
        made = {cls.name: cls(config=here).spec() for cls in TOOL_CLASSES}  # the daemon's TTL, not this config's
        again = StoreMemory(backend=DaemonBackend.from_config(here)).spec()
    store, search = made["store_memory"], made["search_memories"]
    assert "kept 7 days" in store["description"] and "30 days" not in json.dumps(store)
    assert store["parameters"]["properties"]["memory_type"]["description"].startswith('"fact" (forever), '
                                                                                      '"conversation" (7 days)')
    assert '"conversation": things that were said, kept 7 days' in search["description"]
    assert again == store  # asked once: the same text for every tool made in this process
    assert made["forget_memory"] == ForgetMemory().spec()  # the others say no retention
    nobody = DaemonProcess(tmp_path / "none", memory={"conversation_ttl_days": 3})  # no daemon: this config's
    assert "kept 3 days" in StoreMemory(config=nobody.config).description
    config = DaemonProcess(tmp_path / "local", memory={"conversation_ttl_days": 0.5}).config
    with MemoryStore(config=config, embedder=None) as local:
        assert "kept 12 hours" in SearchMemories(backend=LocalBackend(local)).spec()["description"]
    assert "kept 30 days" in StoreMemory.description  # the class: the default configuration's text
