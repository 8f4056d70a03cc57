"""dtms NCCL all-reduce at world size 1 on one GPU: time per call (synchronised) and host launch time, 4 KiB and
64 MiB float32.

    python benchmarks/dtms_allreduce_gpu.py [--json out.json]

The NCCL backend's correctness is the `cuda`-marked tests of packages/dtms/tests/test_nccl.py.
"""

from __future__ import annotations

import json
import os
import sys
import time


def measure() -> dict:
    import cupy as cp
    import dtms

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "BLUTRAIN_RUN_ID"):
        os.environ.pop(k, None)
    pg = dtms.init_process_group("nccl")
    res = {}
    try:
        s = cp.cuda.get_current_stream()
        for nbytes in (4 << 10, 64 << 20):
            x = cp.ones(nbytes // 4, cp.float32)
            for _ in range(5):
                pg.all_reduce(x)
            s.synchronize()
            n = 200 if nbytes < (1 << 20) else 50
            t0 = time.perf_counter()
            for _ in range(n):
                pg.all_reduce(x)
            s.synchronize()
            res[f"all_reduce_{nbytes}B_eager_us"] = round((time.perf_counter() - t0) / n * 1e6, 2)
            t0 = time.perf_counter()
            for _ in range(n):
                pg.all_reduce(x)
            res[f"all_reduce_{nbytes}B_host_launch_us"] = round((time.perf_counter() - t0) / n * 1e6, 2)
            s.synchronize()
    finally:
        dtms.destroy_process_group()
    return res


if __name__ == "__main__":
    out = {"command": "python benchmarks/dtms_allreduce_gpu.py", **measure()}
    print(json.dumps(out, indent=1))
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as fh:
            json.dump(out, fh, indent=1)
