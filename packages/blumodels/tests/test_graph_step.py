"""The one training step (step.py) and its capture (graph_step.py): config refusals and the CPU twin.

The twin replaces the CUDA capture with EagerCapture (capture records the body, replay runs it), so the
captured code path runs on NumPy: static input/gradient buffers reused, lr picked from the device schedule by
the device step index, accumulation micro-steps replayed with the next micro-batch, no host reads of tensors
during replays, and losses equal to the eager step's. The real capture runs in the cuda-marked tests
(test_graph_step_cuda.py).
"""

from __future__ import annotations

import blumodels.graph_step as gsm
import blutensor as bt
import numpy as np
import pytest
from blumodels.config import ConfigError, ModelConfig, from_dict
from blumodels.gpt2 import build_model
from blumodels.graph_step import CapturedStep, EagerCapture, check_config
from blumodels.step import TrainStep, flat_grads

STEPS = 7
B, T = 3, 16
SCHED = [1e-3 * (s + 1) / STEPS if s < 3 else 5e-4 + 1e-4 * np.cos(s) for s in range(STEPS)]  # changes every step


def _model():
    cfg = ModelConfig(n_layer=2, n_head=2, d_model=32, block_size=T, vocab_size=97, dropout=0.0)
    return build_model(cfg, device="cpu", seed=3)


def _step(model, accum=1, clip=0.0, autocast=None):
    opt = bt.optim.AdamW(model.param_groups(0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    return TrainStep(model, opt, list(model.parameters()), device="cpu", lr_schedule=SCHED, accum=accum,
                     grad_clip=clip, autocast=autocast)


def _batches(accum):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(STEPS * accum):
        toks = rng.integers(0, 97, size=(B, T + 1))
        out.append((bt.tensor(toks[:, :-1]), bt.tensor(toks[:, 1:])))
    return out


def _reference(accum, clip, autocast=None):
    """The plain PyTorch-style loop: zero_grad, accumulate scaled losses, clip, step."""
    m = _model()
    opt = bt.optim.AdamW(m.param_groups(0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    it = iter(_batches(accum))
    losses = []
    for s in range(STEPS):
        for g in opt.param_groups:
            g["lr"] = SCHED[s]
        opt.zero_grad()
        tot = 0.0
        for _ in range(accum):
            x, y = next(it)
            if autocast is None:
                _, loss = m(x, y)
            else:
                with autocast():
                    _, loss = m(x, y)
            (loss * (1.0 / accum) if accum > 1 else loss).backward()
            tot += float(loss.item())
        if clip:
            bt.optim.clip_grad_norm_(m.parameters(), clip)
        opt.step()
        losses.append(tot / accum)
    return m, opt, losses


@pytest.mark.parametrize("accum, clip", [(1, 0.0), (1, 0.05), (3, 0.05)])
def test_captured_step_twin_equals_eager_loop(accum, clip, monkeypatch):
    ref_m, ref_o, ref = _reference(accum, clip)
    m = _model()
    st = _step(m, accum, clip)
    it = iter(_batches(accum))
    losses, warm, reads = [], 2, {"n": 0}
    cap = None
    for s in range(STEPS):
        if s < warm:
            st.run(lambda: next(it), SCHED[s])
        else:
            if cap is None:
                cap = CapturedStep(st, (B, T), make_capture=EagerCapture)
                cap.capture()
                x_buf, g_bufs = cap.x._data, [g._data for g in st.grads]
                # from here on a replay must never read a tensor on the host
                for name in ("item", "numpy", "tolist", "__float__", "__bool__", "__int__"):
                    orig = getattr(bt.Tensor, name)

                    def counting(self, *a, _orig=orig, **k):
                        reads["n"] += 1
                        return _orig(self, *a, **k)

                    monkeypatch.setattr(bt.Tensor, name, counting)
            cap.run(lambda: next(it), SCHED[s])
            assert cap.x._data is x_buf and all(g._data is b for g, b in zip(st.grads, g_bufs))  # static buffers
            assert float(st.lr_dev[0]) == np.float32(SCHED[s])  # this step's lr, taken on 'device'
        assert int(st.step_idx[0]) == s + 1
        r = st.read()
        losses.append(r.loss)
        assert not r.nonfinite and r.grad_norm > 0
    monkeypatch.undo()
    assert reads["n"] == 0
    assert cap.last.captures == 1 and (cap.micro is None) == (accum == 1)
    np.testing.assert_allclose(losses, ref, rtol=0, atol=2e-6)
    for (n, p), q in zip(m.named_parameters(), ref_m.parameters()):
        np.testing.assert_allclose(p.numpy(), q.numpy(), rtol=0, atol=2e-6, err_msg=n)
    assert {s["step"] for s in st.optimizer.state.values()} == {STEPS}


def test_micro_step_backward_starts_from_its_own_loss_and_finish_takes_the_mean():
    """Each micro-step's backward enters its loss with gradient exactly 1 (so the fused cross-entropy, whose
    forward already wrote the logits' gradient, has no scaling pass left), and finish() turns the accumulated
    sums into the means the PyTorch-style loop (loss / accum per micro-step) gets."""
    accum = 3
    m = _model()
    seen = []

    class Hooked:  # the model, its loss hooked to record the gradient flowing into it
        def __call__(self, x, y):
            logits, loss = m(x, y)
            loss.register_hook(lambda g: seen.append(float(g.item())))
            return logits, loss

    opt = bt.optim.AdamW(m.param_groups(0.1), lr=0.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    st = TrainStep(Hooked(), opt, list(m.parameters()), device="cpu", lr_schedule=[0.0], accum=accum)
    batches = _batches(accum)[:accum]
    it = iter(batches)
    st.run(lambda: next(it), 0.0)
    assert seen == [1.0] * accum
    ref = _model()
    for x, y in batches:
        (ref(x, y)[1] * (1.0 / accum)).backward()
    for (n, p), q in zip(m.named_parameters(), ref.parameters()):
        np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-5, atol=1e-7, err_msg=n)


def test_captured_step_twin_bf16_autocast_equals_eager_loop():
    ac = lambda: bt.autocast("cpu")  # noqa: E731
    ref_m, _, ref = _reference(2, 0.5, ac)
    m = _model()
    st = _step(m, 2, 0.5, ac)
    it = iter(_batches(2))
    losses = []
    cap = None
    for s in range(STEPS):
        if s >= 2 and cap is None:
            cap = CapturedStep(st, (B, T), make_capture=EagerCapture)
            cap.capture()
        (cap or st).run(lambda: next(it), SCHED[s])
        losses.append(st.read().loss)
        assert not bt.is_autocast_enabled("cpu") and bt.amp.cache_info()["entries"] == 0  # cache left empty
    np.testing.assert_allclose(losses, ref, rtol=0, atol=2e-6)
    for (n, p), q in zip(m.named_parameters(), ref_m.parameters()):
        np.testing.assert_allclose(p.numpy(), q.numpy(), rtol=0, atol=2e-6, err_msg=n)


def test_nonfinite_step_is_skipped_and_flagged():
    """A NaN loss sets the device flag; the update is skipped (parameters and AdamW counts unchanged)."""
    m = _model()
    st = _step(m, 2, 1.0)
    it = iter(_batches(2))
    st.run(lambda: next(it), SCHED[0])
    assert not st.read().nonfinite
    before = {n: p.numpy().copy() for n, p in m.named_parameters()}
    x, y = next(it)
    w = m.lm_head.weight if hasattr(m, "lm_head") else next(iter(m.parameters()))
    saved = w._data.copy()
    w._data[0, 0] = np.nan
    nxt = iter([(x, y), next(it)])
    st.run(lambda: next(nxt), SCHED[1])
    w._data[...] = saved
    r = st.read()
    assert r.nonfinite and not np.isfinite(r.loss)
    for n, p in m.named_parameters():
        np.testing.assert_array_equal(p.numpy(), before[n], err_msg=n)
    assert {s["step"] for s in st.optimizer.state.values()} == {1}
    assert int(st.step_idx[0]) == 2  # the schedule moves on: the next step uses step 2's lr


def test_capture_needs_optimizer_state_and_batch_shape():
    m = _model()
    st = _step(m)
    with pytest.raises(RuntimeError, match="no optimizer state yet"):
        CapturedStep(st, (B, T), make_capture=EagerCapture).capture()
    it = iter(_batches(1))
    st.run(lambda: next(it), SCHED[0])
    cap = CapturedStep(st, (B, T), make_capture=EagerCapture)
    cap.capture()
    with pytest.raises(ValueError, match="batch shape"):
        cap.run(lambda: (bt.zeros(2, T, dtype=bt.int64), bt.zeros(2, T, dtype=bt.int64)), SCHED[1])
    with pytest.raises(ValueError, match="outside the lr schedule"):
        st.seek(len(SCHED))


def _cfg(model=None, **train):
    t = {"steps": 4, "batch_tokens": 64, "micro_batch": 2, "seq_len": 32, "device": "cuda", "cuda_graph": True}
    t.update(train)
    m = {"n_layer": 1, "n_head": 2, "d_model": 32, "block_size": 32, "dropout": 0.0}
    m.update(model or {})
    return from_dict({"model": m, "train": t})


@pytest.mark.parametrize(
    "model, train, match",
    [
        ({}, {"device": "cpu"}, "need a CUDA device"),
        ({}, {"fused_adamw": False}, "fused_adamw"),
    ],
)
def test_config_refusals_name_the_key(model, train, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(model, **train).validate()


@pytest.mark.parametrize("train", [{"batch_tokens": 256}, {"nan_policy": "skip"}, {"world_size": 2,
                                                                                   "batch_tokens": 128},
                                   {"precision": "bf16"}, {"grad_clip": 0.0}, {"activation_checkpointing": True}])
def test_config_capture_accepts_accumulation_ddp_skip_bf16(train):
    check_config(_cfg(**train))


def test_cuda_graph_default_is_auto_and_values_checked():
    assert from_dict({}).train.cuda_graph == "auto"
    assert from_dict({"train": {"cuda_graph": "false"}}).train.cuda_graph is False
    with pytest.raises(ConfigError, match="train.cuda_graph must be true, false or \"auto\""):
        from_dict({"train": {"cuda_graph": "sometimes"}})


def test_trainer_refuses_cuda_graph_true_on_cpu(tmp_path):
    from blumodels.trainer import Trainer
    from models_helpers import micro_config

    cfg = micro_config(cuda_graph=True, device="auto")
    if bt.cuda.is_available():
        pytest.skip("a GPU is present: 'auto' resolves to cuda")
    with pytest.raises(ConfigError, match="cuda_graph = true needs a CUDA device"):
        Trainer(cfg, tmp_path, quiet=True)


@pytest.mark.parametrize("precision, accum_tokens, recompute, dropout", [
    ("fp32", 256, False, 0.0), ("fp32", 128, False, 0.0), ("bf16", 256, False, 0.0), ("fp32", 256, True, 0.0),
    ("fp32", 256, False, 0.1), ("fp32", 256, True, 0.1)])
def test_trainer_captured_path_twin_matches_eager_trainer(tmp_path, monkeypatch, precision, accum_tokens,
                                                          recompute, dropout):
    """Trainer.train_step with train.cuda_graph: 2 eager warm-up steps, capture, replays (CPU twin capture),
    with and without accumulation (micro_config: 4x32 tokens per micro-step)."""
    from blumodels.trainer import Trainer
    from models_helpers import micro_config

    def run(graph: bool, out):
        cfg = micro_config(batch_tokens=accum_tokens, steps=6, eval_interval=0, checkpoint_interval=0,
                           grad_clip=0.5, precision=precision, activation_checkpointing=recompute)
        cfg.model.dropout = dropout
        if graph:
            monkeypatch.setattr(gsm, "config_refusal", lambda cfg: None)
            monkeypatch.setattr(gsm, "runtime_refusal", lambda device, world=1: None)
        tr = Trainer(cfg, out, quiet=True)
        tr._make_capture = EagerCapture
        tr._step.device_rng = dropout > 0  # the device counter's code path, on NumPy (CUDA turns it on itself)
        tr.fit(save_final=False)
        tr.close()
        monkeypatch.undo()
        return tr, [r["loss"] for r in tr.history]

    _, ref = run(False, tmp_path / "eager")
    tr, got = run(True, tmp_path / "graph")
    assert [r.get("cuda_graph", False) for r in tr.history] == [False, False, True, True, True, True]
    assert tr._captured.last.captures == 1
    np.testing.assert_array_equal(got, ref)  # the same code, the same order of operations
    assert {st["step"] for st in tr.optimizer.state.values()} == {6}


def test_static_grads_are_disjoint_aligned_views_of_one_buffer():
    m = _model()
    ps = list(m.parameters())
    grads, bufs = flat_grads(ps, "cpu")
    assert len(bufs) == 1 and all(g.shape == p.shape and g.dtype is p.dtype for g, p in zip(grads, ps))
    base = bufs[0].__array_interface__["data"][0]
    spans = sorted((g._data.__array_interface__["data"][0] - base, g._data.nbytes) for g in grads)
    assert all(o % 256 == 0 for o, _ in spans)
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))  # no overlap
    for g in grads:
        g._data += 1.0
    bufs[0].fill(0)  # the step's single zeroing pass reaches every gradient
    assert all(not g._data.any() for g in grads)


@pytest.mark.parametrize("accum_tokens", [128, 256])
def test_trainer_compile_runs_the_step_through_the_compiler_plugin(tmp_path, accum_tokens):
    """train.compile = true: bt.compile (blucompiler, found through its entry point) traces the step's micro-step
    (forward, backward accumulating into the static gradients, the loss sum) and replays it compiled; the losses
    and weights equal the eager Trainer's (the generated CPU kernels round like NumPy to ~1e-7)."""
    pytest.importorskip("blucompiler")
    from blumodels.trainer import Trainer
    from models_helpers import micro_config

    def run(compile_, out):
        cfg = micro_config(batch_tokens=accum_tokens, steps=5, eval_interval=0, checkpoint_interval=0,
                           grad_clip=0.5, compile=compile_)
        tr = Trainer(cfg, out, quiet=True)
        tr.fit(save_final=False)
        tr.close()
        return tr

    ref, got = run(False, tmp_path / "eager"), run(True, tmp_path / "compiled")
    rep = got._compiled.report()
    n = accum_tokens // 128  # micro-steps per step: one specialisation each (sync False / True)
    assert rep["eager_steps"] == [] and rep["specialisations"] == n
    assert rep["calls"] == 4  # per specialisation: 1 trace, then 4 replays
    np.testing.assert_allclose([r["loss"] for r in got.history], [r["loss"] for r in ref.history], rtol=1e-5)
    for (n, p), q in zip(got.model.named_parameters(), ref.model.parameters()):
        np.testing.assert_allclose(p.numpy(), q.numpy(), rtol=1e-4, atol=1e-4, err_msg=n)  # params ~1e-2


def test_compile_refused_with_ddp():
    with pytest.raises(ConfigError, match="train.compile = true traces one process's step"):
        from_dict({"train": {"compile": True, "world_size": 2, "batch_tokens": 2 * 16 * 1024}})


def _oib_step(model):
    from blutensor.utils import OptimizerInBackward

    opt = OptimizerInBackward(bt.optim.AdamW(model.param_groups(0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8))
    return TrainStep(model, opt, list(model.parameters()), device="cpu", lr_schedule=SCHED,
                     optimizer_in_backward=True)


def test_captured_optimizer_in_backward_twin_equals_eager_and_plain(monkeypatch):
    """Optimizer-in-backward captured (CPU twin): its per-parameter AdamW updates read lr and update count from
    the arrays begin() writes, never the host's: replays with a NaN host lr and poisoned host step counts give
    the eager OIB step's losses and weights, which equal the plain loop's bit for bit."""
    ref_m, _, ref = _reference(1, 0.0)
    eager_m = _model()
    eager = _oib_step(eager_m)
    it = iter(_batches(1))
    eager_losses = []
    for s in range(STEPS):
        eager.run(lambda: next(it), SCHED[s])
        eager_losses.append(eager.read().loss)
        assert eager.read().grad_norm is None
    m = _model()
    st = _oib_step(m)
    assert st.oib_on_device and not st.grads
    it = iter(_batches(1))
    losses, reads, cap = [], {"n": 0}, None
    for s in range(STEPS):
        if s < 2:
            st.run(lambda: next(it), SCHED[s])
        else:
            if cap is None:
                cap = CapturedStep(st, (B, T), make_capture=EagerCapture)
                cap.capture()
                for name in ("item", "numpy", "tolist", "__float__", "__bool__", "__int__"):
                    orig = getattr(bt.Tensor, name)

                    def counting(self, *a, _orig=orig, **k):
                        reads["n"] += 1
                        return _orig(self, *a, **k)

                    monkeypatch.setattr(bt.Tensor, name, counting)
            for state in st.optimizer.state.values():
                state["step"] = 10**6  # a host count the update must not read
            cap.run(lambda: next(it), float("nan"))  # nor the host lr
            assert float(st.step_count[0]) == s + 1
        r = st.read()
        losses.append(r.loss)
        assert r.grad_norm is None and not r.nonfinite
        assert all(p.grad is None for p in m.parameters())  # every gradient freed after its update
    monkeypatch.undo()
    assert reads["n"] == 0 and cap.last.captures == 1
    np.testing.assert_array_equal(losses, eager_losses)
    np.testing.assert_array_equal(losses, ref)
    for (n, p), q, e in zip(m.named_parameters(), ref_m.parameters(), eager_m.parameters()):
        np.testing.assert_array_equal(p.numpy(), e.numpy(), err_msg=n)
        np.testing.assert_array_equal(p.numpy(), q.numpy(), err_msg=n)
    assert {s["step"] for s in st.optimizer.state.values()} == {STEPS}


def test_trainer_captures_optimizer_in_backward_twin(tmp_path, monkeypatch):
    """train.optimizer_in_backward under the captured path (CPU twin): warm-up, capture, replays, equal losses."""
    from blumodels.trainer import Trainer
    from models_helpers import micro_config

    def run(graph: bool, out):
        cfg = micro_config(batch_tokens=128, steps=5, eval_interval=0, checkpoint_interval=0, grad_clip=0.0,
                           optimizer_in_backward=True)
        if graph:
            monkeypatch.setattr(gsm, "runtime_refusal", lambda device, world=1: None)
            monkeypatch.setattr(gsm, "config_refusal", lambda cfg: None)
        tr = Trainer(cfg, out, quiet=True)
        tr._make_capture = EagerCapture
        tr.fit(save_final=False)
        tr.close()
        monkeypatch.undo()
        return tr, [r["loss"] for r in tr.history]

    _, ref = run(False, tmp_path / "eager")
    tr, got = run(True, tmp_path / "graph")
    assert [r.get("cuda_graph", False) for r in tr.history] == [False, False, True, True, True]
    np.testing.assert_array_equal(got, ref)
    assert {st["step"] for st in tr.optimizer.state.values()} == {5}


def test_optimizer_in_backward_capture_config():
    """Capture accepts optimizer-in-backward; what it cannot do stays refused by name at config time."""
    check_config(_cfg(optimizer_in_backward=True, grad_clip=0.0))
    with pytest.raises(ConfigError, match="fused_adamw"):
        _cfg(optimizer_in_backward=True, grad_clip=0.0, fused_adamw=False).validate()
    with pytest.raises(ConfigError, match="incompatible with gradient clipping"):
        _cfg(optimizer_in_backward=True, grad_clip=1.0).validate()
    with pytest.raises(ConfigError, match="nan_policy = 'skip'"):
        _cfg(optimizer_in_backward=True, grad_clip=0.0, nan_policy="skip").validate()
