"""Per-call cost of blutensor's public op surface on small CPU tensors: operators, ``blutensor.functional``
wrappers and Tensor methods (the Python layer above the dispatcher, which the op table generates).

    python benchmarks/blutensor/bench_surface.py [--calls 100000] [--repeats 5] [--json PATH]

Each case runs ``--calls`` calls ``--repeats`` times; the best run is reported in microseconds per call of
process CPU time (on a shared machine, time spent descheduled is not the code's).
"""

from __future__ import annotations

import argparse
import json
import time

import blutensor as bt
import blutensor.nn.functional as NF
import numpy as np


def cases():
    rng = np.random.default_rng(0)
    a = bt.tensor(rng.standard_normal((4, 4)).astype(np.float32))
    b = bt.tensor(rng.standard_normal((4, 4)).astype(np.float32))
    c = bt.tensor(rng.standard_normal((4, 4)).astype(np.float32))
    return {
        "a + b": lambda: a + b,
        "a * 2.0": lambda: a * 2.0,
        "F.gelu(x)": lambda: NF.gelu(a),
        "x.sum()": lambda: a.sum(),
        "x.exp()": lambda: a.exp(),
        "bt.add(a, b)": lambda: bt.add(a, b),
        "x.transpose(0, 1)": lambda: a.transpose(0, 1),
        "x.amax(dim=1)": lambda: a.amax(dim=1),
        "F.silu(x)": lambda: NF.silu(a),
        "x.add_(b) no_grad": lambda: a.add_(b),
        "x.sigmoid_()": lambda: c.sigmoid_(),
    }


def measure(fn, calls: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, time.process_time() - t0)
    return best / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    res = {name: round(measure(fn, args.calls, args.repeats), 3) for name, fn in cases().items()}
    for name, us in res.items():
        print(f"{name:20s} {us:8.3f} us/call")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python benchmarks/blutensor/bench_surface.py " + " ".join(
                f"--{k} {v}" for k, v in (("calls", args.calls), ("repeats", args.repeats))),
                "us_per_call": res, "blutensor": bt.__version__, "numpy": np.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
