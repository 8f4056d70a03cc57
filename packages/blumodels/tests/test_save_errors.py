"""An OS error while a checkpoint is written (disk full, read-only directory, file too big) ends `blutrain train` with
one line naming the file and the committed step that was kept, never a traceback; nothing of the failed save is
left and the kept step resumes. File too big is real (RLIMIT_FSIZE in a child process); disk full and read-only
are injected at the checkpoint's write (as root, a read-only mode would not stop the write)."""

import contextlib
import io
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from blumodels.checkpoint import format as fmt
from blumodels.checkpoint.manager import CheckpointManager
from models_helpers import micro_data

HERE = Path(__file__).parent

_RUN = """
import contextlib, errno, json, sys
from blumodels import cli
from blumodels.checkpoint import format as fmt
from models_helpers import micro_config
out, stop, async_, fail = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
cfg = micro_config(None, steps=8, checkpoint_interval=2, eval_interval=0, async_checkpoint=async_)
cli.resolve_config = lambda args: cfg
if fail != "none":
    real = fmt.atomic_write

    @contextlib.contextmanager
    def failing(path):
        with real(path) as f:
            if "step_00000006" in path.name:  # the checkpoint of step 6 meets the fault
                code = {"ENOSPC": errno.ENOSPC, "EROFS": errno.EROFS}[fail]
                raise OSError(code, {"ENOSPC": "No space left on device", "EROFS": "Read-only file system"}[fail],
                              str(path))
            yield f

    fmt.atomic_write = failing
args = ["train", "--out", out, "--quiet", "--stop-at", str(stop)] + (["--resume"] if stop > 4 else [])
sys.exit(cli.main(args))
"""


def _subprocess(out, stop, fsize):
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG instead of a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.run([sys.executable, "-c", _RUN, str(out), str(stop), "0", "none"], capture_output=True,
                          text=True, timeout=120, cwd=str(HERE), preexec_fn=limit,
                          env={**os.environ, "PYTHONPATH": str(HERE)})


def _in_process(out, stop, fail="none", async_=False):
    """The same script in this process (no interpreter start-up): (exit code, stderr)."""
    err = io.StringIO()
    argv, sys.argv = sys.argv, ["-c", str(out), str(stop), "1" if async_ else "0", fail]
    from blumodels import cli

    real, resolve = fmt.atomic_write, cli.resolve_config
    try:
        with contextlib.redirect_stderr(err):
            try:
                exec(compile(_RUN, "save_errors_run", "exec"), {"__name__": "__run__"})
            except SystemExit as e:
                return e.code, err.getvalue()
    finally:
        sys.argv, fmt.atomic_write, cli.resolve_config = argv, real, resolve
    raise AssertionError("the run did not exit")


@pytest.fixture(scope="module")
def first_half(tmp_path_factory):
    out = tmp_path_factory.mktemp("save") / "run"
    micro_data()
    code, err = _in_process(out, 4)  # steps 0-3: committed checkpoints of steps 2 and 4
    assert code == 0, err[-2000:]
    return out


@pytest.mark.parametrize("fault,async_", [("EFBIG", False), ("ENOSPC", False), ("ENOSPC", True), ("EROFS", False)])
def test_save_error_is_one_line_naming_the_file_and_the_kept_step(tmp_path, first_half, fault, async_):
    out = tmp_path / "run"
    shutil.copytree(first_half, out)
    ck = out / "checkpoints"
    if fault == "EFBIG":
        size = max(p.stat().st_size for p in ck.glob("*.safetensors"))
        r = _subprocess(out, 8, size // 2)
        code, stderr = r.returncode, r.stderr
    else:
        code, stderr = _in_process(out, 8, fault, async_)
    lines = [x for x in stderr.splitlines() if x.strip() and not x.startswith("[blutrain]")]
    assert code == 1 and "Traceback" not in stderr and len(lines) == 1, stderr[-2000:]
    why = {"EFBIG": "File too large (the file size limit, ulimit -f, is below the checkpoint's size)",
           "ENOSPC": "No space left on device", "EROFS": "Read-only file system"}[fault]
    assert lines[0] == (f"blutrain: error: checkpoint {ck / 'step_00000006.rank0.safetensors'}: could not save step "
                        f"6: {why}; nothing of this save was kept, the committed checkpoint of step 4 is kept")
    m = CheckpointManager(ck, world_size=1)
    assert m.committed_steps()[-1] == 4 and not list(ck.glob("step_00000006*")) and not list(ck.glob(".step_*"))
    if fault == "ENOSPC" and not async_:  # the kept step resumes and the run finishes
        code, stderr = _in_process(out, 8)
        assert code == 0, stderr[-2000:]
        steps = [json.loads(x)["step"] for x in (out / "log.jsonl").read_text().splitlines()]
        assert steps == list(range(8))
