"""Guards (a new shape retraces and the report says what changed) and eager fallbacks."""

import blucompiler
import blutensor as bt
import blutensor.nn.functional as F
import numpy as np
from helpers import batch, make_model, maxdiff, tiny_cfg, train_step


def test_new_shape_retraces_and_is_reported():
    cfg = tiny_cfg(n_layer=1)
    m_e, o_e = make_model(cfg)
    m_c, o_c = make_model(cfg)
    eager, comp = train_step(m_e, o_e), blucompiler.compile(train_step(m_c, o_c), backend="c")
    rng = np.random.default_rng(0)
    for T in (16, 16, 8, 8, 16):
        x, y = batch(rng, T=T)
        assert abs(eager(x, y).item() - comp(x, y).item()) <= 1e-6
    rep = comp.report()
    assert rep["specialisations"] == 2
    assert rep["retraces"][0] == "argument 0: shape (2, 16) -> (2, 8)"
    assert len(rep["retraces"]) == 1  # back to T=16 reuses the first specialisation: no new trace
    assert len(rep["trace_seconds"]) == 2


def test_dtype_change_retraces():
    w = bt.tensor(np.ones((3,), np.float32), requires_grad=True)
    f = blucompiler.compile(lambda x: (x * 2).sum(), backend="numpy")
    f(bt.tensor(np.ones(3, np.float32)))
    f(bt.tensor(np.ones(3, np.float64)))
    assert f.report()["retraces"] == ["argument 0: dtype float32 -> float64"]
    del w


def test_live_tensor_shape_change_retraces():
    w = bt.tensor(np.ones((3,), np.float32))
    f = blucompiler.compile(lambda x: (x * w).sum(), backend="numpy")
    x = bt.tensor(np.ones(3, np.float32))
    assert f(x).item() == 3.0
    w._data = np.ones(4, np.float32)
    x4 = bt.tensor(np.full(4, 2.0, np.float32))
    assert f(x4).item() == 8.0
    assert "argument 0: shape (3,) -> (4,)" in f.report()["retraces"]


def test_forced_eager_op_runs_inside_compiled_step_and_is_reported():
    cfg = tiny_cfg(n_layer=1)
    m_e, o_e = make_model(cfg)
    m_c, o_c = make_model(cfg)
    eager = train_step(m_e, o_e)
    comp = blucompiler.compile(train_step(m_c, o_c), backend="c", force_eager=("layer_norm", "sdpa"))
    rng = np.random.default_rng(1)
    for _ in range(3):
        x, y = batch(rng)
        assert abs(eager(x, y).item() - comp(x, y).item()) <= 1e-6
    for pe, pc in zip(m_e.parameters(), m_c.parameters()):
        assert maxdiff(pe.grad.numpy(), pc.grad.numpy()) <= 1e-6
    rep = comp.report()
    assert rep["fallback_ops"] == {"layer_norm": 3, "sdpa": 1}
    assert "force_eager" in rep["fallback_reasons"]["layer_norm"]
    assert rep["kernels"]["eager_calls"] == 2 * 4  # forward + backward replay of each
    assert '"blu.eager"' in comp.ir() and "op = \"layer_norm\"" in comp.ir()


def test_untraceable_op_falls_back_with_reason():
    """An op whose kernel reads a value on the host (boolean-mask indexing) runs eagerly."""
    w = bt.tensor(np.array([1.0, -2.0, 3.0, -4.0], np.float32), requires_grad=True)

    def step(x):
        w.grad = None
        z = x * w
        y = z[z > 0]  # boolean mask: a data-dependent shape
        loss = y.sum() + (w * w).sum()
        loss.backward()
        return loss

    f = blucompiler.compile(step, backend="c")
    x = bt.tensor(np.ones(4, np.float32))
    for _ in range(2):
        assert f(x).item() == 4.0 + 30.0
        np.testing.assert_allclose(w.grad.numpy(), [3.0, -4.0, 7.0, -8.0])
    rep = f.report()
    assert "index" in rep["fallback_ops"] and "index" in rep["fallback_reasons"]


def test_host_read_inside_step_runs_whole_step_eagerly():
    w = bt.tensor(np.ones(3, np.float32), requires_grad=True)

    def step(x):
        w.grad = None
        loss = (x * w).sum()
        loss.backward()
        return float(loss.item())

    f = blucompiler.compile(step, backend="numpy")
    x = bt.tensor(np.ones(3, np.float32))
    assert f(x) == 3.0 and f(x) == 3.0
    rep = f.report()
    assert rep["specialisations"] == 0 and "item()" in rep["eager_steps"][0]


def test_dropout_step_is_refused_clearly():
    x = bt.tensor(np.ones((4, 4), np.float32))
    f = blucompiler.compile(lambda t: F.dropout(t, 0.5, True).sum(), backend="numpy")
    f(x)
    assert "dropout" in f.report()["eager_steps"][0]


def test_sgd_with_momentum_and_changing_lr():
    """SGD's hyperparameters are host scalars; its first momentum step runs eagerly, then it traces."""
    cfg = tiny_cfg(n_layer=1)
    ms = []
    for _ in range(2):
        m, _ = make_model(cfg)
        ms.append((m, bt.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)))
    (m_e, o_e), (m_c, o_c) = ms
    eager, comp = train_step(m_e, o_e), blucompiler.compile(train_step(m_c, o_c), backend="c")
    rng = np.random.default_rng(4)
    for i in range(4):
        for g1, g2 in zip(o_e.param_groups, o_c.param_groups):
            g1["lr"] = g2["lr"] = 0.1 / (i + 1)
        x, y = batch(rng)
        assert abs(eager(x, y).item() - comp(x, y).item()) <= 1e-6
    for pe, pc in zip(m_e.parameters(), m_c.parameters()):
        assert maxdiff(pe.numpy(), pc.numpy()) <= 1e-6
    rep = comp.report()
    assert rep["specialisations"] == 1 and "momentum" in rep["retraces"][0]


def test_grad_clipping_inside_the_compiled_step():
    """clip_grad_norm_ reads the norm on the host eagerly; its trace rule keeps the scale on the device."""
    cfg = tiny_cfg(n_layer=1)
    runs = []
    for compiled in (False, True):
        m, o = make_model(cfg, lr=1e-2)

        def step(x, y, m=m, o=o):
            o.zero_grad()
            _, loss = m(x, y)
            loss.backward()
            norm = bt.optim.clip_grad_norm_(m.parameters(), 0.05)
            o.step()
            return loss, norm

        f = blucompiler.compile(step, backend="c") if compiled else step
        rng = np.random.default_rng(5)
        out = [tuple(t.item() for t in f(*batch(rng))) for _ in range(3)]
        runs.append((out, [p.numpy().copy() for p in m.parameters()], f))
    (oe, pe, _), (oc, pc, f) = runs
    for (le, ne), (lc, nc) in zip(oe, oc):
        assert abs(le - lc) <= 1e-6 and abs(ne - nc) <= 1e-6 * max(1.0, ne)
    assert oe[0][1] > 0.05  # clipping was active
    for a, b in zip(pe, pc):
        assert maxdiff(a, b) <= 1e-5
    assert f.report()["specialisations"] == 1 and f.report()["eager_steps"] == []


def test_kernel_compile_failure_keeps_the_step_correct(monkeypatch, tmp_path):
    """No working C compiler: the kernels stay interpreted by NumPy and the report says why."""
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("BLU_COMPILER_CACHE", str(tmp_path))
    from blucompiler import lower_c

    monkeypatch.setattr(lower_c, "_loaded", {})  # nothing compiled earlier in this process
    cfg = tiny_cfg(n_layer=1)
    m_e, o_e = make_model(cfg)
    m_c, o_c = make_model(cfg)
    eager, comp = train_step(m_e, o_e), blucompiler.compile(train_step(m_c, o_c), backend="c")
    rng = np.random.default_rng(6)
    for _ in range(3):
        x, y = batch(rng)
        assert eager(x, y).item() == comp(x, y).item()
    k = comp.report()["kernels"]
    assert k["generated_kernels"] == 0 and "FileNotFoundError" in k["compile_error"]
