"""GPU checks of dtms's NCCL backend: ``python3 packages/dtms/dev/gpu_check.py OUT_DIR`` from the repo root.

World size 1 (eager, async stream/event semantics, CUDA-graph capture with and without the side
stream, store bootstrap), then -- with >= 2 GPUs -- a blurun-launched multi-GPU run. Prints a summary,
writes OUT_DIR/dtms_gpu_check.json. Each check is independent; a failure is recorded, not fatal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "BLUTRAIN_RUN_ID"):
    os.environ.pop(k, None)

import numpy as np  # noqa: E402

results: dict = {"checks": {}, "bench": {}, "info": {}}


def check(name):
    def deco(fn):
        t0 = time.perf_counter()
        try:
            extra = fn()
            results["checks"][name] = {"ok": True, "s": round(time.perf_counter() - t0, 3), **(extra or {})}
        except Exception as e:
            results["checks"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                       "trace": traceback.format_exc()[-1500:]}
        return fn
    return deco


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "dtms-gpu-out")
    out.mkdir(parents=True, exist_ok=True)
    import cupy as cp
    import dtms
    from cupy.cuda import nccl
    from dtms.backends.nccl import NCCLProcessGroup, StoreBootstrap

    try:
        results["info"] = {"cupy": cp.__version__, "nccl_available": bool(getattr(nccl, "available", True)),
                           "nccl_version": nccl.get_version() if getattr(nccl, "available", True) else None,
                           "gpus": cp.cuda.runtime.getDeviceCount(),
                           "gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode()}
    except Exception as e:  # no GPU / driver: nothing to check
        results["info"] = {"skipped": f"{type(e).__name__}: {e}"}
        (out / "dtms_gpu_check.json").write_text(json.dumps(results, indent=1))
        print(f"dtms gpu_check: skipped ({results['info']['skipped']})")
        return
    state = {}

    @check("init_nccl_world1")
    def _():
        state["pg"] = dtms.init_process_group()  # default must pick nccl on a GPU box
        assert state["pg"].backend == "nccl", state["pg"].backend
        return {}

    pg = state.get("pg")

    @check("eager_collectives_world1")
    def _():
        ref = np.arange(4096, dtype=np.float32)
        for op in ("sum", "avg", "max", "min", "prod"):
            x = cp.asarray(ref)
            pg.all_reduce(x, op=op)
            np.testing.assert_array_equal(cp.asnumpy(x), ref)
        for dt in (cp.float16, cp.float64, cp.int32, cp.int64, cp.uint8):
            x = cp.arange(64, dtype=dt)
            pg.all_reduce(x, op="sum")
            np.testing.assert_array_equal(cp.asnumpy(x), np.arange(64).astype(dt))
        o = cp.zeros(4096, cp.float32)
        pg.all_gather(o, cp.asarray(ref))
        np.testing.assert_array_equal(cp.asnumpy(o), ref)
        o[...] = 0
        pg.reduce_scatter(o, cp.asarray(ref), op="avg")
        np.testing.assert_array_equal(cp.asnumpy(o), ref)
        o[...] = 0
        pg.all_to_all(o, cp.asarray(ref))  # grouped send/recv to self
        np.testing.assert_array_equal(cp.asnumpy(o), ref)
        b = cp.asarray(ref)
        pg.broadcast(b, 0)
        i16 = cp.zeros(8, dtype=cp.int16)  # no NCCL int16: moved as bytes
        pg.all_gather(cp.zeros(8, cp.int16), i16)
        pg.barrier()
        t = type("T", (), {})()
        t._data = cp.asarray(ref)
        pg.all_reduce(t, op="avg")
        return {}

    @check("async_wait_does_not_block_host")
    def _():
        big = cp.ones(1 << 26, dtype=cp.float32)  # 256 MB
        x = cp.asarray(np.arange(1024, dtype=np.float32))
        with pg.stream:  # keep the communication stream busy for a while
            for _ in range(40):
                big *= 1.0000001
        t0 = time.perf_counter()
        w = pg.all_reduce(x, op="avg", async_op=True)
        w.wait()  # current stream waits on the event: host returns at once
        host_ms = (time.perf_counter() - t0) * 1e3
        pending = not w.is_completed()
        y = x * 2  # ordered after the collective
        w.synchronize()
        assert w.is_completed()
        np.testing.assert_array_equal(cp.asnumpy(y), np.arange(1024, dtype=np.float32) * 2)
        return {"host_ms_async_launch_and_wait": round(host_ms, 3), "still_running_after_wait": pending}

    @check("sees_prior_current_stream_work")
    def _():
        x = cp.zeros(1 << 24, dtype=cp.float32)
        x += 1.0  # on the current stream, before the collective
        x += 1.0
        pg.all_reduce(x, op="max")
        assert float(x[0]) == 2.0 and float(x[-1]) == 2.0
        return {}

    for side in (True, False):
        @check(f"cuda_graph_capture_side_stream={side}")
        def _(side=side):
            pg.use_side_stream = side
            try:
                s = cp.cuda.Stream(non_blocking=True)
                with s:
                    x = cp.arange(1024, dtype=cp.float32)
                    out_ = cp.zeros(1024, dtype=cp.float32)
                    x *= 2
                    s.begin_capture()
                    pg.all_reduce(x, op="avg")
                    x *= 2
                    pg.all_gather(out_, x)
                    w = pg.all_reduce(out_, op="sum", async_op=True)
                    w.wait()
                    g = s.end_capture()
                    x[...] = cp.arange(1024, dtype=cp.float32)
                    g.launch(s)
                    g.launch(s)
                    s.synchronize()
                np.testing.assert_array_equal(cp.asnumpy(x), np.arange(1024, dtype=np.float32) * 4)
                np.testing.assert_array_equal(cp.asnumpy(out_), np.arange(1024, dtype=np.float32) * 4)
            finally:
                pg.use_side_stream = True
            return {}

    @check("store_bootstrap_world1")
    def _():
        st = dtms.TCPStore("127.0.0.1", 0, is_server=True, secret="gpu-check")
        try:
            g = NCCLProcessGroup(0, 1, StoreBootstrap(st, "dtms/check", 10.0))
            assert len(st.get("dtms/check/nccl_unique_id")) == 128
            x = cp.ones(16, cp.float32)
            g.all_reduce(x)
            assert float(x.sum()) == 16.0
            sub = g.new_group([0])
            sub.all_reduce(x)
            g.destroy()
        finally:
            st.close()
        return {}

    @check("bench_world1")
    def _():
        s = cp.cuda.get_current_stream()
        for nbytes in (4 << 10, 64 << 20):
            x = cp.ones(nbytes // 4, cp.float32)
            for _ in range(5):
                pg.all_reduce(x)
            s.synchronize()
            n = 200 if nbytes < (1 << 20) else 50
            t0 = time.perf_counter()
            for _ in range(n):
                pg.all_reduce(x)
            s.synchronize()
            results["bench"][f"all_reduce_{nbytes}B_eager_us"] = round((time.perf_counter() - t0) / n * 1e6, 2)
            t0 = time.perf_counter()
            for _ in range(n):
                pg.all_reduce(x)
            results["bench"][f"all_reduce_{nbytes}B_host_launch_us"] = round((time.perf_counter() - t0) / n * 1e6, 2)
            s.synchronize()
        return {}

    if pg is not None:
        dtms.destroy_process_group()

    ngpu = results["info"]["gpus"]
    if ngpu >= 2:
        @check("blurun_multi_gpu")
        def _():
            n = min(ngpu, 4)
            env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
            env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), env.get("PYTHONPATH", "")])
            p = subprocess.run([sys.executable, "-m", "dtms.run", "--nproc-per-node", str(n), "--log-dir",
                                str(out / "blurun-logs"), str(HERE / "nccl_worker.py"), str(out)],
                               env=env, capture_output=True, text=True, timeout=150)
            if p.returncode != 0:
                raise RuntimeError(f"blurun rc={p.returncode}: {p.stderr[-2000:]}")
            ranks = [json.loads((out / f"nccl_rank{r}.json").read_text()) for r in range(n)]
            return {"world": n, "passed": ranks[0]["passed"]}
    else:
        results["checks"]["blurun_multi_gpu"] = {"ok": None, "skipped": f"{ngpu} GPU(s)"}

    (out / "dtms_gpu_check.json").write_text(json.dumps(results, indent=1))
    ok = sum(1 for c in results["checks"].values() if c.get("ok"))
    bad = [k for k, c in results["checks"].items() if c.get("ok") is False]
    print(f"dtms gpu_check: {ok} passed, {len(bad)} failed {bad} | {results['info']}")
    for k in bad:
        print(f"  FAIL {k}: {results['checks'][k]['error']}")
    print(f"  bench: {results['bench']}")
    print(f"  async: {results['checks'].get('async_wait_does_not_block_host')}")


if __name__ == "__main__":
    main()
