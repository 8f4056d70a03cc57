"""Fault matrix of the Trainer's run directory (CPU ranks, each case under a timeout): a rank killed at every
point of a checkpoint save with keep_checkpoints = 1 never leaves the run without a common checkpoint and the
resumed run is bit-exact with an uninterrupted one; a second trainer on a running job's directory is refused by
name; preemption saves; the orchestrator is told why a run ended."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from blumodels.checkpoint import manager as mgr_mod
from blumodels.checkpoint.manager import CheckpointManager
from blumodels.config import ConfigError
from blumodels.runlock import RunLock, RunLockError
from blumodels.trainer import NonFiniteError, Trainer
from models_helpers import micro_config, micro_data

HERE = Path(__file__).parent
WORKER = HERE / "fault_worker.py"


# ------------------------------------------------------------------ every point of a save, two ranks in one process
class _Crash(BaseException):
    """A rank's process ending at this point (nothing after it runs)."""


POINTS = ("write", "verify", "receipt", "commit", "prune")


def _arm(monkeypatch, point, target):
    """Make ``target``'s next save stop at ``point``."""
    def at(what):
        if what == point:
            monkeypatch.undo()
            raise _Crash(point)

    orig_json, orig_load, orig_save = (CheckpointManager._write_json, mgr_mod.verify_checkpoint,
                                       mgr_mod.save_checkpoint)

    def save(path, tensors, meta):
        if path.name.startswith(f"step_{meta['step']:08d}.rank{target.rank}"):
            at("write")
        return orig_save(path, tensors, meta)

    def verify(path):
        if target.rank == int(path.name.split(".rank")[1].split(".")[0]):
            at("verify")
        return orig_load(path)

    def write_json(self, path, obj):
        if self is target:
            at("receipt" if path.name.endswith(".ok") else "commit")
        return orig_json(self, path, obj)

    orig_prune = CheckpointManager.prune

    def prune(self):
        if self is target:
            at("prune")
        return orig_prune(self)

    monkeypatch.setattr(mgr_mod, "save_checkpoint", save)
    monkeypatch.setattr(mgr_mod, "verify_checkpoint", verify)
    monkeypatch.setattr(CheckpointManager, "_write_json", write_json)
    monkeypatch.setattr(CheckpointManager, "prune", prune)


def _state(step):
    return {"w": np.full(1000, float(step), np.float32), "i": np.arange(step, step + 5)}


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("dead", [0, 1])
@pytest.mark.parametrize("dead_first", [True, False])
def test_kill_at_every_point_of_a_save_keeps_a_common_step(tmp_path, monkeypatch, point, dead, dead_first):
    ranks = [CheckpointManager(tmp_path, rank=r, keep=1, world_size=2) for r in (0, 1)]
    for step in (10, 15):
        for m in ranks:
            m.save(step, _state(step), {})
    order = [ranks[dead], ranks[1 - dead]] if dead_first else [ranks[1 - dead], ranks[dead]]
    _arm(monkeypatch, point, ranks[dead])
    for m in order:
        try:
            m.save(20, _state(20), {})
        except _Crash:
            pass
    monkeypatch.undo()
    # the restarted gang: each rank's good committed steps, the newest common one, its files load and agree
    fresh = [CheckpointManager(tmp_path, rank=r, keep=1, world_size=2) for r in (0, 1)]
    common = set(fresh[0].good_steps()) & set(fresh[1].good_steps())
    assert common, f"no common checkpoint: {sorted(p.name for p in tmp_path.iterdir())}"
    newest = max(common)
    # the step is 20 exactly when the dead rank got past its receipt and the record was written
    committed_20 = point == "prune" or (point == "commit" and dead_first)
    assert newest == (20 if committed_20 else 15)
    for m in fresh:
        _, tensors, meta = m.load(newest)
        assert meta["step"] == newest and float(tensors["w"][0]) == newest
    # a second fault right after: pruning by the surviving rank still keeps that step
    fresh[1 - dead].save(25, _state(25), {})
    assert newest in set(fresh[0].good_steps()) & set(fresh[1].good_steps())


def test_legacy_directory_without_commit_records_resumes(tmp_path):
    from blumodels.checkpoint.format import save_checkpoint

    for r in (0, 1):  # what an earlier version wrote: step files only
        save_checkpoint(tmp_path / f"step_00000004.rank{r}.safetensors", _state(4), {"step": 4, "rank": r})
    ms = [CheckpointManager(tmp_path, rank=r, keep=1, world_size=2) for r in (0, 1)]
    assert [m.good_steps() for m in ms] == [[4], [4]]
    assert ms[1].latest_good()[2]["step"] == 4


@pytest.mark.parametrize("step", [-1, 7, "4", True])
def test_metadata_step_must_be_the_file_names(tmp_path, step):
    """A negative (or otherwise wrong) step inside a verified file is not 'no checkpoint': the file is refused by
    name and the older committed step is used."""
    m = CheckpointManager(tmp_path, keep=5, world_size=1)
    m.save(2, _state(2), {})
    m.save(4, _state(4), {})
    from blumodels.checkpoint.format import save_checkpoint

    save_checkpoint(m.path_for(4), _state(4), {"step": step, "rank": 0})  # same size: still the receipt's
    with pytest.raises(mgr_mod.CheckpointError, match=r"step_00000004\.rank0\.safetensors: metadata step"):
        m.load(4)
    fresh = CheckpointManager(tmp_path, keep=5, world_size=1)
    assert fresh.good_steps() == [2] and fresh.latest_good()[2]["step"] == 2


# ------------------------------------------------------------------ two real ranks (mpiexec), bit-exact after resume
dtms = pytest.importorskip("dtms")
from dtms.mpi import find_mpiexec, mpiexec_command, mpiexec_env  # noqa: E402

needs_mpi = pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec (pip install dtms[mpi])")


def _mpi(args, expect_ok=True):
    cmd = mpiexec_command(2, [sys.executable, str(WORKER), json.dumps(args)])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=mpiexec_env(), cwd=str(HERE))
    if expect_ok:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return json.loads(Path(args["result"]).read_text())
    assert p.returncode != 0, "the injected fault did not end the run"
    return None


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    args = {"data": str(micro_data()), "out": str(d / "run"), "result": str(d / "ref.json"), "world": 2,
            "resume": False, "keep": 1, "interval": 2, "steps": 8, "kill": None}
    return _mpi(args)


@needs_mpi
@pytest.mark.parametrize("rank,point", [(1, "write"), (0, "write"), (1, "commit")])
def test_two_ranks_killed_mid_save_resume_bit_exact(tmp_path, reference, rank, point):
    base = {"data": str(micro_data()), "out": str(tmp_path / "run"), "world": 2, "keep": 1, "interval": 2,
            "steps": 8}
    _mpi({**base, "result": str(tmp_path / "a.json"), "resume": False, "kill": {"rank": rank, "step": 4,
                                                                              "point": point}}, expect_ok=False)
    b = _mpi({**base, "result": str(tmp_path / "b.json"), "resume": True, "kill": None})
    assert b["resumed_from"] is not None and ".rank0." in b["resumed_from"]
    assert b["step"] == 8 and b["params"] == reference["params"]  # bit-exact
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in log] == [(r["step"], r["loss"]) for r in reference["history"]]


@needs_mpi
@pytest.mark.parametrize("fail", [None, 1])
def test_two_rank_sigterm_commits_or_says_it_could_not(tmp_path, reference, fail):
    """SIGTERM on rank 1 before step 2 of `blutrain train` on 2 ranks: both save step 3 and exit 75 only when it is
    committed, and the resume is bit-exact; a full disk on one rank makes it 74 naming the committed step 2."""
    base = {"data": str(micro_data()), "out": str(tmp_path / "run"), "world": 2, "keep": 1, "interval": 2,
            "steps": 8}
    cmd = mpiexec_command(2, [sys.executable, str(WORKER), json.dumps(
        {**base, "result": "", "resume": False, "term": {"rank": 1, "step": 2}, "fail_save": fail})])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=mpiexec_env(), cwd=str(HERE))
    out = p.stdout + p.stderr
    committed = CheckpointManager(tmp_path / "run" / "checkpoints", world_size=2).committed_steps()
    if fail is None:
        assert p.returncode == 75, out[-3000:]
        assert "preempted (SIGTERM) at step 3: checkpoint saved" in out and committed == [3]
    else:
        assert p.returncode == 74, out[-3000:]
        assert "preempted (SIGTERM) at step 3, but its checkpoint could not be committed on every rank" in out
        assert "a --resume starts from the committed step 2" in out and committed == [2]
        assert "rank 1: checkpoint" in out and "No space left on device" in out and "Traceback" not in out, \
            out[-3000:]
        return  # a resume from a committed step is bit-exact: test_two_ranks_killed_mid_save_resume_bit_exact
    b = _mpi({**base, "result": str(tmp_path / "b.json"), "resume": True, "kill": None})
    assert b["resumed_from"].endswith(f"step_{3 if fail is None else 2:08d}.rank0.safetensors")
    assert b["step"] == 8 and b["params"] == reference["params"]  # bit-exact
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in log] == [(r["step"], r["loss"]) for r in reference["history"]]


# ------------------------------------------------------------------ one owner per run directory
def test_second_trainer_on_a_running_directory_is_refused(tmp_path):
    a = Trainer(micro_config(), tmp_path, quiet=True)
    with pytest.raises(RunLockError, match=rf"in use by pid {os.getpid()} on host \S+") as e:
        Trainer(micro_config(), tmp_path, resume=True, quiet=True)
    assert e.value.holder["pid"] == os.getpid()
    a.fit(2)
    a.close()
    b = Trainer(micro_config(), tmp_path, resume=True, quiet=True)  # free again once the owner closed
    assert b.step == 2
    b.close()


def test_second_process_refused_and_dead_owner_taken_over(tmp_path):
    code = ("import sys, time; from blumodels.runlock import RunLock; RunLock(sys.argv[1]).acquire(); "
            "print('held', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(RunLockError, match=rf"pid {p.pid} on host"):
            RunLock(tmp_path).acquire()
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    lock = RunLock(tmp_path).acquire()  # the kernel freed the dead owner's lock: taken over, its record named
    assert lock.previous["pid"] == p.pid
    assert json.loads((tmp_path / ".blutrain.lock").read_text())["pid"] == os.getpid()
    lock.release()


def test_refused_trainer_leaves_the_directory_free(tmp_path):
    t = Trainer(micro_config(steps=2), tmp_path, quiet=True)
    t.fit()
    t.close()
    with pytest.raises(ConfigError, match="holds an earlier run's checkpoints"):
        Trainer(micro_config(steps=2), tmp_path, quiet=True)
    Trainer(micro_config(steps=2), tmp_path, overwrite=True, quiet=True).close()  # not held by the refused one


# ------------------------------------------------------------------ what the orchestrator is told
class _Recorder:
    def __init__(self):
        self.events = []

    def blutrain_on_checkpoint_saved(self, path, step):
        self.events.append(("saved", step))

    def blutrain_on_train_end(self, status, step, error):
        self.events.append(("end", status, step, type(error).__name__ if error else None))


@pytest.fixture
def recorder():
    import pluggy
    from blutensor.ext import get_host

    rec = _Recorder()
    impl = pluggy.HookimplMarker("blutrain")
    for name in ("blutrain_on_checkpoint_saved", "blutrain_on_train_end"):
        impl(getattr(type(rec), name))
    host = get_host()
    host.pm.register(rec, name="test-recorder")
    yield rec
    host.pm.unregister(rec)


def test_async_commits_and_end_are_reported(tmp_path, recorder):
    tr = Trainer(micro_config(async_checkpoint=True, checkpoint_interval=2, steps=6), tmp_path, quiet=True)
    tr.fit()
    tr.close()
    assert recorder.events == [("saved", 2), ("saved", 4), ("saved", 6), ("end", "ok", 6, None)]


def test_nan_stop_is_reported_as_fatal(tmp_path, recorder):
    tr = Trainer(micro_config(), tmp_path, quiet=True)
    tr.model.ln_f.weight._data[0] = np.inf
    with pytest.raises(NonFiniteError):
        with np.errstate(all="ignore"):
            tr.fit()
    tr.close()
    assert recorder.events == [("end", "failed", 0, "NonFiniteError")] and NonFiniteError.fatal


def test_sigterm_saves_the_step_and_ends_preempted(tmp_path, recorder):
    tr = Trainer(micro_config(steps=8, checkpoint_interval=0), tmp_path, quiet=True)
    orig = tr.train_step

    def step():
        if tr.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # delivered between bytecodes: the handler only sets a flag
        return orig()

    tr.train_step = step
    summary = tr.fit()
    tr.close()
    assert summary["preempted"] and summary["steps"] == 4
    assert recorder.events == [("saved", 4), ("end", "preempted", 4, None)]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the previous handler is back
    b = Trainer(micro_config(steps=8, checkpoint_interval=0), tmp_path, resume=True, quiet=True)
    assert b.step == 4
    b.close()


# ------------------------------------------------------------------ the orchestrator classifies the Trainer's faults
ORCH_WORKER = HERE / "orch_trainer.py"


def _orchestrate(tmp_path, mode, **popen):
    cmd = [sys.executable, "-m", "dtms.orchestrate", "--run-dir", str(tmp_path / "orch"), "--nproc-per-node", "1",
           "--max-restarts", "3", "--heartbeat-interval", "0.2", "--grace-period", "20", "--quiet",
           str(ORCH_WORKER), str(micro_data()), str(tmp_path / "run"), mode]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM", "PMIX_RANK"))}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    return subprocess.Popen(cmd, env=env, cwd=str(HERE), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **popen)


def _summary(tmp_path):
    return json.loads((tmp_path / "orch" / "summary.json").read_text())


def test_orchestrated_nan_stop_is_fatal_at_once(tmp_path):
    p = _orchestrate(tmp_path, "nan")
    out, _ = p.communicate(timeout=120)
    s = _summary(tmp_path)
    assert p.returncode == 70, out[-2000:]
    assert s["restarts"] == 0 and [i.split()[0] for i in s["incidents"]] == ["NAN_INF"]


def test_orchestrated_shard_changed_under_the_run_is_a_fatal_data_fault(tmp_path):
    p = _orchestrate(tmp_path, "data")
    out, _ = p.communicate(timeout=120)
    s = _summary(tmp_path)
    assert p.returncode == 70, out[-2000:]
    assert s["restarts"] == 0 and [i.split()[0] for i in s["incidents"]] == ["DATA"], s
    assert "train_00000.bin: changed under the run" in s["reason"], s["reason"]


def test_orchestrated_memory_error_is_oom_and_restarts(tmp_path):
    p = _orchestrate(tmp_path, "oom")
    out, _ = p.communicate(timeout=120)
    s = _summary(tmp_path)
    assert p.returncode == 0, out[-2000:]
    assert [i.split()[0] for i in s["incidents"]] == ["OOM"] and s["restarts"] == 1
    log = [json.loads(x)["step"] for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert log == list(range(6))  # resumed at step 2, nothing lost, nothing twice


@pytest.mark.parametrize("mode", ["slow", "slow-nospace"])
def test_orchestrated_sigterm_saves_and_says_which_step(tmp_path, mode):
    """Exit 75 naming the step every rank committed as it left; 74 saying so when the save failed (disk full)."""
    p = _orchestrate(tmp_path, mode)
    log = tmp_path / "run" / "log.jsonl"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and (not log.is_file() or len(log.read_text().splitlines()) < 3):
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    s = _summary(tmp_path)
    m = CheckpointManager(tmp_path / "run" / "checkpoints", world_size=1)
    if mode == "slow-nospace":
        assert p.returncode == 74, out[-2000:]
        assert s["exit_name"] == "preempted-unsaved" and m.committed_steps() == []
        assert "preempted, but not every rank saved a checkpoint as it left" in s["reason"]
        return
    assert p.returncode == 75, out[-2000:]
    saved = max(m.step_of(q) for q in m.list())
    assert f"every rank saved the checkpoint of step {saved} as it left" in s["reason"]
    assert m.committed_steps()[-1] == saved
