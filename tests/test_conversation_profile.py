"""The profile shipped for Pollen's conversation app: its files, its install command, and its
tools loaded as the app loads them, dispatched against a real daemon.

The app is not on PyPI (it ships from its git repository and a Hugging Face Space), so CI
cannot install it: its real loader runs here when it is importable, or when
$REACHY_MINI_CONVERSATION_APP_SRC names its ``src`` folder (with any folders its tools need,
``os.pathsep``-separated); the other tests hold the profile to the loader's rules
(``reachy_memory.integrations.conversation_profile`` says which release they come from).
"""

from __future__ import annotations

import abc
import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import tomllib
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reachy_memory.integrations import conversation_profile as cp
from tests.daemon_util import ROOT, DaemonProcess, run_cli

# The app's built-in tool modules (release 1.0.0's tools/ folder, and those a later
# release or 0.8 added): an external tool file of one of these names stops the app.
APP_TOOL_MODULES = {"background_tool_manager", "camera", "dance", "forget", "go_to_sleep", "head_tracking",
                    "idle_do_nothing", "move_head", "play_emotion", "remember", "stop_dance", "stop_emotion",
                    "sweep_look", "task_cancel", "task_status", "tool_constants", "get_time", "get_weather",
                    "web_search", "search_web", "do_nothing", "recall_memory", "recall_memories", "search_memory",
                    "update_memory"}
PROFILE_KEYS = {"schema_version", "default_tools", "voice", "greeting", "hidden"}  # profile_store's at 1.0.0
CALLS = {"memory_context": {},
         "memory_remember": {"fact": "Sarah is allergic to peanuts", "subjects": ["Sarah"]},
         "memory_search": {"query": "who is allergic to peanuts?"},
         "memory_recall": {"query": "allergies", "about": "Sarah"},
         "memory_forget": {"memory_id": "not-an-id"},
         "memory_forget_person": {"person": "Sarah", "dry_run": True},
         "memory_pause": {"minutes": 5},
         "memory_resume": {}}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path_factory.mktemp("profile")) as d:
        yield d


def _front_matter(text: str) -> tuple[dict[str, Any], str]:
    lines = text.splitlines()
    assert lines[0] == "+++"
    end = lines.index("+++", 1)
    return tomllib.loads("\n".join(lines[1:end])), "\n".join(lines[end + 1:]).strip()


def test_the_profile_names_only_tools_that_cannot_clash() -> None:
    data = cp.data_dir()
    meta, body = _front_matter((data / "profile" / "profile.md").read_text())
    assert set(meta) <= PROFILE_KEYS and meta["schema_version"] == 1
    listed = [line for line in (data / "profile" / "tools.txt").read_text().splitlines()
              if line and not line.startswith("#")]
    assert meta["default_tools"] == listed == [*cp.PROFILE_TOOLS[-1:], *cp.PROFILE_TOOLS[:-1], *cp.APP_DEFAULT_TOOLS]
    assert body == (data / "profile" / "instructions.txt").read_text().strip()
    assert not set(listed) & set(cp.APP_MEMORY_TOOLS)  # the app's memory left out: one memory, not two
    files = sorted(p.stem for p in (data / "tools").glob("*.py"))
    assert files == sorted(cp.PROFILE_TOOLS) and not set(files) & APP_TOOL_MODULES
    for name in cp.PROFILE_TOOLS:  # the instructions say when to call each tool
        assert name in body, name


def test_each_tool_file_defines_one_app_tool_named_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loaded as the app loads an external tool (its own module, the app's Tool base): one
    concrete Tool subclass defined in the file, whose name is the file's."""
    core = _stand_in_core_tools(monkeypatch)
    for path in sorted((cp.data_dir() / "tools").glob("*.py")):
        module = _load(path)
        defined = [v for v in vars(module).values()
                   if isinstance(v, type) and issubclass(v, core.Tool) and v.__module__ == module.__name__]
        assert len(defined) == 1 and not getattr(defined[0], "__abstractmethods__", None), path.name
        tool = defined[0]()
        assert tool.name == path.stem and tool.spec()["parameters"]["additionalProperties"] is False


def test_tools_dispatched_against_the_daemon(daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tool files as the app's dispatcher calls them (``await tool(deps, **args)``), with
    no memory in ``deps``: each reaches the daemon $REACHY_MEMORY_CONFIG names."""
    monkeypatch.setenv("REACHY_MEMORY_CONFIG", str(daemon.config_path))
    monkeypatch.delenv("REACHY_MEMORY_ENDPOINT", raising=False)
    _stand_in_core_tools(monkeypatch)
    tools = {}
    for path in (cp.data_dir() / "tools").glob("*.py"):
        module = _load(path)
        tools[path.stem] = next(v for k, v in vars(module).items() if k.endswith("Tool") and k != "Tool")()
    results = asyncio.run(_dispatch(tools, {**CALLS, "memory_search": {"query": "x", "owner": "bob"}}))
    assert results["memory_search"] == {"error": "ValidationError: memory_search: unknown argument 'owner'; it "
                                                 "takes query, memory_type, limit"}
    results = asyncio.run(_dispatch(tools, CALLS))
    _assert_results(results)


async def _dispatch(tools: dict[str, Any], calls: dict[str, Any]) -> dict[str, Any]:
    from reachy_memory.integrations.conversation import aclose_default

    deps = types.SimpleNamespace(reachy_mini=None, movement_manager=None)
    try:
        return {name: await tools[name](deps, **json.loads(json.dumps(args))) for name, args in calls.items()}
    finally:
        await aclose_default()


def _assert_results(results: dict[str, Any]) -> None:
    assert "error" not in json.dumps(results), results
    [stored] = results["memory_remember"]["stored"]
    assert stored["content"] == "Sarah is allergic to peanuts"
    assert results["memory_search"]["results"][0]["id"] == stored["id"]
    assert results["memory_recall"]["results"][0]["about"] == ["Sarah"]
    assert results["memory_forget"] == {"success": False, "id": "not-an-id"}
    assert set(results["memory_context"]) == {"text", "tokens", "people", "memories", "left_out"}
    _assert_household(results, "Sarah")


def _assert_household(results: dict[str, Any], name: str) -> None:
    plan = results["memory_forget_person"]
    assert plan["dry_run"] is True and plan["person"]["name"] == name and plan["memories_deleted"] >= 1
    assert results["memory_pause"]["paused"] is True and 290 < results["memory_pause"]["seconds_left"] <= 300
    assert results["memory_resume"]["paused"] is False


def test_the_household_tools_pause_and_forget_a_person_through_the_daemon(daemon: DaemonProcess,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """By voice: "don't remember this" pauses the daemon (memory_remember then fails, saying so),
    "forget everything about Dave" forgets him; a user-bound call may not forget a person."""
    monkeypatch.setenv("REACHY_MEMORY_CONFIG", str(daemon.config_path))
    monkeypatch.delenv("REACHY_MEMORY_ENDPOINT", raising=False)
    _stand_in_core_tools(monkeypatch)
    tools = {p.stem: next(v for k, v in vars(_load(p)).items() if k.endswith("Tool") and k != "Tool")()
             for p in (cp.data_dir() / "tools").glob("*.py")}
    calls = {"memory_remember": {"fact": "Dave collects kazoo records", "subjects": ["Dave"]},
             "memory_pause": {"minutes": 30},
             "paused_remember": {"fact": "Dave's guest password is wombat"},
             "memory_resume": {},
             "memory_forget_person": {"person": "Dave"}}
    results = asyncio.run(_dispatch({**tools, "paused_remember": tools["memory_remember"]}, calls))
    assert results["memory_pause"]["paused"] is True and results["memory_resume"]["paused"] is False
    assert "paused" in results["paused_remember"]["error"]  # nothing saved, and the model is told why
    assert results["memory_forget_person"]["dry_run"] is False and results["memory_forget_person"]["memories_deleted"]
    bound = types.SimpleNamespace(memory_owner="alice")
    refused = asyncio.run(_dispatch_with(tools["memory_forget_person"], bound, {"person": "Sarah"}))
    assert "user-bound" in refused["error"]
    with daemon.client() as c:
        assert c.find_person("Dave") is None and c.health()["remembering"]["paused"] is False
        assert not [m for m in c.export_page()[0] if "kazoo" in m.content or "wombat" in m.content]


async def _dispatch_with(tool: Any, deps: Any, args: dict[str, Any]) -> dict[str, Any]:
    from reachy_memory.integrations.conversation import aclose_default

    try:
        return await tool(deps, **args)  # type: ignore[no-any-return]
    finally:
        await aclose_default()


def test_install_puts_the_files_where_the_app_looks_and_says_the_lines(tmp_path: Path) -> None:
    cfg = DaemonProcess(tmp_path)
    target = tmp_path / "app content"
    for _ in range(2):  # again: the same files, replaced
        done = run_cli(cfg, "conversation-profile", "install", "--dir", str(target))
        assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines == [f"REACHY_MINI_EXTERNAL_PROFILES_DIRECTORY={target / 'profiles'}",
                     f"REACHY_MINI_EXTERNAL_TOOLS_DIRECTORY={target / 'tools'}",
                     "REACHY_MINI_CUSTOM_PROFILE=reachy_memory"]
    assert (target / "app.env").read_text().splitlines() == lines
    assert sorted(p.name for p in (target / "profiles" / "reachy_memory").iterdir()) == \
        ["instructions.txt", "profile.md", "tools.txt"]
    assert sorted(p.stem for p in (target / "tools").glob("*.py")) == sorted(cp.PROFILE_TOOLS)
    printed = run_cli(cfg, "conversation-profile", "print-env", "--dir", str(target))
    assert printed.returncode == 0 and printed.stdout.splitlines() == lines
    bad = run_cli(cfg, "conversation-profile", "install", "--dir", str(target), "--profile", "my profile")
    assert bad.returncode == 2 and "letters, digits and underscores" in bad.stderr, bad.stderr


def _app_path() -> str | None:
    """Where the conversation app is: $REACHY_MINI_CONVERSATION_APP_SRC, else "" when importable."""
    given = os.environ.get("REACHY_MINI_CONVERSATION_APP_SRC")
    if given:
        return given
    return "" if importlib.util.find_spec("reachy_mini_conversation_app") is not None else None


@pytest.mark.skipif(_app_path() is None, reason="the conversation app is not installed (it is not on PyPI): set "
                    "REACHY_MINI_CONVERSATION_APP_SRC to its src folder to run its loader")
def test_the_apps_own_loader_loads_the_profile_beside_its_default_tools(daemon: DaemonProcess,
                                                                         tmp_path: Path) -> None:
    target = tmp_path / "app"
    assert run_cli(daemon, "conversation-profile", "install", "--dir", str(target)).returncode == 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), _app_path()) if p),
           "REACHY_MEMORY_CONFIG": str(daemon.config_path), "REACHY_MINI_SKIP_DOTENV": "1",
           "REACHY_MINI_EXTERNAL_PROFILES_DIRECTORY": str(target / "profiles"),
           "REACHY_MINI_EXTERNAL_TOOLS_DIRECTORY": str(target / "tools"),
           "REACHY_MINI_CUSTOM_PROFILE": cp.PROFILE_NAME, "HOME": str(tmp_path)}
    env.pop("REACHY_MEMORY_ENDPOINT", None)
    calls = {**CALLS, "memory_remember": {"fact": "Tom is allergic to cats", "subjects": ["Tom"]},
             "memory_search": {"query": "who is allergic to cats?"}, "memory_recall": {"query": "allergy",
                                                                                       "about": "Tom"},
             "memory_forget_person": {"person": "Tom", "dry_run": True}}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "_conversation_app_check.py"), str(target),
                           json.dumps(calls)], env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["errors"] == []  # no "Duplicate Tool.name", no tool that failed to load
    assert set(cp.PROFILE_TOOLS) <= set(out["registered"]) and not set(cp.APP_MEMORY_TOOLS) & set(out["registered"])
    assert len(set(cp.APP_DEFAULT_TOOLS) & set(out["registered"])) >= 7  # 0.8 lacks camera, go_to_sleep, sweep_look
    results = out["results"]
    assert "error" not in json.dumps(results), results
    assert results["memory_recall"]["results"][0]["about"] == ["Tom"]
    assert results["memory_search"]["results"][0]["content"] == "Tom is allergic to cats"
    _assert_household(results, "Tom")


def _stand_in_core_tools(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``reachy_mini_conversation_app.tools.core_tools`` as far as a tool file uses it: the
    abstract ``Tool`` base (name, description, parameters_schema, spec, async __call__)."""
    class Tool(abc.ABC):
        name: str
        description: str
        parameters_schema: dict[str, Any]

        def spec(self) -> dict[str, Any]:
            return {"type": "function", "name": self.name, "description": self.description,
                    "parameters": self.parameters_schema}

        @abc.abstractmethod
        async def __call__(self, deps: Any, **kwargs: Any) -> dict[str, Any]:
            raise NotImplementedError

    core = types.ModuleType("reachy_mini_conversation_app.tools.core_tools")
    core.Tool = Tool  # type: ignore[attr-defined]
    for name in ("reachy_mini_conversation_app", "reachy_mini_conversation_app.tools"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, core.__name__, core)
    return core


def _load(path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"reachy_mini_conversation_app._external_tools.{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
