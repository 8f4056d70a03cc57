"""Fault recovery of a real training job: a micro GPT-2 under dtms DDP on 2 MPI ranks with blumodels
checkpoints, run by the dtms orchestrator. After a killed rank, a hung rank, a kill during a checkpoint
save (sync and async) or a damaged checkpoint, the run finishes with per-step losses and final weights
equal (==) to those of an uninterrupted run; a checkpoint that crashes every load stops with the
no-progress exit code; SIGTERM commits a checkpoint and leaves with the requeue code; 50 async saves keep
host memory flat with at most one in flight."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("blumodels")
from dtms.mpi import find_mpiexec  # noqa: E402
from dtms.orchestrator import EXIT_NO_PROGRESS, EXIT_REQUEUE  # noqa: E402

pytestmark = [pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec (pip install dtms[mpi])"),
              pytest.mark.mpi]
WORKER = Path(__file__).parent / "workers" / "fault_gpt2_worker.py"
STEPS, EVERY = 12, 3
FAST = ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "2", "--progress-timeout", "20",
        "--startup-timeout", "60", "--grace-period", "5"]


def orchestrate(run: Path, *worker_args: str, fault=None, extra=(), timeout=180, wait=True):
    env = dict(os.environ, FAULT_SPEC=json.dumps(fault or []))
    cmd = [sys.executable, "-m", "dtms.orchestrate", "--run-dir", str(run), "--nproc-per-node", "2", *FAST,
           *extra, str(WORKER), "--out", str(run / "job"), "--steps", str(STEPS), "--ckpt-every", str(EVERY),
           *worker_args]
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return p


def losses(run: Path, rank: int = 0) -> list[tuple[int, str]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run / "job" / f"losses.rank{rank}.jsonl")
                                                .read_text().splitlines())]


def final(run: Path, rank: int) -> dict[str, np.ndarray]:
    from blumodels.checkpoint.manager import CheckpointManager

    path, tensors, meta = CheckpointManager(run / "job" / "ckpt", rank=rank).latest_good()
    assert meta["step"] == STEPS, path
    return tensors


def events(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "events.jsonl").read_text().splitlines()]


def incidents(run: Path) -> list[dict]:
    return [e for e in events(run) if e["event"] == "incident"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("ref")
    p = orchestrate(run)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ls = losses(run)
    assert [s for s, _ in ls] == list(range(STEPS))
    assert float.fromhex(ls[-1][1]) < float.fromhex(ls[0][1])  # it learns
    return run


def assert_bit_exact(run: Path, ref: Path) -> None:
    for rank in (0, 1):
        assert losses(run, rank) == losses(ref, rank)
        a, b = final(run, rank), final(ref, rank)
        assert a.keys() == b.keys() and any(k.startswith("optim.exp_avg_sq.") for k in a)
        for k in a:
            assert np.array_equal(a[k], b[k]), k


def check_ok(p, run: Path, ref: Path, fault: str, restarts: int = 1) -> list[dict]:
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    state = json.loads((run / "orchestrator_state.json").read_text())
    assert state["status"] == "SUCCEEDED" and state["restarts"] == restarts
    inc = incidents(run)
    assert any(i["fault"] == fault for i in inc), inc
    assert_bit_exact(run, ref)
    return inc


def test_kill_rank_is_bit_exact(tmp_path, reference):
    """(1) SIGKILL rank 1 at step 7: RANK_DEAD, gang restart from step 6, bit-identical outcome."""
    p = orchestrate(tmp_path, fault=[{"kind": "kill", "rank": 1, "step": 7}])
    inc = check_ok(p, tmp_path, reference, "RANK_DEAD")
    assert inc[0]["rank"] == 1 and "killed by signal 9 (SIGKILL)" in inc[0]["message"]
    ends = [e for e in events(tmp_path) if e["event"] == "attempt_end"]
    assert ends[1]["resume_step"] == 6


@pytest.mark.slow
def test_hung_rank_detected_with_stacks_and_bit_exact(tmp_path, reference):
    """(2) SIGSTOP rank 1 at step 5: RANK_HUNG within the heartbeat timeout, stacks of both ranks."""
    p = orchestrate(tmp_path, fault=[{"kind": "stop", "rank": 1, "step": 5}])
    inc = check_ok(p, tmp_path, reference, "RANK_HUNG")
    hung = next(i for i in inc if i["fault"] == "RANK_HUNG")
    assert hung["rank"] == 1 and "no heartbeat" in hung["message"] and "stopped" in hung["message"]
    stopped_at = float((tmp_path / "job" / "fault.a0.rank1.stop").read_text())
    assert hung["time"] - stopped_at < 2.0 + 1.5  # heartbeat timeout + one monitor/beat period
    files = hung["details"]["stacks"]
    assert set(files) == {"0", "1"}
    for r in ("0", "1"):
        text = Path(files[r]).read_text()
        assert "fault_gpt2_worker.py" in text and "most recent call first" in text
    # the healthy rank was caught waiting in its collective
    assert "all_reduce" in Path(files["0"]).read_text() or "backward" in Path(files["0"]).read_text()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_during_checkpoint_save(tmp_path, reference, mode):
    """(4) rank 0 is killed inside the save of step 9 (temporary file written, not renamed): the
    previous checkpoint (step 6) loads on every rank and the run ends bit-exactly."""
    args = ["--async"] if mode == "async" else []
    p = orchestrate(tmp_path, *args, fault=[{"kind": "kill_in_save", "rank": 0, "step": 8}])
    check_ok(p, tmp_path, reference, "RANK_DEAD")
    ends = [e for e in events(tmp_path) if e["event"] == "attempt_end"]
    assert ends[1]["resume_step"] == 6


@pytest.mark.parametrize("how,reason", [("flip", "checksum mismatch"), ("truncate", "truncated"), ("delete", None)])
def test_damaged_checkpoint_falls_back(tmp_path, reference, how, reason):
    """(5) rank 1's newest checkpoint (step 6) is bit-flipped / truncated / deleted, then the rank dies:
    a precise CHECKPOINT_CORRUPT incident (file + reason) and resume from step 3 on every rank."""
    p = orchestrate(tmp_path, fault=[{"kind": how, "rank": 1, "step": 7}])
    inc = check_ok(p, tmp_path, reference, "RANK_DEAD")
    ends = [e for e in events(tmp_path) if e["event"] == "attempt_end"]
    assert ends[1]["resume_step"] == 3
    bad = [i for i in inc if i["fault"] == "CHECKPOINT_CORRUPT"]
    if how == "delete":
        assert not bad  # a missing file is not corrupt: the gang agrees on the newest common step
    else:
        assert len(bad) == 1 and bad[0]["rank"] == 1, bad
        assert "step_00000006.rank1.safetensors" in bad[0]["message"]
        assert reason in bad[0]["message"]


def test_checkpoint_crashing_every_load_stops_with_no_progress_code(tmp_path, reference):
    """(6) a checkpoint that verifies but crashes every restore: CHECKPOINT_CORRUPT on each attempt,
    then exit 72 (no progress) with a summary, after --max-no-progress restarts."""
    from blumodels.checkpoint.format import load_checkpoint, save_checkpoint

    ck = tmp_path / "job" / "ckpt"
    ck.mkdir(parents=True)
    for rank in (0, 1):
        src = reference / "job" / "ckpt" / f"step_{STEPS:08d}.rank{rank}.safetensors"
        tensors, meta = load_checkpoint(src)
        name = next(k for k in tensors if k.startswith("model."))
        tensors[name] = tensors[name][:1]  # wrong shape: the file verifies, the restore cannot work
        save_checkpoint(ck / f"step_00000006.rank{rank}.safetensors", tensors, {**meta, "step": 6})
    t0 = time.monotonic()
    p = orchestrate(tmp_path, extra=["--max-restarts", "5", "--max-no-progress", "1"])
    assert p.returncode == EXIT_NO_PROGRESS, p.stdout[-3000:] + p.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "GAVE_UP" and summary["attempts"] == 2 and summary["restarts"] == 1
    assert "2 attempts in a row reached no new step" in summary["reason"]
    inc = incidents(tmp_path)
    assert [i["fault"] for i in inc] == ["CHECKPOINT_CORRUPT"] * 2
    assert "cannot be restored" in inc[0]["message"] and "shape" in inc[0]["message"]
    assert time.monotonic() - t0 < 120


@pytest.mark.slow
def test_sigterm_commits_checkpoint_and_requeues_then_resumes_bit_exact(tmp_path, reference):
    """(8) SIGTERM to the orchestrator mid-run: every rank saves at its current step, exit 75; the
    relaunched orchestrator continues from that step and ends bit-exactly."""
    # steps 4.. are paced (0.5 s each, first attempt only) so the SIGTERM below always lands mid-run
    slow = [{"rank": r, "step": s, "kind": "slow"} for r in (0, 1) for s in range(4, STEPS)]
    proc = orchestrate(tmp_path, "--nan-policy", "stop", fault=slow, wait=False)
    log = tmp_path / "job" / "losses.rank0.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 4):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_REQUEUE, out[-3000:]
    state = json.loads((tmp_path / "orchestrator_state.json").read_text())
    assert state["status"] == "PREEMPTED" and state["restarts"] == 0
    saved = state["last_good_step"]
    assert saved is not None and 4 <= saved < STEPS
    from blumodels.checkpoint.manager import CheckpointManager

    for rank in (0, 1):
        assert saved in CheckpointManager(tmp_path / "job" / "ckpt", rank=rank).good_steps()
    assert any(i["fault"] == "PREEMPTED" for i in incidents(tmp_path))
    p = orchestrate(tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ends = [e for e in events(tmp_path) if e["event"] == "attempt_end"]
    assert ends[-1]["resume_step"] == saved
    assert_bit_exact(tmp_path, reference)


def test_fifty_async_saves_flat_memory_one_in_flight(tmp_path):
    """(10) 50 async saves of the micro GPT-2 training state: resident memory flat after warm-up, never
    more than one write in flight, every kept checkpoint verifies."""
    import blutensor as bt
    from blumodels.checkpoint.manager import CheckpointManager
    from blumodels.config import ModelConfig
    from blumodels.gpt2 import build_model
    from blumodels.state import training_state

    model = build_model(ModelConfig(n_layer=2, n_head=2, d_model=64, block_size=16, vocab_size=64), seed=1)
    opt = bt.optim.AdamW(model.parameters(), lr=1e-3)
    x = bt.tensor(np.random.default_rng(0).integers(0, 64, (2, 16)))
    _, loss = model(x, x)
    loss.backward()
    opt.step()
    ck = CheckpointManager(tmp_path, keep=2, async_save=True)
    live, peak = [0], [0]
    lock = threading.Lock()
    real = ck._write_bg

    def counted(*a):
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        try:
            real(*a)
        finally:
            with lock:
                live[0] -= 1

    ck._write_bg = counted
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * page

    samples = []
    for step in range(1, 51):
        tensors, meta = training_state(model, opt, step)
        ck.save(step, tensors, meta)
        samples.append(rss())
    ck.wait()
    state_bytes = sum(v.nbytes for v in tensors.values())
    assert peak[0] == 1
    assert samples[-1] - samples[9] < max(2 * state_bytes, 4 << 20), (samples[9], samples[-1], state_bytes)
    assert ck.good_steps() == [49, 50]


#: long enough that the rank is still training when the test kills it after step 7 (a step of this model takes
#: ~10 ms on the compiled CPU kernels: a 16-step run could end before the kill arrived)
TRAINER_STEPS = 240
TRAINER = ["model.n_layer=2", "model.n_head=2", "model.d_model=32", "model.block_size=32", "model.dropout=0.1",
           "train.seq_len=32", "train.micro_batch=4", "train.batch_tokens=256", "train.warmup_steps=2",
           "train.eval_interval=0", "train.checkpoint_interval=4", "train.sample_tokens=0", "train.plot=false",
           "train.device=cpu", f"train.steps={TRAINER_STEPS}"]


@pytest.mark.slow
def test_blumodels_trainer_killed_externally_resumes_bit_exact(tmp_path):
    """blumodels' Trainer (the `blutrain` CLI, one rank) under the orchestrator: its step hooks feed the
    heartbeats (dtms.hooks), the rank is SIGKILLed from outside after 7 steps, the gang restarts with
    --resume from the newest good checkpoint and the log and final weights equal an uninterrupted run."""
    pytest.importorskip("tokenizers")
    import blumodels.cli
    from blumodels.data.prepare import prepare

    data = tmp_path / "data"
    prepare(data, corpus="pydocs", tokenizer="bpe", vocab_size=384, val_fraction=0.1, max_corpus_bytes=120_000)
    ref, run = tmp_path / "ref", tmp_path / "run"
    args = ["train", "--preset", "tiny", "--data", str(data), "--quiet", *TRAINER]
    p = subprocess.run([sys.executable, "-m", "blumodels.cli", *args, "--out", str(ref)], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    proc = subprocess.Popen([sys.executable, "-m", "dtms.orchestrate", "--run-dir", str(run / "orch"), *FAST,
                             blumodels.cli.__file__, *args, "--out", str(run), "--resume"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log, state = run / "log.jsonl", run / "orch" / "orchestrator_state.json"
    deadline, pid = time.monotonic() + 120, None
    while time.monotonic() < deadline and pid is None:
        if log.exists() and len(log.read_text().splitlines()) >= 7 and state.exists():
            ranks = json.loads(state.read_text()).get("live", {}).get("ranks", {})
            pid = int(ranks["0"]) if "0" in ranks else None
        time.sleep(0.05)
    assert pid is not None, "the Trainer's step hook never reported a heartbeat"
    os.kill(pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    inc = incidents(run / "orch")
    assert [i["fault"] for i in inc] == ["RANK_DEAD"] and inc[0]["step"] >= 6
    ref_log = [(r["step"], r["loss"]) for r in map(json.loads, (ref / "log.jsonl").read_text().splitlines())]
    got_log = [(r["step"], r["loss"]) for r in map(json.loads, log.read_text().splitlines())]
    assert [s for s, _ in ref_log] == list(range(TRAINER_STEPS)) and got_log == ref_log
    from blumodels.checkpoint.manager import CheckpointManager

    _, a, ma = CheckpointManager(ref / "checkpoints").latest_good()
    _, b, mb = CheckpointManager(run / "checkpoints").latest_good()
    assert ma["step"] == mb["step"] == TRAINER_STEPS and a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k
