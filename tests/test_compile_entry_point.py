"""bt.compile finds blucompiler through its installed entry point (blutensor imports no compiler) and the
compiled GPT-2 training step matches the eager one (loss, gradients, parameters)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import blutensor as bt
import numpy as np
import pytest

HELPERS = Path(__file__).resolve().parent.parent / "packages" / "blucompiler" / "tests" / "helpers.py"

pytest.importorskip("blucompiler")
pytest.importorskip("blumodels")


def _helpers():
    """blucompiler's own test helpers (tiny GPT-2, its training step, batches): one copy of them."""
    spec = importlib.util.spec_from_file_location("blucompiler_test_helpers", HELPERS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_default_compiler_is_blucompiler_and_matches_eager(monkeypatch):
    monkeypatch.delenv("BLUTRAIN_COMPILER", raising=False)
    import blucompiler

    assert "blucompiler" in bt.compiler_backends()
    h = _helpers()
    cfg = h.tiny_cfg(n_layer=1, vocab_size=64)
    m_e, o_e = h.make_model(cfg)
    m_c, o_c = h.make_model(cfg)
    eager = h.train_step(m_e, o_e)
    comp = bt.compile(h.train_step(m_c, o_c), options={"backend": "numpy"})
    assert isinstance(comp, blucompiler.CompiledStep)
    rng = np.random.default_rng(0)
    with bt.ext.reference_kernels():  # eager on the NumPy reference kernels, which the interpreter follows
        for _ in range(3):
            x, y = h.batch(rng, V=64)
            assert eager(x, y).item() == comp(x, y).item()  # the interpreting backend is bit-exact with eager
    for (name, pe), pc in zip(m_e.named_parameters(), m_c.parameters()):
        np.testing.assert_array_equal(pe.numpy(), pc.numpy(), err_msg=name)
    assert comp.report()["calls"] == 2  # first call traces, later ones replay the compiled step
