"""The training step's device work never reads device memory on the host (no host sync).

On the CPU (the GPU proof is CUDA-graph capture itself, which refuses host reads: blumodels'
test_graph_step_cuda.py): the fake CUDA device (testing/fake_cuda/, through tests/fake_device_plugin.py) runs
blutensor's CUDA branch, and every way of bringing a device value to the host (``float()``, ``int()``, ``bool()``,
``.item()``, ``.get()``, ``.tolist()``, ``cupy.asnumpy``) is counted. clip_grad_norm_ (L2 and inf norms, with and
without clipping) must count zero and match NumPy.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

SCRIPT = r"""
import numpy as np
import fake_device_plugin  # noqa: F401  (generic CUDA branch on the fake device)
import cupy
import blutensor as bt

reads = {"n": 0, "where": []}
for name in ("__float__", "__int__", "__bool__", "__index__", "item", "get", "tolist"):
    orig = getattr(cupy.ndarray, name, None)
    if orig is None:
        continue
    def counting(self, *a, _o=orig, _n=name, **k):
        reads["n"] += 1
        reads["where"].append(_n)
        return _o(self, *a, **k)
    setattr(cupy.ndarray, name, counting)
_asnumpy = cupy.asnumpy
def asnumpy(a, *x, **k):
    reads["n"] += 1
    reads["where"].append("asnumpy")
    return _asnumpy(a, *x, **k)
cupy.asnumpy = asnumpy

rng = np.random.default_rng(0)
for norm_type, max_norm in ((2.0, 0.5), (2.0, 1e9), (float("inf"), 0.1)):
    gs = [rng.standard_normal(s).astype(np.float32) for s in ((4, 5), (7,), (3, 3, 2))]
    ps = []
    for g in gs:
        p = bt.zeros(*g.shape, device="cuda", requires_grad=True)
        p.grad = bt.Tensor._from_data(cupy.asarray(g), None, p.device)
        ps.append(p)
    n0 = reads["n"]
    total = bt.optim.clip_grad_norm_(ps, max_norm, norm_type=norm_type)
    assert reads["n"] == n0, (norm_type, reads["where"][n0:])
    flat = np.concatenate([g.ravel() for g in gs]).astype(np.float64)
    want = np.abs(flat).max() if norm_type == float("inf") else np.sqrt((flat ** 2).sum())
    got = np.asarray(total._data.view(np.ndarray))
    assert abs(float(got) - want) <= 1e-5 * want, (got, want)
    coef = min(1.0, max_norm / (want + 1e-6))
    for p, g in zip(ps, gs):
        np.testing.assert_allclose(np.asarray(p.grad._data.view(np.ndarray)), g * coef, rtol=1e-5, atol=1e-7)
print("OK", reads["n"])
"""


def test_clip_grad_norm_never_reads_device_memory_on_host(tmp_path):
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parent.parent / "src")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), src, env.get("PYTHONPATH", "")])
    env["BLUTRAIN_GEMM"] = "xp"
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
