"""The engine: memories in memory, and the one way they change.

``store.MemoryStore`` is the facade: it opens a data directory (``opening``) through
:mod:`reachy_memory.storage`, embeds through :mod:`reachy_memory.embedding`, builds
its collaborators and delegates to them.  ``core.Core`` owns the state and sends
every change through one funnel (``Core.commit``: journal, then
``state.MemoryState.apply``); components get it as the narrow ``ports.Engine``.

* ``core``: the state's owner, the commit funnel, embedding, write preparation;
* ``ports``: the ``Engine`` interface components get, and a prepared write;
* ``opening``: open a directory into a Core, pick and adopt the model;
* ``search`` / ``ranking``: the search pipeline (checks, candidates, fusion, bonuses, MMR);
* ``session``: context window and named context; ``retention``: expiry, TTL, redate;
* ``maintenance``: idle-time upkeep and reindex;
* ``records``: the record and op schema;
* ``state``: records, indexes and the context window, changed only by ``apply``;
* ``ingest``: checks and normalises what a caller asks to store;
* ``filters``: metadata rules and Chroma-style ``where``;
* ``lexical_index`` / ``vector_index``: BM25 and hnswlib/numpy search;
* ``temporal``, ``supersession``, ``mentions``, ``context_text``, ``backfill``:
  time words, fact supersession, names in text, prompt text, vectors owed.
"""
