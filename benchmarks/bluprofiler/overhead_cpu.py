"""Measure the profiler's cost on CPU: step time with bluprofiler never used, after a session
(profiler off), and with a session running (timing+memory, and timing only).

    python benchmarks/bluprofiler/overhead_cpu.py [preset=small] [reps=7]

Prints min/median step ms (process CPU time, one BLAS thread) per mode and the ratios of the
minima; the modes are interleaved so drift hits all of them alike.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one thread: process CPU time == work done
os.environ.setdefault("OMP_NUM_THREADS", "1")

import statistics
import sys
import time

from bluprofiler import profile
from bluprofiler.demo import make_gpt_step

#: process CPU time: robust on a shared machine (other processes do not inflate it)
CLOCK = time.process_time


def block(step, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = CLOCK()
        step()
        out.append((CLOCK() - t) * 1e3)
    return out


def per_span_cost(n: int = 20000) -> dict[str, float]:
    """Microseconds added per op span (min of 5 interleaved loops, off vs on): a no-grad forward
    (``bt.add`` of two 4-element tensors), a forward that records a node (``exp`` chain of a leaf
    that requires grad) and a backward span (the ``exp`` chain's backward)."""
    import blutensor as bt

    a, b = bt.randn(4), bt.randn(4)
    x = bt.randn(4, requires_grad=True)
    k = max(n // 8, 1)

    def loop_add() -> float:
        t = CLOCK()
        for _ in range(n):
            bt.add(a, b)
        return (CLOCK() - t) / n * 1e6

    def loop_fwd() -> float:  # 4 forward spans with nodes per iteration
        t = CLOCK()
        for _ in range(k):
            bt.exp(bt.exp(bt.exp(bt.exp(x))))
        return (CLOCK() - t) / k * 1e6

    def loop_fb() -> float:  # 5 forward + 5 backward spans (sum, 4 exp) per iteration
        t = CLOCK()
        for _ in range(k):
            bt.sum(bt.exp(bt.exp(bt.exp(bt.exp(x * 0.0))))).backward()
        return (CLOCK() - t) / k * 1e6

    loops = {"add": loop_add, "fwd": loop_fwd, "fb": loop_fb}
    res: dict[str, dict[str, list[float]]] = {m: {k: [] for k in loops} for m in ("off", "on", "timing")}
    for _ in range(5):
        for name, fn in loops.items():
            res["off"][name].append(fn())
            with profile(nvtx=False):
                res["on"][name].append(fn())
            with profile(memory=False, nvtx=False):
                res["timing"][name].append(fn())
    best = {m: {k: min(v) for k, v in d.items()} for m, d in res.items()}
    out = {"op_us": best["off"]["add"]}
    for m in ("on", "timing"):
        fwd = (best[m]["fwd"] - best["off"]["fwd"]) / 4
        out[f"add_span_us_{m}"] = best[m]["add"] - best["off"]["add"]
        out[f"fwd_grad_span_us_{m}"] = fwd
        out[f"bwd_span_us_{m}"] = ((best[m]["fb"] - best["off"]["fb"]) - 6 * fwd) / 5  # mul + sum + 4 exp fwd
    return out


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "small"
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    step, _ = make_gpt_step(preset)
    for _ in range(2):
        step()
    times: dict[str, list[float]] = {"never": [], "off": [], "on": [], "on-timing-only": []}
    times["never"] += block(step, 3 * reps)  # before bluprofiler ever attached
    with profile():
        step()
    for _ in range(3):  # interleaved blocks; "on" blocks are steps inside one running session
        times["off"] += block(step, reps)
        with profile(nvtx=False):
            times["on"] += block(step, reps)
        with profile(memory=False, nvtx=False):
            times["on-timing-only"] += block(step, reps)
    c = per_span_cost()
    print(f"per op span (plain bt.add {c['op_us']:.2f} us), us added by the profiler:")
    for m, label in (("timing", "timing only"), ("on", "timing+memory")):
        print(f"  {label:<14} no-grad forward {c['add_span_us_' + m]:.2f}, forward with node "
              f"{c['fwd_grad_span_us_' + m]:.2f}, backward {c['bwd_span_us_' + m]:.2f}")
    base, base_med = min(times["never"]), statistics.median(times["never"])
    print(f"preset={preset} steps per mode={3 * reps} (process CPU time, 1 BLAS thread)")
    for m, ts in times.items():
        print(f"  {m:<15} min {min(ts):8.2f} ms  median {statistics.median(ts):8.2f} ms  "
              f"ratio(min) {min(ts) / base:.3f}  ratio(median) {statistics.median(ts) / base_med:.3f}")


if __name__ == "__main__":
    main()
