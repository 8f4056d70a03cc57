"""Bad input to dtms gives a clear error naming the culprit, on every rank, never a hang or a raw MPI error.

World-1 cases run in process (local backend); cross-rank cases run 2 real MPI processes with a time
limit (the worker is written from this file, so a hang shows up as a failed test, not a stuck suite).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from dtms import CollectiveError
from dtms.backends.local import LocalProcessGroup
from dtms.process_group import compare_signatures, signature
from dtms_testutil import clean_env, needs_mpi

# ---------- one process ----------


def test_object_dtype_refused_naming_the_argument():
    pg = LocalProcessGroup()
    with pytest.raises(CollectiveError, match="all_gather: output has dtype object, which holds Python object"):
        pg.all_gather(np.zeros(2, dtype=object), np.zeros(2, dtype=object))
    with pytest.raises(CollectiveError, match="all_reduce: tensor has dtype object"):
        pg.all_reduce(np.zeros(2, dtype=object))


def test_complex_max_min_refused():
    pg = LocalProcessGroup()
    for op in ("max", "min"):
        with pytest.raises(CollectiveError, match=f"op '{op}' is not defined for complex dtype complex64"):
            pg.all_reduce(np.ones(2, dtype=np.complex64), op=op)
    pg.all_reduce(np.ones(2, dtype=np.complex64), op="sum")  # sum stays allowed


@pytest.mark.parametrize("tag", [-1, "x", 1.5, True, 2**23])
def test_bad_tag_named(tag):
    pg = LocalProcessGroup()
    pg._size = 2  # a peer to talk to: the tag check comes before any backend call
    with pytest.raises(CollectiveError, match=r"send: tag=.* must be an integer in \[0, 2\*\*23\)"):
        pg.send(np.zeros(2), 1, tag=tag)
    with pytest.raises(CollectiveError, match=r"recv: tag=.* must be an integer"):
        pg.recv(np.zeros(2), 1, tag=tag)


def test_signature_names_both_collectives_and_new_group_ranks():
    a = np.zeros(3)
    sigs = np.stack([signature("all_reduce", "sum", a), signature("barrier", None, np.empty(0, np.uint8))])
    with pytest.raises(CollectiveError, match="rank 0 called all_reduce but rank 1 called barrier"):
        compare_signatures("all_reduce", sigs, 0, a.dtype)
    ids = np.array([0, 1])
    sigs = np.stack([signature("new_group", None, ids, extra=11), signature("new_group", None, ids, extra=12)])
    with pytest.raises(CollectiveError, match="new_group: arguments differ across ranks: rank 1 passed other ranks"):
        compare_signatures("new_group", sigs, 1, ids.dtype)


# ---------- two MPI ranks ----------

WORKER = textwrap.dedent('''
    import json, sys
    import numpy as np
    import dtms
    from blutensor import nn
    from dtms import CollectiveError
    from dtms.parallel import DDP, FSDP

    pg = dtms.init_process_group()
    r = pg.rank()
    got = {}

    def expect(name, fn):
        try:
            fn()
            got[name] = "no error"
        except CollectiveError as e:
            got[name] = str(e)
        except Exception as e:
            got[name] = f"WRONG {type(e).__name__}: {e}"

    expect("barrier_vs_all_reduce", lambda: pg.all_reduce(np.zeros(3)) if r == 0 else pg.barrier())
    expect("new_group_vs_all_reduce", lambda: pg.all_reduce(np.zeros(3)) if r == 0 else pg.new_group([0, 1]))
    expect("new_group_ranks_differ", lambda: pg.new_group([0, 1] if r == 0 else [1]))
    expect("recv_too_small", lambda: pg.send(np.zeros(5), 1) if r == 0 else pg.recv(np.zeros(3), 0))
    expect("recv_too_large", lambda: pg.send(np.zeros(2), 1) if r == 0 else pg.recv(np.zeros(3), 0))
    pg.barrier()  # the truncated receive left nothing behind: the group still works
    b = np.array([r == 0, False, True])
    pg.all_reduce(b, op="sum")
    c = np.array([r == 0, False, True])
    pg.all_reduce(c, op="prod")
    got["bool"] = [b.tolist(), c.tolist()]

    class M(nn.Module):
        def __init__(self, d_out, extra):
            super().__init__()
            self.fc = nn.Linear(4, d_out, dtype="float64")
            if extra:
                self.head = nn.Linear(4, 2, dtype="float64")

    expect("ddp_shape", lambda: DDP(M(3 if r == 0 else 5, False), pg))
    expect("ddp_count", lambda: DDP(M(3, r == 1), pg))
    expect("fsdp_shape", lambda: FSDP(M(3 if r == 0 else 5, False), pg))
    expect("ddp_same_ok", lambda: DDP(M(3, True), pg))
    x = np.arange(3.0)
    pg.all_reduce(x)
    got["after"] = x.tolist()
    json.dump(got, open(f"{sys.argv[1]}/rank{r}.json", "w"))
    dtms.destroy_process_group()
''')


def _mpi(n, script, *args, timeout=60.0):
    from dtms.mpi import mpiexec_command, mpiexec_env

    t0 = time.monotonic()
    p = subprocess.run(mpiexec_command(n, [sys.executable, str(script), *args]), env=mpiexec_env(clean_env()),
                       capture_output=True, text=True, timeout=timeout)
    return p, time.monotonic() - t0


@needs_mpi
@pytest.mark.mpi
def test_cross_rank_mistakes_raise_on_every_rank(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    p, _ = _mpi(2, script, str(tmp_path))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for r in (0, 1):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert "rank 0 called all_reduce but rank 1 called barrier" in got["barrier_vs_all_reduce"]
        assert "rank 0 called all_reduce but rank 1 called new_group" in got["new_group_vs_all_reduce"]
        assert "new_group: arguments differ across ranks: rank 1 passed other ranks" in got["new_group_ranks_differ"]
        assert "parameter #0 is shape (3, 4) float64 on rank 0 but shape (5, 4) float64 on rank 1" in got["ddp_shape"]
        assert got["ddp_shape"].startswith("DistributedDataParallel:")
        assert "parameter counts {0: 2, 1: 4}" in got["ddp_count"], got["ddp_count"]
        assert got["fsdp_shape"].startswith("FullyShardedDataParallel: the model's parameters differ across ranks")
        assert got["ddp_same_ok"] == "no error"
        # PyTorch's bool semantics: sum/max = logical or, prod/min = logical and
        assert got["bool"] == [[True, False, True], [False, False, True]]
        assert got["after"] == [0.0, 2.0, 4.0]
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r0["recv_too_small"] == "no error"
    assert r1["recv_too_small"].startswith("recv from rank 0 (tag 0) into (3,) float64 (24 bytes): MPI error")
    # a shorter message would leave the buffer partly unwritten: an error, not a silent partial receive
    assert r0["recv_too_large"] == "no error"
    assert r1["recv_too_large"] == ("recv from rank 0 (tag 0) into (3,) float64 (24 bytes): the sender's message is "
                                    "16 bytes, this buffer 24; send and receive the same shape and dtype")


EXITING = textwrap.dedent('''
    import sys
    import numpy as np
    import dtms

    pg = dtms.init_process_group()
    if sys.argv[1] == "exit" and pg.rank() == 1:
        sys.exit(3)                       # rank 0 waits in all_reduce: MPI_Finalize on rank 1 would hang
    x = np.zeros(5 if pg.rank() == 1 else 4)
    pg.all_reduce(x)                      # "mismatch": uncaught CollectiveError on both ranks
    print("unreachable")
''')


@needs_mpi
@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["exit", "mismatch"])
def test_failing_rank_under_plain_mpiexec_ends_the_job(mode, tmp_path):
    script = tmp_path / "exiting.py"
    script.write_text(EXITING)
    p, took = _mpi(2, script, mode, timeout=60)
    assert p.returncode != 0 and "unreachable" not in p.stdout and took < 30
    if mode == "mismatch":
        assert "CollectiveError: all_reduce: shape/dtype mismatch across ranks: rank 0 passed shape (4,)" in p.stderr
    else:
        assert p.returncode == 3 or "exit code" in (p.stdout + p.stderr).lower()


TIMING_OUT = textwrap.dedent('''
    import time
    import numpy as np
    import dtms

    pg = dtms.init_process_group()
    if pg.rank() == 1:
        time.sleep(45)                    # never reaches the all_reduce in time
    pg.all_reduce(np.zeros(3))
    print("unreachable")
''')


@needs_mpi
@pytest.mark.mpi
def test_collective_timeout_env_turns_a_hang_into_an_error(tmp_path):
    from dtms.mpi import mpiexec_command, mpiexec_env

    script = tmp_path / "late.py"
    script.write_text(TIMING_OUT)
    t0 = time.monotonic()
    p = subprocess.run(mpiexec_command(2, [sys.executable, str(script)]),
                       env=mpiexec_env(clean_env(BLUTRAIN_DTMS_TIMEOUT="1.5")), capture_output=True, text=True,
                       timeout=60)
    assert p.returncode != 0 and time.monotonic() - t0 < 30, p.stderr[-2000:]
    assert ("CollectiveError: all_reduce (cross-rank argument check): not complete after 1.5s on rank 0 of a "
            "group of 2 (BLUTRAIN_DTMS_TIMEOUT=1.5)") in p.stderr, p.stderr[-2000:]


@pytest.mark.parametrize(("name", "value", "fragment"), [
    ("BLUTRAIN_DTMS_TIMEOUT", "abc", "BLUTRAIN_DTMS_TIMEOUT='abc' must be a positive number of seconds"),
    ("BLUTRAIN_DTMS_TIMEOUT", "-1", "BLUTRAIN_DTMS_TIMEOUT='-1' must be a positive number"),
    ("BLUTRAIN_DTMS_CHECK", "maybe", "BLUTRAIN_DTMS_CHECK='maybe' is neither 1 (on) nor 0 (off)"),
])
def test_bad_env_values_named(monkeypatch, name, value, fragment):
    from dtms.process_group import checks_enabled, collective_timeout

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        collective_timeout() if name == "BLUTRAIN_DTMS_TIMEOUT" else checks_enabled(True)


def test_env_defaults_unchanged(monkeypatch):
    from dtms.process_group import checks_enabled, collective_timeout

    monkeypatch.delenv("BLUTRAIN_DTMS_TIMEOUT", raising=False)
    monkeypatch.delenv("BLUTRAIN_DTMS_CHECK", raising=False)
    assert collective_timeout() is None and checks_enabled(True) and not checks_enabled(False)
    monkeypatch.setenv("BLUTRAIN_DTMS_CHECK", "0")
    monkeypatch.setenv("BLUTRAIN_DTMS_TIMEOUT", "30")
    assert not checks_enabled(True) and collective_timeout() == 30.0


def test_unknown_backend_names_its_source(monkeypatch):
    import dtms

    for k in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("BLUTRAIN_DIST_BACKEND", "gloo")
    with pytest.raises(ValueError, match=r"unknown backend 'gloo' \(from the \$BLUTRAIN_DIST_BACKEND\)"):
        dtms.init_process_group()
    assert not dtms.is_initialized()


@pytest.mark.parametrize(("args", "fragment"), [
    (["--grace-period", "-1"], "need --grace-period >= 0 and --tail-lines >= 0 (got -1.0, "),
    (["--tail-lines", "-3"], "need --grace-period >= 0 and --tail-lines >= 0 (got 5.0, -3)"),
    (["--master-port", "99999"], "--master-port 99999 is not a TCP port"),
])
def test_blurun_bad_numbers_refused_before_start(tmp_path, args, fragment):
    from dtms_testutil import run_blurun

    script = tmp_path / "ok.py"
    script.write_text("print('started')\n")
    p = run_blurun(*args, "--nproc-per-node", "1", str(script), cwd=tmp_path, timeout=30)
    assert p.returncode == 2 and fragment in p.stderr and "started" not in p.stdout, p.stderr


def test_ddp_fsdp_wrong_group_and_bucket_named():
    from blutensor import nn
    from dtms.parallel import DDP, FSDP

    with pytest.raises(TypeError, match="DistributedDataParallel: process_group must be a dtms ProcessGroup, got int"):
        DDP(nn.Linear(2, 2), 5)
    with pytest.raises(TypeError, match="FullyShardedDataParallel: process_group must be a dtms ProcessGroup, got str"):
        FSDP(nn.Linear(2, 2), "world")
    for cap in (float("nan"), float("inf"), 0):
        with pytest.raises(ValueError, match="bucket_cap_mb must be a positive finite number"):
            DDP(nn.Linear(2, 2), LocalProcessGroup(), bucket_cap_mb=cap)
