"""Measure the profiler's cost on CPU: step time with bluprofiler never used, after a session
(profiler off), and with a session running (timing+memory, and timing only).

    python packages/bluprofiler/dev/overhead_cpu.py [preset=small] [reps=7]

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
    """Microseconds added per op span: ``bt.add`` of two 4-element tensors, off vs on (min of 5)."""
    import blutensor as bt

    a, b = bt.randn(4), bt.randn(4)

    def loop() -> float:
        t = CLOCK()
        for _ in range(n):
            bt.add(a, b)
        return (CLOCK() - t) / n * 1e6

    res: dict[str, list[float]] = {"off": [], "on": [], "on-timing-only": []}
    for _ in range(5):
        res["off"].append(loop())
        with profile(nvtx=False):
            res["on"].append(loop())
        with profile(memory=False, nvtx=False):
            res["on-timing-only"].append(loop())
    base = min(res["off"])
    return {"op_us": base, "span_us_on": min(res["on"]) - base,
            "span_us_timing_only": min(res["on-timing-only"]) - base}


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
    print(f"per op span: plain bt.add {c['op_us']:.2f} us; profiler adds {c['span_us_on']:.2f} us "
          f"(timing+memory), {c['span_us_timing_only']:.2f} us (timing only)")
    base, base_med = min(times["never"]), statistics.median(times["never"])
    print(f"preset={preset} steps per mode={3 * reps} (process CPU time, 1 BLAS thread)")
    for m, ts in times.items():
        print(f"  {m:<15} min {min(ts):8.2f} ms  median {statistics.median(ts):8.2f} ms  "
              f"ratio(min) {min(ts) / base:.3f}  ratio(median) {statistics.median(ts) / base_med:.3f}")


if __name__ == "__main__":
    main()
