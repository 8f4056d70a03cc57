"""Under plain mpiexec: rank 1 raises after init while rank 0 waits in a barrier; must not hang."""

import time

import dtms

dtms.init_process_group()
if dtms.get_rank() == 1:
    time.sleep(0.2)
    raise ValueError("rank 1 gives up")
dtms.barrier()
print("unreachable: the barrier cannot complete")
