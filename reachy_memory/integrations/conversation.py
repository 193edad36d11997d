"""Memory tools for Pollen's Reachy Mini conversation app (duck-typed).

The app's tools are classes with ``name``, ``description``,
``parameters_schema`` (JSON Schema), ``spec()`` and
``async __call__(self, deps, **kwargs) -> dict``; its dispatcher parses the
model's JSON arguments and runs ``await tool(deps, **args)`` without checking
them against the schema.  :class:`SearchMemories`, :class:`StoreMemory` and
:class:`ForgetMemory` follow that interface without importing the app; they are
generated from the one tool table (:mod:`.tools`), so they match the MCP tools.

Plugging them into the app: ``reachy-memory conversation-profile install`` puts a ready
profile and one tool file per tool where the app looks (:mod:`.conversation_profile`, whose
tools are these under names the app's own tools do not use; ``docs/ROBOT.md``). A tool file
defines one subclass mixing a class of this module (or of that one) into the app's ``Tool``::

    from reachy_mini_conversation_app.tools.core_tools import Tool
    from reachy_memory.integrations.conversation import SearchMemories

    class SearchMemoriesTool(SearchMemories, Tool):
        pass

Descriptions: an instance's ``description`` and ``parameters_schema`` (what ``spec()``
sends) state how long conversation memories are kept, read when the tool is made: a
given in-process store's ``memory.conversation_ttl_days``, else the daemon's (asked once
per process and endpoint, at most a second; a missing ipc socket is not waited for),
else, with no daemon answering yet, the configuration's own. The class attributes keep
the default configuration's text.

Behaviour the app relies on:

* bad arguments and memory errors come back as ``{"error": "..."}`` (the
  dispatcher's own convention, at most :data:`MAX_ERROR_CHARS` characters), never
  as exceptions; the dispatcher passes ``{}`` for arguments that are not a JSON
  object (a "required" error here); a key it adds (``tool_manager``:
  :data:`DISPATCHER_KEYS`) is ignored, any other key the tool does not take (even
  ``deps`` or ``self``) is refused with a message naming the ones it takes (the
  schema says ``additionalProperties: false``); a result must survive ``json.dumps``
  (the app sends it so);
* the memory used is, in order: the ``backend`` given to the constructor,
  ``deps.memory`` if the app provides one (a :class:`~.tools.Backend` or an
  :class:`~reachy_memory.AsyncMemoryClient`), else one daemon client per event
  loop, configured by ``$REACHY_MEMORY_CONFIG`` / ``$REACHY_MEMORY_ENDPOINT``.

The current user (who is speaking; the app knows it from face or voice
recognition, the model never chooses it): the ``owner`` given to the constructor,
else ``deps.memory_owner`` read at each call (the app sets it when another person
starts talking; None or absent: no user), else the backend's own ``owner``, if any.
With a user, each call runs on ``backend.for_owner(user)`` (a view of the same
client: tools on one loop may serve different users at once); what that scopes is
described in :mod:`.tools` (searches, facts, and ``conversation``/``context``
memories from ``store_memory``: all stored as the user's). A backend without ``for_owner`` (a custom one)
cannot be scoped: the call answers an error rather than seeing every user's
memories. No user means every user's memories, as before; an app that wants an
unrecognised speaker to see only household and unscoped memories binds an owner
such as ``"guest"``::

    deps.memory_owner = "alice"   # the recognised speaker; later "bob", or "guest"
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from reachy_memory.client import AsyncMemoryClient
from reachy_memory.config import Config, load_config
from reachy_memory.engine.ingest import check_owner
from reachy_memory.errors import ConfigError, ReachyMemoryError
from reachy_memory.integrations.tools import (
    DEFAULT_CONVERSATION_DAYS,
    FORGET_MEMORY,
    FORGET_PERSON,
    MAX_ERROR_CHARS,
    MEMORY_CONTEXT,
    PAUSE_REMEMBERING,
    RECALL,
    REMEMBER,
    RESUME_REMEMBERING,
    SEARCH_MEMORIES,
    STORE_MEMORY,
    Backend,
    DaemonBackend,
    ToolDef,
    daemon_retention,
    error_text,
    local_retention,
    tools_for,
)

DEFAULT_TIMEOUT = 5.0
#: Keys the app's dispatcher may add to a call's arguments (its background manager, for its own
#: system tools in later versions): ignored; any other key no tool takes is refused.
DISPATCHER_KEYS = frozenset({"tool_manager"})
# One daemon client per event loop: an asyncio ZeroMQ socket belongs to the loop it runs on.
_DEFAULT_BACKENDS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, DaemonBackend] = weakref.WeakKeyDictionary()


def _default_backend(config: Config | None) -> DaemonBackend:
    loop = asyncio.get_running_loop()
    if config is not None:
        return DaemonBackend.from_config(config, DEFAULT_TIMEOUT)
    backend = _DEFAULT_BACKENDS.get(loop)
    if backend is None:
        backend = _DEFAULT_BACKENDS[loop] = DaemonBackend.from_config(load_config(), DEFAULT_TIMEOUT)
    return backend


async def aclose_default() -> None:
    """Close this event loop's shared daemon client (call before the loop ends: an
    open ZeroMQ socket would keep the process from exiting)."""
    backend = _DEFAULT_BACKENDS.pop(asyncio.get_running_loop(), None)
    if backend is not None:
        await backend.aclose()


class MemoryTool:
    """A conversation-app tool made from one :class:`~.tools.ToolDef`."""

    definition: ClassVar[ToolDef]
    name: ClassVar[str]
    description: str  # the class's: the default retention; an instance's: its own (``__init__``)
    parameters_schema: dict[str, Any]  # as description: the class's, or the instance's own

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        definition = cls.__dict__.get("definition")
        if definition is not None:  # the three below; an app's mix-in subclass inherits them
            cls.name, cls.description = definition.name, definition.description
            cls.parameters_schema = definition.parameters_schema()

    def __init__(self, backend: Backend | AsyncMemoryClient | None = None, *, config: Config | None = None,
                 owner: str | None = None) -> None:
        """The app calls ``cls()``; tests and custom apps may pass a backend, a config, and the
        user this instance serves (``owner``, over ``deps.memory_owner``). Raises
        ValidationError for a bad owner."""
        self._backend = _as_backend(backend) if backend is not None else None
        self._config = config
        self._owner = None if owner is None else check_owner(owner)
        days = _conversation_days(self._backend, config)
        if days != DEFAULT_CONVERSATION_DAYS:  # the class's text says the default retention
            described = _described(self.definition, days, self.table)
            self.description, self.parameters_schema = described.description, described.parameters_schema()

    @staticmethod
    def table(conversation_days: float) -> Sequence[ToolDef]:
        """The tool table the definition comes from, worded for a conversation TTL."""
        return tools_for(conversation_days)

    def spec(self) -> dict[str, Any]:
        """The function spec the app sends to the model."""
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters_schema}

    def _backend_for(self, deps: Any) -> Backend:
        """The backend for this call, bound to the current user if there is one. Raises
        ValidationError for a bad ``deps.memory_owner``, ConfigError for a backend that
        cannot be bound."""
        backend = self._chosen_backend(deps)
        owner = self._owner if self._owner is not None else getattr(deps, "memory_owner", None)
        if owner is None:
            return backend
        for_owner = getattr(backend, "for_owner", None)
        if for_owner is None:  # refuse: unscoped, it would show the model every user's memories
            raise ConfigError(f"the memory backend {type(backend).__name__} cannot be bound to a user (it has no "
                              "for_owner): use a DaemonBackend or a LocalBackend", key="memory_owner")
        return for_owner(owner)  # type: ignore[no-any-return]

    def _chosen_backend(self, deps: Any) -> Backend:
        if self._backend is not None:
            return self._backend
        supplied = getattr(deps, "memory", None)
        if supplied is not None:
            return _as_backend(supplied)
        if self._config is not None:  # a private client, kept for this instance's loop
            self._backend = _default_backend(self._config)
            return self._backend
        return _default_backend(None)

    async def __call__(self, deps: Any, /, **kwargs: Any) -> dict[str, Any]:
        """Run the tool; errors are returned as ``{"error": error_text(exc)}``.

        ``deps`` is positional-only, so a model's argument named ``deps`` or
        ``self`` lands in ``kwargs`` (and is ignored) instead of raising TypeError.
        """
        try:
            result = await self.definition.run(self._backend_for(deps), kwargs, ignored=DISPATCHER_KEYS)
        except ReachyMemoryError as exc:
            return {"error": error_text(exc)}
        return self._shape(kwargs, result)

    def _shape(self, kwargs: dict[str, Any], result: Any) -> dict[str, Any]:
        return dict(result)

    async def aclose(self) -> None:
        """Close a client this instance made for itself (not a shared or given one)."""
        if self._config is not None and self._backend is not None:
            await self._backend.aclose()
            self._backend = None


def _described(definition: ToolDef, days: float, table: Callable[[float], Sequence[ToolDef]] = tools_for) -> ToolDef:
    """``definition`` as ``table`` (:func:`~.tools.tools_for`, or another tool table made the same
    way) words it for a ``days`` conversation TTL."""
    return next(t for t in table(days) if t.name == definition.name)


def _conversation_days(backend: Backend | None, config: Config | None) -> float:
    """The conversation TTL a tool's description states: an in-process store's; else the
    daemon's (the given backend's, or the one ``config``, else ``$REACHY_MEMORY_CONFIG``,
    names), asked once per process and endpoint (see :func:`~.tools.daemon_retention`),
    that configuration's own if none answers; the default if the configuration is
    unreadable (the calls will say why). Never raises."""
    store = getattr(backend, "memory_store", None)
    if store is not None:
        return local_retention(store)
    if isinstance(backend, DaemonBackend):
        return daemon_retention(backend.client.config, backend.client.endpoint)[0]
    try:
        return daemon_retention(config if config is not None else load_config())[0]
    except ReachyMemoryError:
        return DEFAULT_CONVERSATION_DAYS


def _as_backend(obj: Backend | AsyncMemoryClient) -> Backend:
    return DaemonBackend(obj, own=False) if isinstance(obj, AsyncMemoryClient) else obj


class SearchMemories(MemoryTool):
    """``search_memories``: returns ``{"query", "results": [...], "count"}`` (plus a hint when empty)."""

    definition = SEARCH_MEMORIES

    def _shape(self, kwargs: dict[str, Any], result: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"query": kwargs.get("query"), "results": result, "count": len(result)}
        if not result:
            out["message"] = "Nothing relevant is remembered."
        return out


class StoreMemory(MemoryTool):
    """``store_memory``: returns ``{"id", "content", "type", "created_at"}``."""

    definition = STORE_MEMORY


class ForgetMemory(MemoryTool):
    """``forget_memory``: returns ``{"success", "id"}``."""

    definition = FORGET_MEMORY


class Remember(MemoryTool):
    """``remember`` (spec 004): returns ``{"stored": [{"id", "content", "subjects"}], "count"}``."""

    definition = REMEMBER


class Recall(MemoryTool):
    """``recall`` (spec 004): returns ``{"query", "results": [...], "count"}``, each result with ``about``."""

    definition = RECALL

    def _shape(self, kwargs: dict[str, Any], result: Any) -> dict[str, Any]:
        return SearchMemories._shape(self, kwargs, result)  # type: ignore[arg-type]


# -- the household's tools (docs/HOUSEHOLD.md) ------------------------------------------------


class ForgetPerson(MemoryTool):
    """``forget_person``: returns the counts of what went (or, ``dry_run``, would go)."""

    definition = FORGET_PERSON


class PauseRemembering(MemoryTool):
    """``pause_remembering``: returns the status (``paused``, ``until``, ``seconds_left``)."""

    definition = PAUSE_REMEMBERING


class ResumeRemembering(MemoryTool):
    """``resume_remembering``: returns the status."""

    definition = RESUME_REMEMBERING


HOUSEHOLD_TOOL_CLASSES: tuple[type[MemoryTool], ...] = (ForgetPerson, PauseRemembering, ResumeRemembering)



class MemoryContext(MemoryTool):
    """``memory_context``: returns ``{"text", "tokens", "people", "memories", "left_out"}`` (``text``:
    the block to read, empty when nothing is remembered)."""

    definition = MEMORY_CONTEXT


#: The tools in the specs' order (000's three, then 004's two), then the context block, then
#: the household's.
TOOL_CLASSES: tuple[type[MemoryTool], ...] = (SearchMemories, StoreMemory, ForgetMemory, Remember, Recall,
                                              MemoryContext, *HOUSEHOLD_TOOL_CLASSES)

#: Lines for a profile's ``tools.txt`` (each names the profile module holding one tool; later
#: app versions list tools in ``default_tools`` of a ``profile.md`` instead: ``docs/ROBOT.md``).
TOOLS_TXT = "\n".join(["# reachy-memory: long-term memory", *(c.definition.name for c in TOOL_CLASSES)]) + "\n"


def app_tool_classes(tool_base: type) -> list[type]:
    """Subclasses of the app's ``Tool`` base (so its registry finds them), one per memory tool.

    Keep the returned list referenced (a module global): the app (at its commit 8c3005a)
    discovers tools through ``Tool.__subclasses__()``, which does not keep classes alive.
    Later app versions register only the classes defined in a tool's own file, which
    these are not: there, use one file per tool as in ``docs/ROBOT.md``.
    """
    return [type(c.__name__, (c, tool_base), {"__module__": __name__}) for c in TOOL_CLASSES]


__all__ = ["DISPATCHER_KEYS", "HOUSEHOLD_TOOL_CLASSES", "MAX_ERROR_CHARS", "TOOLS_TXT", "TOOL_CLASSES", "ForgetMemory",
           "ForgetPerson", "MemoryContext", "MemoryTool", "PauseRemembering", "Recall", "Remember", "ResumeRemembering",
           "SearchMemories", "StoreMemory",
           "aclose_default", "app_tool_classes", "error_text"]
