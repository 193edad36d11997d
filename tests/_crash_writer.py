"""Child process for the crash tests: stores in a loop and reports each acknowledged id."""

import sys

from reachy_memory import Config, MemoryStore

path, start, policy = sys.argv[1], int(sys.argv[2]), sys.argv[3]
# A small compaction threshold so kills also land inside snapshot writes.
config = Config().replace("memory", path=path, compact_journal_bytes=20_000, fsync=policy)
with MemoryStore(config=config, embedder=None) as store:
    print("READY", flush=True)
    for i in range(start, start + 100_000):
        if i % 7 == 0:
            ids = [m.id for m in store.store_batch([{"content": f"batch {i} {j}", "memory_type": "fact"}
                                                   for j in range(3)])]
        else:
            ids = [store.remember_conversation(f"turn {i} about topic {i % 13}", n=i).id]
        if i % 11 == 0:
            store.forget(ids[0])
            print(f"FORGOT {ids[0]}", flush=True)  # acknowledged: must stay gone after any crash
            ids = ids[1:]
        for memory_id in ids:
            print(memory_id, flush=True)
