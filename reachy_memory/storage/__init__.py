"""Everything on disk: the journal, snapshots, generations, backups and files.

* ``journal``: checksummed msgpack frames, append-only, with rollback;
* ``files``: the data directory's files and the generation rules between them;
* ``generations``: the open store's journal, replay and compaction (``Storage``);
* ``restore`` / ``backup``: offline copies and putting one back, whole or not at all;
* ``export`` / ``markdown``: JSONL and markdown interchange.

``docs/FORMAT.md`` is the contract these modules keep.
"""
