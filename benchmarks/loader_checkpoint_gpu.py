"""Throughput of blumodels' data pipeline and checkpoints on a CUDA GPU; writes JSON to argv[1].

    python3 benchmarks/loader_checkpoint_gpu.py OUTDIR

TokenLoader ms per step and Mtokens/s on the pinned double-buffered path and the synchronous one, alone and
beside simulated compute (overlap); an async checkpoint of CUDA tensors (fp32 + bf16 + a raw CuPy array): time
until save() returns, total, and the median save call / background write of 10 more saves (the snapshot is
checked bit-exact). The loader's and the checkpoint's correctness on CUDA are the `cuda`-marked tests of
packages/blumodels/tests (test_data_loader.py, test_checkpoint.py).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

RESULTS: dict = {"checks": {}, "bench": {}}


def check(name):
    """Decorator: runs the check at once, recording ok/error/time (and its returned dict)."""
    def deco(fn):
        def run():
            t0 = time.perf_counter()
            try:
                out = fn()
                RESULTS["checks"][name] = {"ok": True, "s": round(time.perf_counter() - t0, 3), **(out or {})}
            except Exception as e:
                RESULTS["checks"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                           "trace": traceback.format_exc()[-2000:]}
            print(f"[{'OK ' if RESULTS['checks'][name]['ok'] else 'FAIL'}] {name} "
                  f"{ {k: v for k, v in RESULTS['checks'][name].items() if k not in ('ok', 'trace')} }")
        run()
        return None
    return deco


def main(out_dir: Path) -> None:
    import blutensor as bt
    from blumodels.checkpoint import CheckpointManager, load_checkpoint
    from blumodels.data.loader import TokenLoader
    from blumodels.data.shards import write_shard

    RESULTS["cuda"] = bt.cuda.is_available()
    if not RESULTS["cuda"]:
        print("no CUDA GPU: nothing to check")
        return
    import cupy as cp

    RESULTS["device"] = bt.cuda.get_device_name(0)
    tmp = Path(tempfile.mkdtemp(prefix="blu_data_gpu_"))
    rng = np.random.default_rng(0)

    big = tmp / "big"
    big.mkdir()
    write_shard(big / "train_00000.bin", rng.integers(0, 50000, 24_000_000).astype(np.uint16))

    def bench(pinned, B, T, steps, compute_n):
        L = TokenLoader(big, "train", B, T, device="cuda", pinned=pinned)
        a = cp.ones((compute_n, compute_n), cp.float32) if compute_n else None
        acc = cp.zeros((), cp.int64)
        for _ in range(3):
            x, y = L.next_batch()
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            x, y = L.next_batch()
            acc += x._data[0, 0] + y._data[-1, -1]  # consume on the compute stream
            if a is not None:
                for _ in range(4):
                    a = a @ a * (1.0 / compute_n)
        cp.cuda.Device().synchronize()
        return (time.perf_counter() - t0) / steps * 1e3

    @check("loader_throughput")
    def _():
        B, T, steps = 32, 1024, 60
        res = {}
        for compute_n in (0, 4096):
            c_only = None
            if compute_n:
                a = cp.ones((compute_n, compute_n), cp.float32)
                cp.cuda.Device().synchronize()
                t0 = time.perf_counter()
                for _ in range(steps):
                    for _ in range(4):
                        a = a @ a * (1.0 / compute_n)
                cp.cuda.Device().synchronize()
                c_only = (time.perf_counter() - t0) / steps * 1e3
            ms_p = bench(None, B, T, steps, compute_n)
            ms_s = bench(False, B, T, steps, compute_n)
            tag = f"compute{compute_n}"
            res[tag] = {"pinned_ms_per_step": round(ms_p, 3), "sync_ms_per_step": round(ms_s, 3),
                        "compute_only_ms": None if c_only is None else round(c_only, 3),
                        "pinned_Mtok_s": round(B * T / ms_p / 1e3, 1),
                        "sync_Mtok_s": round(B * T / ms_s / 1e3, 1)}
        RESULTS["bench"]["loader"] = res
        return res

    @check("async_checkpoint_cuda_tensors")
    def _():
        d = tmp / "ckpt"
        m = CheckpointManager(d, keep=2, async_save=True)
        w = bt.randn(1024, 1024, device="cuda")
        h = w.to(bt.bfloat16)
        raw = cp.arange(1 << 20, dtype=cp.float32)
        expect_w, expect_h, expect_raw = w.numpy().copy(), h.numpy().copy(), cp.asnumpy(raw)
        t0 = time.perf_counter()
        m.save(1, {"w": w, "h": h, "raw": raw}, {"k": 1})
        t_return = time.perf_counter() - t0
        raw *= 0  # in-place device update right after save(): must not reach the file
        w._data[...] = 0
        m.wait()
        t_total = time.perf_counter() - t0
        got, meta = load_checkpoint(m.list()[-1])
        assert got["w"].tobytes() == expect_w.tobytes(), "fp32 tensor differs"
        assert got["h"].dtype.name == "bfloat16" and got["h"].tobytes() == expect_h.tobytes(), "bf16 differs"
        assert got["raw"].tobytes() == expect_raw.tobytes(), "raw CuPy array differs"
        pinned = m._pinned is not None and m._pinned.pinned
        calls, writes = [], []
        for s in range(2, 12):
            t1 = time.perf_counter()
            m.save(s, {"w": w, "h": h, "raw": raw}, {"k": s})  # snapshot only: nothing else in flight
            t2 = time.perf_counter()
            m.wait()
            calls.append(t2 - t1)
            writes.append(time.perf_counter() - t2)
        m.close()
        mb = (w.numpy().nbytes + h.numpy().nbytes + raw.nbytes) / 2**20
        RESULTS["bench"]["async_ckpt"] = {"MiB": round(mb, 1), "first_return_ms": round(t_return * 1e3, 2),
                                          "first_total_ms": round(t_total * 1e3, 2),
                                          "median_save_call_ms": round(float(np.median(calls)) * 1e3, 2),
                                          "median_background_write_ms": round(float(np.median(writes)) * 1e3, 2),
                                          "snapshot_pinned": bool(pinned)}
        return RESULTS["bench"]["async_ckpt"]


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        main(out)
    except Exception as e:
        RESULTS["fatal"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
        print(RESULTS["fatal"])
    RESULTS["total_s"] = round(time.perf_counter() - t0, 1)
    RESULTS["all_ok"] = "fatal" not in RESULTS and all(c["ok"] for c in RESULTS["checks"].values())
    (out / "loader_checkpoint_gpu.json").write_text(json.dumps(RESULTS, indent=2))
    print(f"all_ok={RESULTS['all_ok']} total={RESULTS['total_s']}s -> {out / 'loader_checkpoint_gpu.json'}")
