"""Rendezvous through blurun's store without a process group: argv = OUT_DIR.

Each rank adds itself to a counter, waits until every rank has, and writes what it saw.
"""

import json
import os
import sys

import dtms

info = dtms.detect_launch()
store = dtms.get_store()
store.set(f"hello/{info.rank}", f"rank {info.rank} on node {os.environ['GROUP_RANK']}")
store.add("arrived", 1)
store.wait([f"hello/{r}" for r in range(info.world_size)], timeout=30)
seen = [store.get(f"hello/{r}").decode() for r in range(info.world_size)]
with open(os.path.join(sys.argv[1], f"rank{info.rank}.json"), "w") as f:
    json.dump({"rank": info.rank, "local": info.local_rank, "world": info.world_size, "seen": seen}, f)
