"""Worker without a process group (blurun --launcher direct on CPU): argv = PID_DIR BAD_RANK CODE.

Prints its launch environment; rank BAD_RANK exits with CODE after a moment, the others sleep.
"""

import os
import sys
import time

pid_dir, bad, code = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rank = int(os.environ["RANK"])
with open(os.path.join(pid_dir, f"pid{rank}"), "w") as f:
    f.write(str(os.getpid()))
print("env", rank, os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"], os.environ.get("CUDA_VISIBLE_DEVICES"))
print(f"plain stderr {rank}", file=sys.stderr)
if rank == bad:
    time.sleep(0.3)
    sys.exit(code)
time.sleep(60)
