"""bt.compile finds blucompiler through its installed entry point (blutensor imports no compiler) and the
compiled GPT-2 training step matches the eager one (loss, gradients, parameters)."""

from __future__ import annotations

import blutensor as bt
import numpy as np
import pytest

pytest.importorskip("blucompiler")
pytest.importorskip("blumodels")


def _model(seed=0):
    from blumodels.config import ModelConfig
    from blumodels.gpt2 import GPT2

    bt.manual_seed(seed)
    m = GPT2(ModelConfig(n_layer=1, n_head=2, d_model=32, block_size=16, vocab_size=64))
    return m, bt.optim.AdamW(m.param_groups(0.1), lr=1e-3, weight_decay=0.1)


def _step(model, opt):
    def step(x, y):
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        return loss

    return step


def test_default_compiler_is_blucompiler_and_matches_eager(monkeypatch):
    monkeypatch.delenv("BLUTRAIN_COMPILER", raising=False)
    import blucompiler

    assert "blucompiler" in bt.compiler_backends()
    m_e, o_e = _model()
    m_c, o_c = _model()
    eager = _step(m_e, o_e)
    comp = bt.compile(_step(m_c, o_c), options={"backend": "numpy"})
    assert isinstance(comp, blucompiler.CompiledStep)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = bt.tensor(rng.integers(0, 64, (2, 16)), dtype=bt.int64)
        y = bt.tensor(rng.integers(0, 64, (2, 16)), dtype=bt.int64)
        assert eager(x, y).item() == comp(x, y).item()  # the interpreting backend is bit-exact with eager
    for (name, pe), pc in zip(m_e.named_parameters(), m_c.parameters()):
        np.testing.assert_array_equal(pe.numpy(), pc.numpy(), err_msg=name)
    assert comp.report()["calls"] == 2  # first call traces, later ones replay the compiled step
