"""The Trainer on 2 MPI processes (DDP) equals the single-process Trainer on the same global batch,
and a DDP run resumes bit-exactly from its per-rank checkpoints."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from blumodels.trainer import Trainer
from models_helpers import micro_config, micro_data

dtms = pytest.importorskip("dtms")
from dtms.mpi import find_mpiexec, mpiexec_command, mpiexec_env  # noqa: E402

pytestmark = pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec (pip install dtms[mpi])")
WORKER = Path(__file__).parent / "ddp_worker.py"


def _run(out, result, mode="fresh", stop=0, dropout=0.0, fails=None):
    """Train on 2 ranks; ``fails``: the run must end nonzero (both ranks, no hang) with this in its output."""
    cmd = mpiexec_command(2, [sys.executable, str(WORKER), str(micro_data()), str(out), "2", str(result), mode,
                              str(stop), str(dropout)])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=mpiexec_env(),
                       cwd=str(Path(__file__).parent))
    if fails is not None:
        assert p.returncode != 0 and fails in p.stdout + p.stderr, p.stdout[-3000:] + p.stderr[-3000:]
        return None
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(Path(result).read_text())


def test_ddp_equals_single_process(tmp_path):
    ddp = _run(tmp_path / "ddp", tmp_path / "ddp.json")
    cfg = micro_config(micro_batch=8, batch_tokens=8 * 32 * 2)  # same global batch, one process
    tr = Trainer(cfg, tmp_path / "single", quiet=True)
    tr.fit()
    tr.close()
    a = [r["loss"] for r in ddp["history"]]
    b = [r["loss"] for r in tr.history]
    assert len(a) == len(b) == 8
    np.testing.assert_allclose(a, b, rtol=2e-5)
    np.testing.assert_allclose([r["val_loss"] for r in ddp["history"] if "val_loss" in r],
                               [r["val_loss"] for r in tr.history if "val_loss" in r], rtol=2e-5)
    for n, p in tr.model.named_parameters():
        np.testing.assert_allclose(ddp["params"][n], p.numpy().ravel()[:64], rtol=1e-4, atol=2e-5, err_msg=n)
    ranks = sorted(p.name for p in (tmp_path / "ddp" / "checkpoints").iterdir())
    assert "step_00000008.rank0.safetensors" in ranks and "step_00000008.rank1.safetensors" in ranks


def test_ddp_resume_bit_exact(tmp_path):
    # with dropout: each rank's RNG state must come back too
    ref = _run(tmp_path / "ref", tmp_path / "ref.json", dropout=0.1)
    _run(tmp_path / "split", tmp_path / "a.json", "fresh", 5, dropout=0.1)
    # refused on both ranks, files untouched: a fresh start over the checkpoints, and a resume with rank 1's gone
    _run(tmp_path / "split", tmp_path / "x.json", "fresh", dropout=0.1, fails="holds an earlier run's checkpoints")
    (tmp_path / "away").mkdir()
    rank1 = sorted((tmp_path / "split" / "checkpoints").glob("*.rank1.safetensors"))
    for f in rank1:
        f.rename(tmp_path / "away" / f.name)
    _run(tmp_path / "split", tmp_path / "x.json", "resume", dropout=0.1,
         fails="some rank has no checkpoint file while another has up to step 5")
    for f in rank1:
        (tmp_path / "away" / f.name).rename(f)
    b = _run(tmp_path / "split", tmp_path / "b.json", "resume", dropout=0.1)
    log = [json.loads(x) for x in (tmp_path / "split" / "log.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in log] == [(r["step"], r["loss"]) for r in ref["history"]]
    assert b["params"] == ref["params"]


@pytest.mark.parametrize("mode", ["eager", "capture"])
def test_ddp_accumulation_launches_buckets_during_backward_at_every_step(tmp_path, mode):
    """2 ranks, 2 micro-steps per step, small buckets: at EVERY step the first bucket's all-reduce is launched
    while backward still has nodes to run (the gradient-ready hooks fire in reverse topological order at every
    backward, not only the first), and the losses equal the single-process run on the same global batch. 'capture':
    the same through the Trainer's captured path (CPU capture twin; on CUDA the all-reduces are NCCL's, recorded
    into the graphs), steps 2 and 3 replayed."""
    worker = Path(__file__).parent / "ddp_order_worker.py"
    cmd = mpiexec_command(2, [sys.executable, str(worker), str(micro_data()), str(tmp_path / "ddp"),
                              str(tmp_path / "r.json"), mode])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=mpiexec_env(),
                       cwd=str(Path(__file__).parent))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((tmp_path / "r.json").read_text())
    captured = [bool(r.get("cuda_graph")) for r in res["history"]]
    assert captured == ([False, False, True, True] if mode == "capture" else [False] * 4), captured
    assert res["captures"] == (1 if mode == "capture" else 0)
    for s, st in enumerate(res["steps"]):
        print(f"step {s} ({mode}): bucket launches after backward node {st['launches']} of {st['nodes']}")
        assert len(st["launches"]) > 1, st
        assert st["launches"][0] < st["nodes"], f"step {s}: every bucket waited for the end of backward: {st}"
    cfg = micro_config(micro_batch=8, batch_tokens=8 * 32 * 2, steps=4, eval_interval=0, checkpoint_interval=0)
    tr = Trainer(cfg, tmp_path / "single", quiet=True)
    tr.fit(save_final=False)
    tr.close()
    np.testing.assert_allclose([r["loss"] for r in res["history"]], [r["loss"] for r in tr.history], rtol=2e-5)
