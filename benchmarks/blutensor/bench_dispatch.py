"""Per-op dispatch overhead of blutensor vs PyTorch CPU eager on small (8x8) tensors.

pytest-benchmark suite (one group per op, blutensor and torch side by side)::

    pytest benchmarks/blutensor/bench_dispatch.py --benchmark-only --benchmark-group-by=group

Ratio table (median time per call, blutensor / torch, and the geometric mean)::

    python benchmarks/blutensor/bench_dispatch.py [--json out.json]

On tensors this small both libraries spend their time in Python/C++ dispatch, not in arithmetic,
so the ratio measures framework overhead.
"""

from __future__ import annotations

import json
import math
import platform
import sys
import timeit

import blutensor as bt
import numpy as np
import pytest
import torch

torch.set_num_threads(1)


def _make():
    r = np.random.default_rng(0)
    a, b = r.standard_normal((8, 8)).astype(np.float32), r.standard_normal((8, 8)).astype(np.float32)
    B = dict(a=bt.tensor(a), b=bt.tensor(b), g=bt.tensor(a, requires_grad=True))
    T = dict(a=torch.tensor(a), b=torch.tensor(b), g=torch.tensor(a, requires_grad=True))
    return B, T


B, T = _make()
BF = bt.nn.functional
TF = torch.nn.functional

# op -> (blutensor call, torch call); each is one op through the public API
OPS = {
    "add": (lambda: B["a"] + B["b"], lambda: T["a"] + T["b"]),
    "mul_scalar": (lambda: B["a"] * 2.0, lambda: T["a"] * 2.0),
    "exp": (lambda: B["a"].exp(), lambda: T["a"].exp()),
    "sum_dim": (lambda: B["a"].sum(dim=1), lambda: T["a"].sum(dim=1)),
    "matmul": (lambda: B["a"] @ B["b"], lambda: T["a"] @ T["b"]),
    "view": (lambda: B["a"].view(64), lambda: T["a"].view(64)),
    "transpose": (lambda: B["a"].transpose(0, 1), lambda: T["a"].transpose(0, 1)),
    "slice": (lambda: B["a"][1:3], lambda: T["a"][1:3]),
    "softmax": (lambda: BF.softmax(B["a"], -1), lambda: TF.softmax(T["a"], -1)),
    "gt": (lambda: B["a"] > 0, lambda: T["a"] > 0),
    "mul_grad": (lambda: B["g"] * B["b"], lambda: T["g"] * T["b"]),  # records a graph node
}


@pytest.mark.parametrize("lib", ["blutensor", "torch"])
@pytest.mark.parametrize("op", list(OPS))
def test_dispatch(benchmark, op, lib):
    benchmark.group = op
    fn = OPS[op][0 if lib == "blutensor" else 1]
    benchmark(fn)


NA, NB = B["a"]._data, B["b"]._data
# the same computation in raw NumPy: the floor under blutensor's CPU backend
NUMPY = {
    "add": lambda: NA + NB, "mul_scalar": lambda: NA * 2.0, "exp": lambda: np.exp(NA),
    "sum_dim": lambda: NA.sum(axis=1), "matmul": lambda: NA @ NB, "view": lambda: NA.reshape(64),
    "transpose": lambda: NA.swapaxes(0, 1), "slice": lambda: NA[1:3],
    "softmax": lambda: (lambda e: e / e.sum(-1, keepdims=True))(np.exp(NA - NA.max(-1, keepdims=True))),
    "gt": lambda: NA > 0, "mul_grad": lambda: NA * NB,
}


def measure(number: int = 5000, repeat: int = 15) -> dict:
    """Best-of-``repeat`` mean time per call (microseconds) for each op and library; the libraries
    are timed alternately so that load from other processes hits both alike."""
    out = {}
    for op, (f_bt, f_t) in OPS.items():
        f_bt(), f_t()  # warm caches
        tb = tt = tn = float("inf")
        for _ in range(repeat):
            tb = min(tb, timeit.timeit(f_bt, number=number))
            tt = min(tt, timeit.timeit(f_t, number=number))
            tn = min(tn, timeit.timeit(NUMPY[op], number=number))
        tb, tt, tn = (x / number * 1e6 for x in (tb, tt, tn))
        out[op] = {"blutensor_us": round(tb, 3), "torch_us": round(tt, 3), "numpy_us": round(tn, 3),
                   "ratio": round(tb / tt, 3)}
    return out


if __name__ == "__main__":
    res = measure()
    geo = math.exp(sum(math.log(v["ratio"]) for v in res.values()) / len(res))
    print(f"{'op':12s} {'blutensor us':>13s} {'torch us':>9s} {'ratio':>6s} {'raw numpy us':>13s}")
    for op, v in res.items():
        print(f"{op:12s} {v['blutensor_us']:13.2f} {v['torch_us']:9.2f} {v['ratio']:6.2f} {v['numpy_us']:13.2f}")
    print(f"geometric-mean ratio blutensor/torch: {geo:.2f} (torch {torch.__version__}, numpy {np.__version__}, "
          f"{platform.processor() or platform.machine()})")
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as fh:
            json.dump({"ops": res, "geomean_ratio": geo, "torch": torch.__version__, "numpy": np.__version__,
                       "blutensor": bt.__version__}, fh, indent=1)
