"""Faces of reachy-memory for robots and language models.

* :mod:`.tools` — the one table of LLM tools (``search_memories``,
  ``store_memory``, ``forget_memory``): names, descriptions, JSON Schemas,
  argument checks and results, plus the backends they run on (the daemon
  through :class:`~reachy_memory.AsyncMemoryClient`, or a store in-process).
* :mod:`reachy_memory.mcp_server` serves that table over MCP.
* :mod:`.conversation` — the same tools as classes for Pollen's conversation app.
* :mod:`.reachy_mini` — :class:`MemoryBridge`, the control-loop-safe way for a
  Reachy Mini app to use memory (no I/O on the caller's thread).

None of these modules imports ``reachy_mini``, ``mcp`` or the conversation app.
"""
