"""Run in a child process by tests/test_conversation_profile.py: the conversation app's own
loader (``reachy_mini_conversation_app.tools.core_tools``, importable here) loads the
installed profile with the app's default tools beside it, then each memory tool is
dispatched as the app dispatches a model's call. Prints one JSON object on stdout:
``{"registered": [...], "errors": [log lines], "results": {tool: result}}``.

argv: the installed directory (``conversation-profile install --dir``), then a JSON object
of calls ``{tool: arguments}``, run in its order. The environment names the daemon
($REACHY_MEMORY_CONFIG) and the app's profile (REACHY_MINI_*), set by the test.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from typing import Any


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


async def _run(calls: dict[str, Any]) -> dict[str, Any]:
    from reachy_mini_conversation_app.tools import core_tools

    from reachy_memory.integrations.conversation import aclose_default

    deps = core_tools.ToolDependencies(reachy_mini=None, movement_manager=None)  # type: ignore[arg-type]
    try:
        return {name: await core_tools.dispatch_tool_call(name, json.dumps(args), deps) for name, args in calls.items()}
    finally:
        await aclose_default()


def main() -> None:
    errors = _Errors()
    logging.getLogger().addHandler(errors)
    logging.getLogger().setLevel(logging.INFO)
    from reachy_mini_conversation_app.tools import core_tools

    core_tools.initialize_tools()
    registered = sorted(core_tools.ALL_TOOLS)  # 0.8 has no get_tools()
    results = asyncio.run(_run(json.loads(sys.argv[2])))
    print(json.dumps({"registered": registered, "errors": errors.lines, "results": results}, default=str))


if __name__ == "__main__":
    main()
