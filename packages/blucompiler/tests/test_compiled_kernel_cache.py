"""Compiled C kernels are loaded from blucompiler's cache only when they match their SHA-256 record
(blutensor.kernel_cache): a damaged shared object is rebuilt (a warning names it) and computes right."""

import numpy as np
import pytest
from blucompiler import lower_c
from blucompiler.codegen import Input, KernelSpec, KOp
from blutensor.ext import kernel_cache as kc


def _spec(name):
    f32 = np.dtype(np.float32)
    return KernelSpec(name, "elementwise", (64,), [Input("ptr", f32, (64,), (1,))],
                      [KOp("tanh", [("in", 0)], f32)], [("v", 0)], [f32])


def _run(fns, name):
    x = np.linspace(-3, 3, 64, dtype=np.float32)
    out = np.empty(64, np.float32)
    fns[name]([x], [out])
    np.testing.assert_allclose(out.astype(np.float64), np.tanh(x.astype(np.float64)), rtol=1e-6, atol=1e-7)


def test_damaged_shared_object_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("BLU_COMPILER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(lower_c, "_loaded", {})
    _run(lower_c.compile_c([_spec("k_cache_a")]), "k_cache_a")
    (so,) = (tmp_path / "cache").glob("blu_*.so")
    assert kc.verified(so)
    raw = bytearray(so.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    so.unlink()  # a new file: the copy this process has loaded stays intact
    so.write_bytes(bytes(raw))
    monkeypatch.setattr(lower_c, "_loaded", {})  # as a new process would
    with pytest.warns(RuntimeWarning, match=rf"compiled kernel {so} does not match its SHA-256 record"):
        fns = lower_c.compile_c([_spec("k_cache_a")])
    assert kc.verified(so)
    _run(fns, "k_cache_a")
