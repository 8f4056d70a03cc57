"""The Trainer's one step on a GPU: captured (train.cuda_graph = "auto", the default) equals eager, with and
without accumulation, in every precision; a non-finite step is skipped on the device; the compiled step
(train.compile) matches eager; DDP's bucketed all-reduces over a one-rank NCCL group are captured; the
optimizer in backward keeps a lower steady-state peak than plain training, is captured (equal to eager) and
keeps a lower peak than captured plain training. CPU twins: test_graph_step.py,
test_ddp_trainer.py, test_memory_lean.py."""

from __future__ import annotations

import os

import blutensor as bt
import numpy as np
import pytest
from blumodels.trainer import Trainer
from models_helpers import micro_config, record_all_reduces

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not bt.cuda.is_available(), reason="needs a CUDA GPU")]


def _train(tmp_path, name, steps=6, dropout=0.0, **kw):
    cfg = micro_config(device="cuda", steps=steps, eval_interval=0, checkpoint_interval=0, **kw)
    cfg.model.dropout = dropout
    tr = Trainer(cfg, tmp_path / name, quiet=True)
    tr.fit(save_final=False)
    tr.close()
    return tr


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("batch_tokens, dropout", [(128, 0.0), (384, 0.0), (384, 0.1)])  # 1 and 3 micro-steps
def test_captured_trainer_equals_eager(tmp_path, precision, batch_tokens, dropout):
    eager = _train(tmp_path, "eager", cuda_graph=False, precision=precision, batch_tokens=batch_tokens,
                   dropout=dropout)
    graph = _train(tmp_path, "graph", precision=precision, batch_tokens=batch_tokens, dropout=dropout)  # "auto"
    assert graph.captured and not eager.captured
    assert [r.get("cuda_graph", False) for r in graph.history] == [False, False, True, True, True, True]
    a, b = [r["loss"] for r in eager.history], [r["loss"] for r in graph.history]
    np.testing.assert_allclose(b, a, rtol=2e-6, atol=0)  # the same kernels in the same order
    np.testing.assert_allclose([r["grad_norm"] for r in graph.history], [r["grad_norm"] for r in eager.history],
                               rtol=1e-5)
    for (n, p), q in zip(graph.model.named_parameters(), eager.model.parameters()):
        np.testing.assert_allclose(p.numpy(), q.numpy(), rtol=1e-5, atol=1e-6, err_msg=n)
    assert {st["step"] for st in graph.optimizer.state.values()} == {6}


@pytest.mark.parametrize("precision, dropout", [("fp32", 0.0), ("bf16", 0.0), ("fp32", 0.1)])
def test_captured_trainer_with_activation_recompute_equals_eager(tmp_path, precision, dropout):
    kw = {"precision": precision, "batch_tokens": 256, "activation_checkpointing": True}
    eager = _train(tmp_path, "eager", cuda_graph=False, dropout=dropout, **kw)
    graph = _train(tmp_path, "graph", dropout=dropout, **kw)
    assert graph.captured
    np.testing.assert_allclose([r["loss"] for r in graph.history], [r["loss"] for r in eager.history], rtol=2e-6)


def test_captured_step_skips_a_nonfinite_update_on_the_device(tmp_path):
    cfg = micro_config(device="cuda", steps=6, eval_interval=0, checkpoint_interval=0, nan_policy="skip",
                       batch_tokens=256)
    tr = Trainer(cfg, tmp_path / "nan", quiet=True)
    tr.fit(3, save_final=False)
    assert tr.captured
    w = tr.model.blocks[0].mlp.c_fc.weight
    saved = w._data.copy()
    w._data[0, 0] = float("nan")
    before = {n: p.numpy().copy() for n, p in tr.model.named_parameters()}
    counts = {st["step"] for st in tr.optimizer.state.values()}
    tr.fit(4, save_final=False)
    rec = tr.history[-1]
    assert rec.get("skipped") and rec["cuda_graph"]
    for n, p in tr.model.named_parameters():
        np.testing.assert_array_equal(p.numpy(), before[n], err_msg=n)  # nothing was updated
    assert {st["step"] for st in tr.optimizer.state.values()} == counts
    w._data[...] = saved
    tr.fit(save_final=False)
    assert all(np.isfinite(r["loss"]) and not r.get("skipped") for r in tr.history[4:])
    assert {st["step"] for st in tr.optimizer.state.values()} == {c + 2 for c in counts}
    tr.close()


def test_compiled_trainer_matches_eager(tmp_path):
    pytest.importorskip("blucompiler")
    eager = _train(tmp_path, "eager", cuda_graph=False, batch_tokens=256)
    comp = _train(tmp_path, "compiled", compile=True, batch_tokens=256)
    rep = comp._compiled.report()
    assert rep["eager_steps"] == [] and rep["specialisations"] == 2, rep
    np.testing.assert_allclose([r["loss"] for r in comp.history], [r["loss"] for r in eager.history], rtol=1e-5)


def test_ddp_over_one_rank_nccl_is_captured(tmp_path, monkeypatch):
    """DDP (small buckets) over a one-rank NCCL group: the last micro-step's bucket all-reduces are recorded in
    the captured graph (issued on the host while capturing, never while replaying) and the captured steps equal
    the eager ones."""
    dtms = pytest.importorskip("dtms")
    from blumodels.graph_step import CapturedStep
    from blumodels.step import TrainStep
    from dtms.parallel.ddp import DistributedDataParallel

    for k in list(os.environ):  # a single process, whatever launched the tests
        if k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") or \
                k.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_")):
            monkeypatch.delenv(k)
    pg = dtms.init_process_group("nccl")
    try:
        res = []
        for graph in (False, True):
            tr = Trainer(micro_config(device="cuda", steps=6, eval_interval=0, checkpoint_interval=0,
                                      cuda_graph=False, batch_tokens=256), tmp_path / f"g{graph}", quiet=True)
            ddp = DistributedDataParallel(tr.model, pg, bucket_cap_mb=0.01)
            calls: list[str] = []
            phase = ["eager"]
            record_all_reduces(ddp, lambda _c=calls, _p=phase: _c.append(_p[0]))
            st = TrainStep(ddp, tr.optimizer, list(tr.params.values()), device=tr.device,
                           lr_schedule=[1e-3] * 6, accum=2, grad_clip=1.0, no_sync=lambda s, d=ddp: d.no_sync() if s
                           else _Null(), fused=True)
            cap, losses = None, []
            for s in range(6):
                if graph and s == 2:
                    cap = CapturedStep(st, (4, 32))
                    phase[0] = "capture"
                    cap.capture()
                    phase[0] = "replay"
                (cap or st).run(tr.train_loader.next_batch, 1e-3)
                losses.append(st.read().loss)
            assert len(ddp.buckets) > 1
            # the bucket all-reduces of one synchronised backward, issued by the eager steps and, captured, only
            # while recording the graph: the replays launch them from the graph
            per = calls.count("capture") if graph else len(calls) // 6
            assert per >= len(ddp.buckets), calls
            want = ["eager"] * (2 * per) + ["capture"] * per if graph else ["eager"] * (6 * per)
            assert calls == want, calls
            res.append(losses)
            tr.close()
        np.testing.assert_allclose(res[1], res[0], rtol=2e-6)
    finally:
        dtms.destroy_process_group()


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_optimizer_in_backward_steady_state_peak_below_plain(tmp_path):
    """Peak allocated bytes of a steady-state step (steps 2-3) with the optimizer in backward < plain training's."""
    def peak(**kw):
        cfg = micro_config(device="cuda", steps=4, eval_interval=0, checkpoint_interval=0, grad_clip=0.0,
                           batch_tokens=32, micro_batch=1, seq_len=32, cuda_graph=False, **kw)
        cfg.model.n_layer, cfg.model.d_model = 6, 256
        tr = Trainer(cfg, tmp_path / str(kw), quiet=True)
        tr.fit(2, save_final=False)
        tr.memory.alloc.reset_peak_stats()
        tr.fit(save_final=False)
        out = tr.memory.alloc.memory_stats()["peak_allocated_bytes"]
        tr.close()
        return out, sum(p._data.nbytes for p in tr.params.values())

    lean, total = peak(optimizer_in_backward=True)
    plain, _ = peak()
    print(f"steady-state peak allocated: optimizer-in-backward {lean}, plain {plain}, gradients {total}")
    assert lean < plain - total // 2


def test_captured_optimizer_in_backward_equals_eager(tmp_path):
    """train.optimizer_in_backward is captured ("auto"): the per-parameter AdamW launches inside the captured
    backward read each step's lr and update count on the device; losses and weights equal the eager OIB run's
    (the same kernels in the same order) and, within float32 rounding, plain fused training's."""
    kw = {"batch_tokens": 128, "grad_clip": 0.0}
    eager = _train(tmp_path, "eager", cuda_graph=False, optimizer_in_backward=True, **kw)
    graph = _train(tmp_path, "graph", optimizer_in_backward=True, **kw)
    plain = _train(tmp_path, "plain", cuda_graph=False, **kw)
    assert graph.captured and not eager.captured
    assert [r.get("cuda_graph", False) for r in graph.history] == [False, False, True, True, True, True]
    a, b = [r["loss"] for r in eager.history], [r["loss"] for r in graph.history]
    np.testing.assert_allclose(b, a, rtol=2e-6, atol=0)
    np.testing.assert_allclose(b, [r["loss"] for r in plain.history], rtol=1e-5, atol=0)
    assert all(r["grad_norm"] is None for r in graph.history)
    for (n, p), q in zip(graph.model.named_parameters(), eager.model.parameters()):
        np.testing.assert_allclose(p.numpy(), q.numpy(), rtol=1e-5, atol=1e-6, err_msg=n)
    assert {st["step"] for st in graph.optimizer.state.values()} == {6}


def test_captured_optimizer_in_backward_peak_below_captured_plain(tmp_path):
    """Peak allocated bytes after the eager warm-up (the capture and its replays) with the optimizer in backward
    < captured plain training's: its gradients live in the graph's pool one at a time, not in static buffers."""
    def peak(**kw):
        cfg = micro_config(device="cuda", steps=6, eval_interval=0, checkpoint_interval=0, grad_clip=0.0,
                           batch_tokens=32, micro_batch=1, seq_len=32, **kw)
        cfg.model.n_layer, cfg.model.d_model = 6, 256
        tr = Trainer(cfg, tmp_path / str(kw), quiet=True)
        tr.fit(2, save_final=False)
        tr.memory.alloc.reset_peak_stats()
        tr.fit(save_final=False)
        out = tr.memory.alloc.memory_stats()["peak_allocated_bytes"]
        assert tr.captured
        tr.close()
        return out, sum(p._data.nbytes for p in tr.params.values())

    lean, total = peak(optimizer_in_backward=True)
    plain, _ = peak()
    print(f"captured steady-state peak allocated: optimizer-in-backward {lean}, plain {plain}, gradients {total}")
    assert lean < plain - total // 2


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_captured_steps_reserve_no_second_copy_of_the_activations(tmp_path, precision, family):
    """The step's long-lived buffers (AdamW moments, bf16 weight copies) exist before the first activation, so
    the memory the eager warm-up steps used is given back before the captured graphs take their own: the peak
    reserved of the captured run stays near the eager warm-up's instead of adding the graphs' activations. Both
    families (llama: grouped-query attention, fused RMSNorms, SwiGLU)."""
    cfg = micro_config(device="cuda", steps=5, eval_interval=0, checkpoint_interval=0, precision=precision,
                       batch_tokens=1024, micro_batch=8)
    cfg.model.n_layer, cfg.model.d_model, cfg.model.n_head = 4, 256, 4
    cfg.model.block_size = cfg.train.seq_len = 128
    if family == "llama":
        cfg.model.family, cfg.model.n_kv_heads, cfg.model.bias = "llama", 2, False
    tr = Trainer(cfg, tmp_path / f"{family}-{precision}", quiet=True)
    assert all(p in tr.optimizer.state for p in tr.params.values() if p.requires_grad)  # before any step
    tr.fit(save_final=False)
    tr.close()
    h = tr.history
    assert tr.captured and [bool(r.get("cuda_graph")) for r in h] == [False, False, True, True, True]
    warm, final = h[1]["peak_reserved_bytes"], h[-1]["peak_reserved_bytes"]
    acts = h[1]["peak_allocated_bytes"] - sum(p._data.nbytes for p in tr.params.values()) * 4
    print(f"{family} {precision}: peak reserved after the eager warm-up {warm / 2**20:.1f} MiB, after the captured "
          f"steps {final / 2**20:.1f} MiB (activations and temporaries about {acts / 2**20:.1f} MiB)")
    assert final <= warm + max(acts, 0) // 4 + (8 << 20)
