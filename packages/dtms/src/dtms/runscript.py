"""Run a rank's script so that a failing rank exits at once instead of hanging in MPI_Finalize.

``python -m dtms.runscript script.py args...`` behaves like ``python script.py args...``, except that
an uncaught exception or a nonzero ``sys.exit`` on a rank of a multi-process group flushes output and
leaves with ``os._exit`` (skipping MPI_Finalize/NCCL teardown, which would wait for the healthy ranks
forever). The launcher sees the exit code and stops the gang. blurun runs every rank through it.
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys
import traceback


def _in_group() -> bool:
    """True when this process belongs to an initialised multi-process dtms group or MPI world."""
    if "dtms.world" in sys.modules:
        w = sys.modules["dtms.world"]
        if w.is_initialized() and w.get_world_size() > 1:
            return True
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        try:
            return mpi.Is_initialized() and not mpi.Is_finalized() and mpi.COMM_WORLD.Get_size() > 1
        except Exception:
            return False
    return False


def hard_exit(code: int) -> None:
    """Flush stdout/stderr and leave immediately with ``code``."""
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:
            pass
    os._exit(code)


def exit_code(code: object) -> int:
    """The status ``sys.exit(code)`` would give."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _install_exit_guard() -> None:
    """Make ``sys.exit(nonzero)`` on a rank of a multi-process group leave without MPI_Finalize.

    Under plain mpirun a rank that exits with an error code would otherwise wait in MPI_Finalize for
    peers that wait in a collective for it: the job hangs. The code is recorded by a ``sys.exit``
    wrapper and acted on at interpreter exit (after ``finally`` blocks and later ``atexit`` handlers)."""
    if getattr(sys.exit, "_dtms", False):
        return
    real_exit, last = sys.exit, {"code": 0}

    def exit(code: object = None) -> None:
        last["code"] = code if isinstance(code, int) or code is None else 1
        real_exit(code)

    def at_exit() -> None:
        code = (last["code"] or 0) & 0xFF
        if code and _in_group():
            hard_exit(code)

    exit._dtms = True  # type: ignore[attr-defined]
    sys.exit = exit
    atexit.register(at_exit)


def install_excepthook() -> None:
    """Make an uncaught exception, or ``sys.exit`` with an error code, end a rank of a multi-process
    group at once (used under plain mpirun; blurun's ranks get the same through ``main`` here)."""
    _install_exit_guard()
    prev = sys.excepthook
    if getattr(prev, "_dtms", False):
        return

    def hook(tp: type, value: BaseException, tb: object) -> None:
        prev(tp, value, tb)
        if _in_group():
            hard_exit(1)

    hook._dtms = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def main() -> None:
    if len(sys.argv) < 2:
        print("usage: python -m dtms.runscript script.py [args...]", file=sys.stderr)
        sys.exit(2)
    from .placement import apply_affinity

    apply_affinity()  # $BLUTRAIN_CPU_AFFINITY (blurun sets it and pins at spawn; other launchers may set it)
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = exit_code(e.code)
        if code != 0 and _in_group():
            hard_exit(code)
        raise
    except BaseException as e:
        from .env import LaunchError

        if isinstance(e, LaunchError):  # the launch itself is wrong (e.g. a CPU world without MPI): one line
            print(f"dtms: launch error: {e}", file=sys.stderr)
            if _in_group():
                hard_exit(1)
            raise SystemExit(1) from None
        tb = e.__traceback__  # hide this runner's and runpy's frames: show the script's own
        while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__,) or
                                  "runpy" in tb.tb_frame.f_code.co_filename):
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb)
        if _in_group():
            hard_exit(1)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
