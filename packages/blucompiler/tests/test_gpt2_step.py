"""Compiled == eager for the GPT-2 training step (forward, backward, AdamW, zero_grad)."""

import blucompiler
import numpy as np
import pytest
from helpers import batch, make_model, maxdiff, tiny_cfg, train_step


@pytest.mark.parametrize("backend", ["c", "numpy"])
def test_gpt2_step_matches_eager(backend):
    cfg = tiny_cfg()
    m_e, o_e = make_model(cfg)
    m_c, o_c = make_model(cfg)
    eager = train_step(m_e, o_e)
    comp = blucompiler.compile(train_step(m_c, o_c), backend=backend)
    rng = np.random.default_rng(0)
    for _ in range(4):
        x, y = batch(rng)
        le, lc = eager(x, y).item(), comp(x, y).item()
        assert abs(le - lc) <= 1e-6, (le, lc)
        for (name, pe), pc in zip(m_e.named_parameters(), m_c.parameters()):
            assert maxdiff(pe.grad.numpy(), pc.grad.numpy()) <= 1e-6, name
            assert maxdiff(pe.numpy(), pc.numpy()) <= 1e-5, name
    for pe, pc in zip(m_e.parameters(), m_c.parameters()):
        assert o_e.state[pe]["step"] == o_c.state[pc]["step"] == 4
        assert maxdiff(o_e.state[pe]["exp_avg_sq"].numpy(), o_c.state[pc]["exp_avg_sq"].numpy()) <= 1e-9
    rep = comp.report()
    assert rep["specialisations"] == 1 and rep["calls"] == 3 and rep["fallback_ops"] == {}
    k = rep["kernels"]
    assert k["compiled_launches"] < k["eager_primitive_ops"] / 3
    if backend == "c":
        assert k["generated_kernels"] == k["fused_kernels"]


def test_numpy_backend_is_bit_exact():
    """The interpreting backend runs the same NumPy operations as eager, so results are identical."""
    cfg = tiny_cfg(n_layer=1)
    m_e, o_e = make_model(cfg)
    m_c, o_c = make_model(cfg)
    eager, comp = train_step(m_e, o_e), blucompiler.compile(train_step(m_c, o_c), backend="numpy")
    rng = np.random.default_rng(1)
    for _ in range(3):
        x, y = batch(rng)
        assert eager(x, y).item() == comp(x, y).item()
    for pe, pc in zip(m_e.parameters(), m_c.parameters()):
        np.testing.assert_array_equal(pe.numpy(), pc.numpy())


def test_parameters_updated_in_place_without_copies():
    """Live memory: the compiled step writes parameters and optimizer state into their own arrays."""
    cfg = tiny_cfg(n_layer=1)
    m, o = make_model(cfg)
    comp = blucompiler.compile(train_step(m, o), backend="c")
    rng = np.random.default_rng(2)
    comp(*batch(rng))
    ids = [id(p._data) for p in m.parameters()]
    ptrs = [p._data.ctypes.data for p in m.parameters()]
    st_ptrs = [o.state[p]["exp_avg"]._data.ctypes.data for p in m.parameters()]
    before = [p.numpy().copy() for p in m.parameters()]
    comp(*batch(rng))
    comp(*batch(rng))
    assert ids == [id(p._data) for p in m.parameters()]
    assert ptrs == [p._data.ctypes.data for p in m.parameters()]
    assert st_ptrs == [o.state[p]["exp_avg"]._data.ctypes.data for p in m.parameters()]
    assert any(maxdiff(b, p.numpy()) > 0 for b, p in zip(before, m.parameters()))
    fused = [o for o in comp.last.mod.walk() if o.name == "blu.fused" and "inplace" in o.attributes]
    assert fused, "AdamW updates should be planned in place"


def test_learning_rate_change_is_seen_without_retrace():
    """lr and the bias corrections are host scalars read every call, not constants of the trace."""
    cfg = tiny_cfg(n_layer=1)
    m_e, o_e = make_model(cfg)
    m_c, o_c = make_model(cfg)
    eager, comp = train_step(m_e, o_e), blucompiler.compile(train_step(m_c, o_c), backend="c")
    rng = np.random.default_rng(3)
    for i in range(3):
        for g1, g2 in zip(o_e.param_groups, o_c.param_groups):
            g1["lr"] = g2["lr"] = 1e-3 * (i + 1)
        x, y = batch(rng)
        eager(x, y)
        comp(x, y)
    for pe, pc in zip(m_e.parameters(), m_c.parameters()):
        assert maxdiff(pe.numpy(), pc.numpy()) <= 1e-5
    assert comp.report()["specialisations"] == 1
