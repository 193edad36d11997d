"""``reachy-memory mcp``: the spec's memory tools for language models, over MCP.

Serves the tool table of :mod:`reachy_memory.integrations.tools`
(spec 000's ``search_memories``, ``store_memory``, ``forget_memory`` and spec
004's people-aware ``remember`` and ``recall``) with the official
MCP SDK (extra ``mcp``: ``pip install '.[mcp]'`` in the checkout; reachy-memory is not on PyPI):

* on stdio (the default: what Claude Desktop, Cursor, ... start as a subprocess);
* with ``--http``, as streamable HTTP on ``http://127.0.0.1:PORT/mcp`` (loopback only),
  every request carrying ``Authorization: Bearer <token>``: the token is made on
  first use in a 0600 file of the private runtime directory (``--token-file``
  names another), so only the user who can read it gets in (:mod:`._http_auth`).

By default it talks to the running daemon through an
:class:`~reachy_memory.AsyncMemoryClient`; if none answers, each tool returns an
error saying so and how to start one.  With ``--data-dir`` it opens that store
in this process instead (a desktop without the daemon; the directory must not
be held by a daemon).  Every failure comes back as an MCP tool error
(``isError``) carrying the daemon's message; the server keeps serving.

Arguments are validated once, by the table's ``ToolDef.check`` (the conversation
tools' path too): the SDK's own pydantic validation is bypassed, so a model reads
the same message on both paths, and each tool is listed with the table's JSON
schema (``ToolDef.parameters_schema``).

With ``--owner NAME`` every tool call is bound to that user of the robot (the
client starting the server chooses it, never the model: no tool takes an
owner): searches and ``recall`` see NAME's memories plus shared and unscoped ones,
facts and ``store_memory``'s conversation and context memories are stored as
NAME's (a fact's ``shared: true``: the household's), ``forget_memory`` refuses
another user's own memory; see :mod:`reachy_memory.integrations.tools` for the
details. The owner is fixed for the server's life.

A write (``store_memory``, ``remember``) cut off by a daemon restart is sent again with
the ids made for it for up to ``--timeout`` seconds more (:class:`DaemonBackend`): the
model is told it was kept, or that it was not stored.

Tool descriptions state how long conversation memories are kept: the TTL of the
store opened with ``--data-dir``, else the daemon's (its ``stats`` reply, asked once at
start); with no daemon answering then, this process's configuration's
``memory.conversation_ttl_days`` (normally the file the daemon reads too; stderr
says so). The tool list is built once, so clients caching it see no change.

Threads: the MCP SDK's event loop owns the client (or, for ``--data-dir``, a
single worker thread owns the store).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from reachy_memory.config import Config
from reachy_memory.daemon.endpoint import prepare_ipc_dir, runtime_dir
from reachy_memory.daemon.http_auth import TOKEN_FILE, BearerAuth, http_token
from reachy_memory.engine.ingest import check_owner
from reachy_memory.errors import ConfigError, ReachyMemoryError, StoreLockedError, ValidationError
from reachy_memory.integrations.tools import (
    MEMORY_CONTEXT,
    TOOLS,
    Backend,
    DaemonBackend,
    LocalBackend,
    ToolDef,
    daemon_retention,
    error_text,
    local_retention,
    retention_text,
    tools_for,
)

DEFAULT_PORT = 8765
RETENTION_TIMEOUT = 2.0  # seconds to wait at start for the daemon to say its conversation TTL
INSTRUCTIONS = (
    "Long-term memory of a Reachy Mini robot. Search it before answering questions about the user, people "
    "the robot knows or earlier conversations; store lasting facts as \"fact\", today's task or situation as "
    "\"context\", notable things said as \"conversation\"; forget by id when asked to. Facts about people: "
    "remember them with their subjects ('my wife', 'Sarah') and recall them with about=...")
log = logging.getLogger("reachy_memory.mcp")


def _require_sdk() -> Any:
    try:
        from mcp.server.mcpserver import MCPServer
    except ImportError as exc:
        raise ConfigError("the MCP server needs the official MCP SDK: pip install 'mcp>=2.3,<2.4' (or, in the "
                          "reachy-memory checkout, pip install '.[mcp]')", key="mcp") from exc
    return MCPServer


class _Service:
    """The backend the tools run on; set once the server's event loop runs."""

    def __init__(self, open_backend: Callable[[], Backend]) -> None:
        self._open = open_backend
        self.backend: Backend | None = None

    def get(self) -> Backend:
        if self.backend is None:
            self.backend = self._open()  # inside the loop: the async client binds to it
        return self.backend

    async def aclose(self) -> None:
        if self.backend is not None:
            await self.backend.aclose()
            self.backend = None


def _tool_function(tool: ToolDef, service: _Service, wrap: bool) -> Callable[..., Awaitable[Any]]:
    """An async function running ``tool`` on the call's arguments as sent; errors become MCP tool errors.

    It answers a ``CallToolResult`` holding both the tool's text (:attr:`ToolDef.text`: what a
    voice model reads; an empty search says so) and the structured result (under ``result``
    when ``wrap``: the SDK's shape for a list). Its signature has no parameters (the SDK builds
    no argument model from it) and the tool's return type (the SDK derives the output schema
    from it).
    """
    from mcp.server.mcpserver.exceptions import ToolError
    from mcp_types import CallToolResult, TextContent

    async def call(**kwargs: Any) -> Any:
        try:
            result = await tool.run(service.get(), kwargs)
        except ReachyMemoryError as exc:
            raise ToolError(error_text(exc)) from exc
        return CallToolResult(content=[TextContent(type="text", text=tool.text(kwargs, result))],
                              structured_content={"result": result} if wrap else result)

    call.__signature__ = inspect.Signature(return_annotation=tool.returns)  # type: ignore[attr-defined]
    call.__name__ = call.__qualname__ = tool.name
    call.__doc__ = tool.description
    return call


@functools.cache
def _unvalidated_metadata() -> Any:
    """The SDK's ``FuncMetadata`` with ``validate_arguments`` handing the arguments over as sent.

    The SDK would otherwise validate (and coerce: ``"5"`` to 5, JSON strings to lists) against
    a pydantic model before the tool runs, and answer with pydantic's text. Here
    ``ToolDef.check`` is the one validation, as in the conversation-app tools.
    """
    from mcp.server.mcpserver.utilities.func_metadata import FuncMetadata

    class Unvalidated(FuncMetadata):
        def validate_arguments(self, arguments_to_validate: dict[str, Any]) -> dict[str, Any]:
            return dict(arguments_to_validate)

    return Unvalidated


def _sdk_tool(tool: ToolDef, service: _Service) -> Any:
    """The SDK ``Tool`` for ``tool``: listed with the table's JSON schema (``parameters_schema``),
    its arguments checked only by the table."""
    from mcp.server.mcpserver.tools import Tool
    from mcp_types import ToolAnnotations

    hints = ToolAnnotations(read_only_hint=tool.read_only, destructive_hint=tool.destructive,
                            idempotent_hint=tool.read_only, open_world_hint=False)
    wrap = Tool.from_function(_tool_function(tool, service, False), name=tool.name).fn_metadata.wrap_output
    made = Tool.from_function(_tool_function(tool, service, wrap), name=tool.name, description=tool.description,
                              annotations=hints)
    meta = made.fn_metadata
    unvalidated = _unvalidated_metadata()(arg_model=meta.arg_model, output_schema=meta.output_schema,
                                          output_model=meta.output_model, wrap_output=meta.wrap_output)
    return made.model_copy(update={"parameters": tool.parameters_schema(), "fn_metadata": unvalidated})


CONTEXT_PROMPT = "conversation_start"


def _context_prompt(service: _Service, tools: Sequence[ToolDef]) -> Any:
    """The MCP prompt a client can start a conversation with: the ``memory_context`` block (what
    the conversation app pastes at a conversation's start, from this memory)."""
    from mcp.server.mcpserver.prompts.base import Prompt

    context = next(t for t in tools if t.name == MEMORY_CONTEXT.name)

    async def conversation_start(message: str | None = None) -> str:
        try:
            result = await context.run(service.get(), {"message": message})
        except ReachyMemoryError as exc:
            return f"(the robot's memory could not be read: {error_text(exc)})"
        return f"What you remember (use it naturally, do not recite it):\n{context.text({}, result)}"

    return Prompt.from_function(conversation_start, name=CONTEXT_PROMPT, description=(
        "The robot's memory at the start of a conversation: the people it knows and the facts that matter "
        "(optionally for the user's first words), within a token budget."))


def build_server(service: _Service, tools: Sequence[ToolDef] = TOOLS) -> Any:
    """An ``MCPServer`` exposing ``tools`` on ``service``'s backend: each listed with the table's
    schema, bad arguments answered with ``ToolDef.check``'s message (as the conversation tools do)."""
    server = _require_sdk()("reachy-memory", instructions=INSTRUCTIONS, log_level="WARNING",
                            tools=[_sdk_tool(tool, service) for tool in tools])
    if any(t.name == MEMORY_CONTEXT.name for t in tools):
        server.add_prompt(_context_prompt(service, tools))
    return server


async def _serve(server: Any, service: _Service, sock: socket.socket | None, token: str | None) -> None:
    """stdio with no ``sock``; else streamable HTTP on that loopback socket, behind the token."""
    try:
        if sock is not None and token is not None:
            await _serve_http(server, sock, token)
        else:
            await server.run_stdio_async()
    finally:
        await service.aclose()


async def _serve_http(server: Any, sock: socket.socket, token: str) -> None:
    """The SDK's streamable HTTP app (with its Host/Origin check for loopback) behind
    :class:`BearerAuth`, on uvicorn as the SDK's own runner would serve it.

    Stateless, with plain JSON replies: every tool here answers one request with one reply
    (no server-sent notifications), and a client opening a connection per call (the
    conversation app does) then makes no GET event stream and no closing DELETE, and reads
    no event-stream framing (tools/bench_mcp_http.py: docs/MEASUREMENTS.md)."""
    import uvicorn

    app = BearerAuth(server.streamable_http_app(host="127.0.0.1", stateless_http=True, json_response=True), token)
    await uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", log_level="warning")).serve(sockets=[sock])


def _bind(port: int) -> socket.socket:
    """127.0.0.1:``port``, bound before anything is made or said: a port in use (or one
    below 1024 without root) is a ConfigError, not uvicorn's log line and exit 3."""
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose proto says TCP
    # (what uvicorn's own bind makes); without it every reply written as headers then body
    # waited ~40 ms for the client's delayed ACK (Nagle), a fresh connection's requests each.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own bind
    try:
        sock.bind(("127.0.0.1", port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot serve HTTP on 127.0.0.1:{port}: {exc.strerror}; choose another --port",
                          key="mcp") from exc
    return sock


def token_path(config: Config, given: str | os.PathLike[str] | None) -> Path:
    """Where the HTTP token lives: ``given``, else the private runtime directory's
    :data:`TOKEN_FILE` (that directory made 0700 if missing). Raises ConfigError."""
    if given is not None:
        return Path(given).expanduser()
    path = runtime_dir(config) / TOKEN_FILE
    prepare_ipc_dir(path)
    return path


def _daemon_days(config: Config, endpoint: str | None) -> float:
    """The conversation TTL the tool descriptions state: the daemon's, asked once at start
    (at most :data:`RETENTION_TIMEOUT` seconds); if none answers (or says), this configuration's
    (said on stderr). The tool list is built once: it does not change for the server's life."""
    days, asked = daemon_retention(config, endpoint, RETENTION_TIMEOUT)
    if not asked:
        print(f"reachy-memory mcp: no daemon said its conversation TTL (none answered yet, or an older one); "
              f"the tools say conversation memories are kept {retention_text(days)} (this configuration's "
              "memory.conversation_ttl_days)", file=sys.stderr)
    return days


def run(config: Config, *, in_process: bool = False, http: bool = False, port: int = DEFAULT_PORT,
        timeout: float = 10.0, owner: str | None = None, token_file: str | os.PathLike[str] | None = None,
        endpoint: str | None = None) -> int:
    """Serve until stdin closes (stdio) or SIGINT/SIGTERM (HTTP); returns the exit code.

    ``in_process`` opens ``config.data_dir`` here (raises StoreLockedError if a
    daemon holds it); otherwise tools talk to the daemon at ``endpoint`` (the command's
    --endpoint), else the configured one ($REACHY_MEMORY_ENDPOINT, ``server.endpoint``).
    ``owner`` binds every call to that user (raises ValidationError, before serving,
    for a name the store would not take as an owner).
    """
    import anyio

    if owner is not None:
        check_owner(owner)
    _require_sdk()
    if token_file is not None and not http:  # silently ignored, it read as if stdio were guarded too
        raise ValidationError("--token-file is for --http (stdio is private to the process that starts it)",
                              field="token_file")
    if http and not 1 <= port <= 65535:
        raise ConfigError(f"--port must be from 1 to 65535, not {port}", key="mcp")
    sock = _bind(port) if http else None
    try:
        token_at = token_path(config, token_file) if http else None
        token = http_token(token_at) if token_at is not None else None
        if in_process:
            try:
                local = LocalBackend.open(config, owner=owner)  # fail now, not at the first tool call
            except StoreLockedError as exc:  # --data-dir checks the daemon's store in every other command
                raise StoreLockedError(f"{exc.message}: for mcp, --data-dir opens the store in this process; "
                                       "to serve the running daemon's store, leave --data-dir out",
                                       **exc.fields) from exc
            service = _Service(lambda: local)
            days = local_retention(local.memory_store)
        else:
            service = _Service(lambda: DaemonBackend.from_config(config, timeout, owner=owner, endpoint=endpoint))
            days = _daemon_days(config, endpoint)
        where = f"store {config.data_dir}" if in_process else "the daemon"
        where += f" as user {owner!r}" if owner is not None else ""
        print(f"reachy-memory mcp: serving {', '.join(t.name for t in TOOLS)} on "
              f"{f'http://127.0.0.1:{port}/mcp' if http else 'stdio'} with {where}", file=sys.stderr)
        if token_at is not None:
            print(f"reachy-memory mcp: HTTP clients must send 'Authorization: Bearer <token>', the token in "
                  f"{token_at}", file=sys.stderr)
        anyio.run(_serve, build_server(service, tools_for(days)), service, sock, token)
    finally:
        if sock is not None:
            sock.close()
    return 0


def run_from_args(args: Any, config: Config) -> int:
    """What ``reachy-memory mcp`` runs: ``--data-dir`` means a store in this process; ``--owner``
    the user every call is bound to."""
    return run(config, in_process=bool(getattr(args, "data_dir", None)), http=args.http, port=args.port,
               timeout=args.timeout, owner=getattr(args, "owner", None), token_file=getattr(args, "token_file", None),
               endpoint=getattr(args, "endpoint", None))  # it was ignored: the tools asked the default daemon


__all__ = ["DEFAULT_PORT", "build_server", "run", "run_from_args"]
