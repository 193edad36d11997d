"""The engine: memories in memory, and the one way they change.

``store.MemoryStore`` is the facade: it opens a data directory through
:mod:`reachy_memory.storage`, embeds through :mod:`reachy_memory.embedding`,
and sends every change through one funnel (``MemoryStore._commit``: journal,
then ``state.MemoryState.apply``).  The rest of this package holds no I/O:

* ``records``: the record and op schema;
* ``state``: records, indexes and the context window, changed only by ``apply``;
* ``ingest``: checks and normalises what a caller asks to store;
* ``filters``: metadata rules and Chroma-style ``where``;
* ``lexical_index`` / ``vector_index``: BM25 and hnswlib/numpy search;
* ``ranking``: the search pipeline (candidates, fusion, bonuses, MMR);
* ``temporal``, ``supersession``, ``mentions``, ``context_text``, ``backfill``:
  time words, fact supersession, names in text, prompt text, vectors owed.
"""
