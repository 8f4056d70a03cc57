"""Worker for blurun tests: argv = PID_DIR MODE [BAD_RANK]; MODE ok | raise | kill | exit3 | hang.

Every rank records its pid, checks an all-reduce, prints to stdout and stderr; the bad rank then
fails in the chosen way while the others block in a collective (so only teardown can end them).
"""

import os
import signal
import sys
import time

import dtms
import numpy as np


def main() -> None:
    pid_dir, mode = sys.argv[1], sys.argv[2]
    bad = int(sys.argv[3]) if len(sys.argv) > 3 else -1
    dtms.init_process_group()
    r, w = dtms.get_rank(), dtms.get_world_size()
    with open(os.path.join(pid_dir, f"pid{r}"), "w") as f:
        f.write(str(os.getpid()))
    x = np.full(3, float(r))
    dtms.all_reduce(x)
    assert x[0] == w * (w - 1) / 2
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                          "MASTER_ADDR", "BLUTRAIN_RUN_ID")}
    print(f"hello from rank {r} of {w} backend={dtms.get_backend()} env={env}")
    print(f"stderr line of rank {r}", file=sys.stderr)
    store = dtms.get_store()
    if store is not None:
        store.add("arrived", 1)
    if mode == "ok":
        dtms.barrier()
        return
    if mode == "hang":
        dtms.barrier()
        print("all ranks hanging", flush=True)
        time.sleep(60)
    if r == bad:
        time.sleep(0.3)
        if mode == "raise":
            raise RuntimeError(f"deliberate failure on rank {r}")
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "exit3":
            sys.exit(3)
    # the healthy ranks wait in a collective that will never complete
    dtms.barrier()
    time.sleep(60)


if __name__ == "__main__":
    main()
