"""CPU benchmark on the fake device: memory reserved for transformer-like traces, with and without the
step-0 alignment profile and start-up flush. Usage: python benchmarks/bluallocator/bench_trace_fake.py [out_dir]."""

from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "packages", "bluallocator", "dev"))  # alloc_trace: the trace generator
from alloc_trace import replay, transformer_trace  # noqa: E402
from bluallocator import CachingAllocator, FakeDeviceBackend  # noqa: E402

MiB = 1 << 20


def run(ev, profile: bool) -> dict:
    be = FakeDeviceBackend(1 << 40)
    a = CachingAllocator(be)
    marks: dict[str, int] = {}

    def on_step(k: int) -> None:
        if k == 0 and profile:
            a.begin_profile()
        if k == 1:
            if profile:
                a.flush_after_step0()
            a.reset_peak_stats()
            marks["after_step0_reserved"] = a.memory_stats()["reserved_bytes"]

    t = time.perf_counter()
    replay(ev, lambda n: a.malloc(n, 0), a.free, on_step)
    dt = time.perf_counter() - t
    st = a.memory_stats()
    n_alloc = sum(1 for e in ev if e[0] == "alloc")
    return {"profile": profile, "peak_reserved_steady_MiB": st["peak_reserved_bytes"] / MiB,
            "peak_allocated_steady_MiB": st["peak_allocated_bytes"] / MiB,
            "reserved_after_step0_MiB": marks.get("after_step0_reserved", 0) / MiB,
            "granularity": (st["granularity_small"], st["granularity_large"]),
            "us_per_alloc_free": dt / n_alloc * 1e6, "device_mallocs": st["num_device_mallocs"]}


def main() -> None:
    out = {}
    buckets = (1024, 1000, 968, 1016, 936, 992, 1008, 960)
    for name, seqs in (("fixed_T1024", (1024,)), ("bucketed_T", buckets)):
        ev = transformer_trace(batch=4, seq_lens=seqs, steps=8)
        out[name] = [run(ev, False), run(ev, True)]
        for r in out[name]:
            print(name, json.dumps(r))
    if len(sys.argv) > 1:
        os.makedirs(sys.argv[1], exist_ok=True)
        with open(os.path.join(sys.argv[1], "bench_trace_fake.json"), "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
