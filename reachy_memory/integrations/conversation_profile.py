"""The conversation app's profile for reachy-memory: its tools, and where they are put.

Pollen's Reachy Mini conversation app (``reachy_mini_conversation_app``) loads a profile
(its instructions and the names of its tools) from ``$REACHY_MINI_EXTERNAL_PROFILES_DIRECTORY``
and tool modules it does not ship from ``$REACHY_MINI_EXTERNAL_TOOLS_DIRECTORY``. Checked
against its loader at release 1.0.0 (``tools/core_tools.py``, ``profile_store.py``,
``config.py``) and 0.8.0:

* a profile is a folder: ``profile.md`` (TOML front matter between ``+++`` lines with
  ``schema_version = 1`` and ``default_tools``, then the instructions; 1.0.0) or ``tools.txt``
  and ``instructions.txt`` (0.8); the folder ships both;
* a tool is ``<tools dir>/<name>.py`` defining one subclass of the app's ``Tool`` in that file;
  a file named like a built-in tool module (``remember.py``) stops the app at start
  ("Ambiguous tool names"), two tools with one name too ("Duplicate Tool.name values").

So every tool here is named ``memory_*`` (:data:`PROFILE_TOOLS`), a name the app's
built-in tools (``remember``, ``forget``, ``dance``...) do not use, and the profile leaves the
app's own memory tools out: one memory, not two. The tools are the table's
(:mod:`.tools`), renamed and, for ``memory_remember``, shaped as the app's own ``remember``
is called (``{"fact": ...}``); the household's tools too (``memory_forget_person``,
``memory_pause``, ``memory_resume``: ``forget_person``, ``pause_remembering``,
``resume_remembering``), so "forget everything about Dave" and "don't remember this" work
by voice.

:func:`install` copies the package data (``profile_data/``) to a directory and returns the
environment lines that point the app at it (``reachy-memory conversation-profile``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from reachy_memory.errors import ConfigError
from reachy_memory.integrations.conversation import MemoryContext, MemoryTool, SearchMemories
from reachy_memory.integrations.tools import (
    DEFAULT_CONVERSATION_DAYS,
    FORGET_MEMORY,
    FORGET_PERSON,
    MEMORY_CONTEXT,
    PAUSE_REMEMBERING,
    RECALL,
    REMEMBER,
    RESUME_REMEMBERING,
    Backend,
    Param,
    ToolDef,
    tools_for,
)

PROFILE_NAME = "reachy_memory"  # no profile the app ships has this name (an external one must not)
#: The app's built-in memory tools, left out of the profile (and never a name of ours).
APP_MEMORY_TOOLS = ("remember", "forget")
#: The app's built-in tools (release 1.0.0's default profile, less its memory tools and the
#: Hugging Face Space tools, which need their own install): enabled beside the memory tools.
APP_DEFAULT_TOOLS = ("dance", "stop_dance", "play_emotion", "stop_emotion", "camera", "idle_do_nothing",
                     "move_head", "go_to_sleep", "sweep_look", "head_tracking")
ENV_PROFILES = "REACHY_MINI_EXTERNAL_PROFILES_DIRECTORY"
ENV_TOOLS = "REACHY_MINI_EXTERNAL_TOOLS_DIRECTORY"
ENV_PROFILE = "REACHY_MINI_CUSTOM_PROFILE"


def _renamed(base: ToolDef, name: str, description: str) -> ToolDef:
    """``base`` under another name and description, calling and checking as it does."""
    return dataclasses.replace(base, name=name, description=description)


def _search(days: float) -> ToolDef:
    base = tools_for(days)[0]
    return _renamed(base, "memory_search", base.description.replace("Search the robot's", "Search your", 1))


def _remember(days: float) -> ToolDef:
    """``memory_remember``: one fact as the app's ``remember`` takes it (``fact``), with who it
    is about; run as the table's ``remember``."""
    async def call(backend: Backend, a: dict[str, Any]) -> Any:
        return await REMEMBER.call(backend, REMEMBER.check(
            {"content": a["fact"], "subjects": a["subjects"], "shared": a["shared"]}))

    return ToolDef(
        name="memory_remember",
        description=(
            "Save ONE lasting fact to long-term memory: something the user told you about themselves or people "
            "they know (names, relationships, preferences, birthdays, plans). Write it so it makes sense on its "
            "own (\"Sarah is allergic to peanuts\"). Give who it is about in subjects as the user said them "
            "(['my wife'], ['Sarah']); omit subjects for a fact about the user. A new fact that contradicts an "
            "older one replaces it. Never save passwords, codes or payment details. Save quietly: do not "
            "announce it."),
        params=(
            Param("fact", {"type": "string", "minLength": 1}, str, "The fact, one self-contained sentence.",
                  required=True),
            Param("subjects", {"type": "array", "items": {"type": "string"}, "maxItems": 16}, list[str] | None,
                  "Who the fact is about, one person per entry (e.g. ['Sarah'], ['my wife']).", nullable=True),
            Param("shared", {"type": "boolean"}, bool, "True for a household fact every user may hear.",
                  default=False),
        ),
        call=call, text=REMEMBER.text)


def _recall(days: float) -> ToolDef:
    return _renamed(RECALL, "memory_recall", RECALL.description.replace(
        "Search long-term memory", "Search your long-term memory", 1) + " Use it before answering questions "
        "about the user or someone they know.")


def _forget(days: float) -> ToolDef:
    return _renamed(FORGET_MEMORY, "memory_forget", (
        "Delete one memory for good, by its id: first find it with memory_search or memory_recall, then pass "
        "the id field of that result, copied exactly. Use it when the user asks you to forget something, or to "
        "remove a wrong memory before saving the corrected one. Says so when no memory has that id."))


# The household's tools (docs/HOUSEHOLD.md), as the model is told to use them by voice.


def _forget_person(days: float) -> ToolDef:
    return _renamed(FORGET_PERSON, "memory_forget_person", (
        "Forget a person for good, only when the user clearly asks you to forget everything about someone: the "
        "person and their other names, every memory about only them, their conversation turns, and their name in "
        "the memories about others (removed; those memories stay). Call it first with dry_run true and tell the "
        "user in a few words what would be forgotten; call it again with dry_run false only once they say yes. "
        "Returns the counts (memories_deleted, turns_deleted, mentions_rewritten...). To forget one thing, use "
        "memory_forget instead."))


def _pause(days: float) -> ToolDef:
    return _renamed(PAUSE_REMEMBERING, "memory_pause", (
        "Stop remembering for a while when the user asks (\"don't remember this\", \"a guest is here\", a "
        "private moment): until then you still follow the conversation but nothing is written down and "
        "memory_remember fails. It ends by itself after the minutes given (default 60). Returns the status "
        "(paused, until as epoch seconds)."))


def _resume(days: float) -> ToolDef:
    return _renamed(RESUME_REMEMBERING, "memory_resume",
                    "Remember again before a pause (memory_pause) ends, when the user asks. Returns the status.")


@functools.cache
def profile_tools(conversation_days: float) -> tuple[ToolDef, ...]:
    """The profile's tools, their descriptions saying conversation memories are kept
    ``conversation_days`` (as :func:`~.tools.tools_for`; raises ValidationError as it does)."""
    made = tuple(make(conversation_days) for make in (_search, _remember, _recall, _forget, _forget_person, _pause,
                                                      _resume))
    return (*made, MEMORY_CONTEXT)


class _ProfileTool(MemoryTool):
    """A profile tool: its definition worded for the configured retention by :func:`profile_tools`."""

    @staticmethod
    def table(conversation_days: float) -> Sequence[ToolDef]:
        return profile_tools(conversation_days)


_DEFAULT = profile_tools(DEFAULT_CONVERSATION_DAYS)


class MemorySearch(_ProfileTool):
    """``memory_search``: ``{"query", "results": [...], "count"}`` (plus a message when empty)."""

    definition = _DEFAULT[0]
    _shape = SearchMemories._shape  # the same answer as search_memories'


class MemoryRemember(_ProfileTool):
    """``memory_remember``: ``{"stored": [{"id", "content", "subjects"}], "count"}``."""

    definition = _DEFAULT[1]


class MemoryRecall(MemorySearch):
    """``memory_recall``: ``{"query", "results": [...], "count"}``, each result with ``about``."""

    definition = _DEFAULT[2]


class MemoryForget(_ProfileTool):
    """``memory_forget``: ``{"success", "id"}``."""

    definition = _DEFAULT[3]


class MemoryForgetPerson(_ProfileTool):
    """``memory_forget_person``: the counts of what went (or, ``dry_run``, would go); a
    user-bound call (``deps.memory_owner``) is refused: it reaches every user's memories."""

    definition = _DEFAULT[4]


class MemoryPause(_ProfileTool):
    """``memory_pause``: the status (``paused``, ``until``, ``seconds_left``, ``private_turns``)."""

    definition = _DEFAULT[5]


class MemoryResume(_ProfileTool):
    """``memory_resume``: the status."""

    definition = _DEFAULT[6]


#: The profile's tool classes, in its tools' order (each tool file mixes one into the app's ``Tool``).
PROFILE_CLASSES: tuple[type[MemoryTool], ...] = (MemorySearch, MemoryRemember, MemoryRecall, MemoryForget,
                                                  MemoryForgetPerson, MemoryPause, MemoryResume, MemoryContext)
PROFILE_TOOLS: tuple[str, ...] = tuple(c.definition.name for c in PROFILE_CLASSES)


def data_dir() -> Path:
    """The profile and tool files shipped with the package (``profile_data/``)."""
    return Path(str(resources.files("reachy_memory.integrations") / "profile_data"))


def default_dir() -> Path:
    """Where :func:`install` puts the files by default: ``$XDG_DATA_HOME/reachy-memory/conversation-app``."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base).expanduser() / "reachy-memory" / "conversation-app"


def env_lines(target: Path, profile: str = PROFILE_NAME) -> list[str]:
    """The environment lines (for the app's ``.env``) pointing the app at ``target``."""
    target = target.expanduser().resolve()
    return [f"{ENV_PROFILES}={target / 'profiles'}", f"{ENV_TOOLS}={target / 'tools'}", f"{ENV_PROFILE}={profile}"]


def install(target: Path | None = None, profile: str = PROFILE_NAME) -> list[str]:
    """Copy the profile (as ``<target>/profiles/<profile>/``) and the tool files (``<target>/tools/``)
    from the package, replacing earlier copies of these files (nothing else there is touched), and
    return :func:`env_lines`. Raises ConfigError for a profile name the app could not select or a
    target that cannot be written."""
    target = (target or default_dir()).expanduser()
    if not profile.isidentifier():
        raise ConfigError(f"profile name {profile!r}: use letters, digits and underscores", key="profile")
    source = data_dir()
    try:
        profile_dir, tools_dir = target / "profiles" / profile, target / "tools"
        for folder in (profile_dir, tools_dir):
            folder.mkdir(parents=True, exist_ok=True)
        for item in sorted((source / "profile").iterdir()):
            shutil.copyfile(item, profile_dir / item.name)
        for item in sorted((source / "tools").glob("*.py")):
            shutil.copyfile(item, tools_dir / item.name)
        (target / "app.env").write_text("\n".join(env_lines(target, profile)) + "\n", encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot write the conversation profile to {target}: {exc.strerror or exc}",
                          key="dir") from exc
    return env_lines(target, profile)


__all__ = ["APP_DEFAULT_TOOLS", "APP_MEMORY_TOOLS", "PROFILE_CLASSES", "PROFILE_NAME", "PROFILE_TOOLS",
           "MemoryContext", "MemoryForget", "MemoryRecall", "MemoryRemember", "MemorySearch", "data_dir",
           "default_dir", "env_lines", "install", "profile_tools"]
