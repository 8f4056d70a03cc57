"""GPU check of the sm_90a TMA + warp-specialized wgmma kernels (kernels/gemm_wgmma*.cu), H200.

Run from the repo root on the GPU machine:
    python3 packages/blublas/dev/gpu_check_wgmma.py OUTDIR
Sections, each in its own child process (a faulting kernel poisons only that process's CUDA context), the
JSON (OUTDIR/blublas_wgmma_check.json) rewritten after each one:
  1. compile: NVRTC of the two Hopper files (+ registers/spills from the cubin when cuobjdump exists);
  2. smoke: one TMA box through the tensor map (as a __grid_constant__ parameter and from global memory),
     mbarrier completion, the raw 128B-swizzled bytes vs the NumPy model, bf16 and fp32 boxes, edges;
  3. correctness per (precision, layout): every config vs float64 on odd tile edges, full epilogue, bf16 and
     f32 out, split-K, batched, > 132 tiles (persistent CTAs loop over tiles);
  4. bench per precision: GPT-2 124M GEMMs at B*T=16384, every TMA config (split 1 and the heuristic split)
     and for layouts without a validated TMA kernel the mma.sync configs, vs cuBLASLt in the same process;
     TFLOP/s, ratio, geomean and min (targets: bf16 >= 0.85, tf32 >= 0.90, min >= 0.6).
Runs in < 3 minutes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve()
SRC = HERE.parents[1] / "src"
sys.path.insert(0, str(SRC))
OUT = Path(sys.argv[1] if len(sys.argv) > 1 else "blublas_wgmma_out")
OUT.mkdir(parents=True, exist_ok=True)
# everything but the one JSON (and stdout) stays outside OUT: the device returns only a few files
SCRATCH = Path(os.environ.setdefault("BLUBLAS_WGMMA_CHECK_SCRATCH", tempfile.mkdtemp(prefix="blublas_wgmma_")))
os.environ.setdefault("BLUBLAS_CACHE_DIR", str(SCRATCH / "cache"))
CHILD = sys.argv[2] if len(sys.argv) > 2 else ""
T0 = float(os.environ.get("BLUBLAS_WGMMA_CHECK_T0") or time.time())  # children share the parent's clock
os.environ["BLUBLAS_WGMMA_CHECK_T0"] = str(T0)
RESULT: dict = {"sections": {}, "failures": []}
# BLUBLAS_WGMMA_CHECK_FULL=1: also time the mma.sync kernels on TF32 NN/TN (compiling them costs ~80 s there)
FULL = os.environ.get("BLUBLAS_WGMMA_CHECK_FULL", "0") == "1"
COMMAND = "python3 packages/blublas/dev/gpu_check_wgmma.py OUTDIR"
TARGETS = {"bf16": 0.85, "tf32": 0.90}
GROUPS = [("bf16", "nn"), ("bf16", "nt"), ("bf16", "tn"), ("tf32", "nt"), ("tf32", "nn"), ("tf32", "tn")]
from blublas.testing import gpt2_gemm_shapes  # noqa: E402 - after the sys.path insert

GPT2_SHAPES = gpt2_gemm_shapes()  # GPT-2 124M at B*T = 16384 (blublas.testing): fwd nt, dX nn, dW tn


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def write() -> None:
    RESULT["total_s"] = round(time.time() - T0, 1)
    (OUT / "blublas_wgmma_check.json").write_text(json.dumps(RESULT, indent=1, default=str))


# ---------------------------------------------------------------- sections run in child processes
def sec_smoke(part: dict) -> None:
    """TMA + mbarrier alone: raw smem bytes of one box vs the NumPy 128B-swizzle model."""
    import cupy as cp
    import numpy as np
    from blublas import loader, tma

    def model(host: np.ndarray, c0: int, c1: int, box: tuple[int, int]) -> np.ndarray:
        es = host.dtype.itemsize
        out = np.zeros(box[1] * 128, np.uint8)
        for r in range(box[1]):
            for i in range(box[0]):
                gr, gc = c1 + r, c0 + i
                v = host[gr, gc] if (gr < host.shape[0] and gc < host.shape[1]) else host.dtype.type(0)
                addr = r * 128 + i * es
                addr ^= ((addr >> 7) & 7) << 4
                out[addr : addr + es] = np.frombuffer(np.array([v], host.dtype).tobytes(), np.uint8)
        return out

    rows_cols = {"bf16": (100, 200, np.uint16, 64), "fp32": (300, 100, np.float32, 128)}
    for tag, (rows, cols, dt, outer) in rows_cols.items():
        host = (np.arange(rows * cols) % 65521).astype(dt).reshape(rows, cols)
        dev = cp.asarray(host)
        spec = tma.operand_spec(int(dev.data.ptr), rows, cols, cols, 0, 0, host.itemsize, outer)
        box = spec.box[:2]
        nbytes = box[1] * 128
        # the last box: mostly out of bounds (zero fill). The inner start must be 16-byte aligned (a start
        # at bf16 column 193 raised cudaErrorIllegalInstruction on the H200; the GEMM's are multiples of 64)
        c_last = (cols - 7) // (16 // host.itemsize) * (16 // host.itemsize)
        for c0, c1 in ((0, 0), (box[0], 32), (c_last, rows - 5)):
            want = model(host, c0, c1, box)
            for kname in ("blu_tma_smoke", "blu_tma_smoke_gmem"):
                key = f"{tag}_{kname}_{c0}_{c1}"
                try:
                    fn = loader.get_function("gemm_wgmma_bf16.cu", kname, nbytes + 2048)
                    out = cp.zeros(nbytes, cp.uint8)
                    tm = tma.encode(spec)
                    if kname.endswith("gmem"):
                        tm_dev = cp.asarray(np.frombuffer(tm.tobytes(), np.uint8))
                        arg0 = tm_dev
                    else:
                        arg0 = tm
                    fn(
                        (1,),
                        (128,),
                        (arg0, out, np.int32(nbytes), np.int32(c0), np.int32(c1), np.int32(0)),
                        shared_mem=nbytes + 2048,
                    )
                    got = out.get()
                    bad = int(np.count_nonzero(got != want))
                    part[key] = {"ok": bad == 0, "bad_bytes": bad}
                    if bad:
                        part[key]["first_bad"] = int(np.flatnonzero(got != want)[0])
                except Exception as exc:  # noqa: BLE001
                    part[key] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[-600:]}
                    if "illegal" in str(exc).lower() or "launch failure" in str(exc).lower():
                        return
                log(f"smoke {key}: {part[key]}")


def sec_correct(part: dict, precision: str, layout: str) -> None:
    """Every config of one (precision, layout) vs float64; stops at the first exception."""
    import cupy as cp
    import numpy as np
    from blublas import configs
    from blublas.selftest import tma_shape
    from blublas.testing import check_case, make_case

    os.environ["BLUBLAS_WGMMA"] = "1"
    variant = "wgmma" if precision == "bf16" else "wgmma_tf32"
    rng = np.random.default_rng(11)
    shapes = [
        (1, 1, 1),
        (7, 5, 3),
        (130, 67, 19),
        (257, 129, 200),
        (256, 256, 64),
        (300, 270, 129),
        (128, 512, 1024),
        (2200, 2100, 40),
    ]
    outs = (True, False) if precision == "bf16" else (False,)
    for cfg in configs.configs_for(variant, 90):
        cases = [("sweep", dict(bias="f32"), shp, {}) for shp in shapes]
        cases += [
            (
                "epilogue",
                dict(out_bf16=o, bias="f32", epilogue="gelu", save_preact=True, alpha=0.5, beta=0.5),
                (133, 200, 96),
                {},
            )
            for o in outs
        ]
        cases.append(("split_k", dict(bias="f32", epilogue="gelu", save_preact=True), (96, 300, 1500), {"splits": 3}))
        cases.append(("batched", dict(batch=3, bias="f32"), (67, 130, 70), {}))
        cases.append(("batched_big", dict(batch=2), (1100, 1300, 72), {}))
        for check, kw, shp, extra in cases:
            case = make_case(rng, *tma_shape(*shp, layout, precision), layout=layout, precision=precision, **kw)
            key = f"{cfg.name}/{check}"
            c = part.setdefault(key, {"pass": 0, "fail": 0, "worst_err_over_tol": 0.0})
            try:
                err = check_case(case, cp, config=cfg.name, **extra)
                ok = err <= case.tol
                c["pass" if ok else "fail"] += 1
                c["worst_err_over_tol"] = max(c["worst_err_over_tol"], err / case.tol if math.isfinite(err) else 1e9)
                if not ok:
                    c.setdefault("cases", []).append(f"{case.describe()} err {err:.3g} tol {case.tol:.3g}")
            except Exception as exc:  # noqa: BLE001 - the context may be poisoned: stop this group
                c["fail"] += 1
                c["exception"] = f"{case.describe()}: {type(exc).__name__}: {exc}"[-800:]
                log(f"{precision} {layout} {key}: {c['exception']}")
                return
        mine = [(k.split("/")[1], v) for k, v in part.items() if k.startswith(cfg.name)]
        log(
            f"{precision} {layout} {cfg.name}: "
            + ", ".join(f"{k} {v['pass']}/{v['pass'] + v['fail']}" for k, v in mine)
        )


def _time_ms(cp, fn):
    """Mean ms per call (3 to 100 back-to-back calls filling ~20 ms): blublas.testing.time_ms."""
    from blublas.testing import time_ms

    return time_ms(cp, fn, max_reps=100)


def _graph_ms(cp, fn):
    """Milliseconds per call inside one CUDA graph (host out of the loop): blublas.testing.graph_ms."""
    from blublas.testing import graph_ms

    return graph_ms(cp, fn)


def sec_bench(part: dict, precision: str, validated: list[str]) -> None:
    """GPT-2 shapes: our candidates vs cuBLASLt; rows in part['rows']."""
    import cupy as cp
    from blublas import api, configs, loader

    os.environ["BLUBLAS_WGMMA"] = "1"
    sms = loader.sm_count()
    variant = "wgmma" if precision == "bf16" else "wgmma_tf32"
    rows = part.setdefault("rows", [])
    for name, lay, m, n, k in GPT2_SHAPES:
        if time.time() - T0 > 150:
            part["truncated"] = True
            break
        ta, tb = lay[0] == "t", lay[1] == "t"
        dt = cp.uint16 if precision == "bf16" else cp.float32
        a = cp.random.standard_normal((k, m) if ta else (m, k), dtype=cp.float32) * 0.5
        b = cp.random.standard_normal((n, k) if tb else (k, n), dtype=cp.float32) * 0.5
        if precision == "bf16":
            a = (a.view(cp.uint32) >> 16).astype(cp.uint16)
            b = (b.view(cp.uint32) >> 16).astype(cp.uint16)
        out, ref = cp.empty((m, n), dt), cp.empty((m, n), dt)
        kw = dict(trans_a=ta, trans_b=tb, precision=precision)
        flops = 2.0 * m * n * k
        row = {"name": name, "layout": lay, "M": m, "N": n, "K": k, "candidates_ms": {}}
        ms_cublas = _time_ms(cp, lambda a=a, b=b, ref=ref, kw=kw: api.gemm(a, b, ref, provider="cublas", **kw))
        row.update(cublaslt_ms=round(ms_cublas, 4), cublaslt_tflops=round(flops / ms_cublas / 1e9, 1))
        use_tma = lay in validated
        cands = configs.candidates(variant if use_tma else configs.VARIANT_OF_PRECISION[precision], 90, m, n, k, 1, lay)
        if FULL and use_tma and precision == "tf32" and lay != "nt":  # copies + NT kernel vs mma.sync kernels
            cands += configs.candidates("tf32", 90, m, n, k, 1, lay)
        by_cfg: dict = {}
        for cfg, s in cands:
            by_cfg.setdefault(cfg.name, []).append(s)
        for cname, splits in by_cfg.items():
            cfg = next(c for c, _ in cands if c.name == cname)
            chosen = {1}
            if len(splits) > 1:
                chosen.add(
                    min(
                        splits,
                        key=lambda s, cfg=cfg: configs.estimate_seconds(
                            cfg, s, m, n, k, 1, 90, sms, 2 if precision == "bf16" else 4
                        ),
                    )
                )
            for s in sorted(chosen):
                try:
                    ms = _time_ms(
                        cp, lambda c=cname, s=s, a=a, b=b, out=out, kw=kw: api.gemm(a, b, out, config=c, splits=s, **kw)
                    )
                    row["candidates_ms"][f"{cfg.variant}:{cname}/s{s}"] = round(ms, 4)
                except Exception as exc:  # noqa: BLE001
                    row["candidates_ms"][f"{cfg.variant}:{cname}/s{s}"] = f"{type(exc).__name__}: {exc}"[:300]
        ok = {key: v for key, v in row["candidates_ms"].items() if isinstance(v, float)}
        if ok:
            best = min(ok, key=ok.get)
            row.update(
                best=best,
                ours_ms=ok[best],
                ours_tflops=round(flops / ok[best] / 1e9, 1),
                ratio=round(ms_cublas / ok[best], 3),
            )
            v, cname_s = best.split(":", 1)
            cname, s = cname_s.rsplit("/s", 1)
            api.gemm(a, b, out, config=cname, splits=int(s), **kw)
            api.gemm(a, b, ref, provider="cublas", **kw)
            if precision == "bf16":
                o, r = (out.astype(cp.uint32) << 16).view(cp.float32), (ref.astype(cp.uint32) << 16).view(cp.float32)
            else:
                o, r = out, ref
            row["max_rel_diff_vs_cublaslt"] = float(cp.max(cp.abs(o - r)) / cp.max(cp.abs(r)))
            try:  # kernel time without the Python per-call cost (both providers inside one CUDA graph)
                g_ours = _graph_ms(
                    cp,
                    lambda a=a, b=b, out=out, c=cname, s=int(s), kw=kw: api.gemm(a, b, out, config=c, splits=s, **kw),
                )
                g_cub = _graph_ms(cp, lambda a=a, b=b, ref=ref, kw=kw: api.gemm(a, b, ref, provider="cublas", **kw))
                row.update(
                    ours_graph_ms=round(g_ours, 4),
                    cublaslt_graph_ms=round(g_cub, 4),
                    ours_graph_tflops=round(flops / g_ours / 1e9, 1),
                    cublaslt_graph_tflops=round(flops / g_cub / 1e9, 1),
                    ratio_graph=round(g_cub / g_ours, 3),
                )
            except Exception as exc:  # noqa: BLE001
                row["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
            try:  # what the library itself picks (heuristic; no autotuning) for this shape
                ms_h = _time_ms(cp, lambda a=a, b=b, out=out, kw=kw: api.gemm(a, b, out, **kw))
                row.update(heuristic_ms=round(ms_h, 4), heuristic_ratio=round(ms_cublas / ms_h, 3))
            except Exception as exc:  # noqa: BLE001
                row["heuristic_error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        log(
            f"{precision} {name:14s} {lay} ours {row.get('ours_tflops')} TF ({row.get('best')}) cuBLASLt "
            f"{row['cublaslt_tflops']} TF ratio {row.get('ratio')} diff {row.get('max_rel_diff_vs_cublaslt', 0):.1e}"
            f" | graph: ours {row.get('ours_graph_tflops')} TF cuBLASLt {row.get('cublaslt_graph_tflops')} TF "
            f"ratio {row.get('ratio_graph')} | heuristic ratio {row.get('heuristic_ratio')}"
        )
        a = b = out = ref = None
        cp.get_default_memory_pool().free_all_blocks()


def sec_diag(part: dict) -> None:
    """Where the time goes on the short-K shapes: every bf16 TMA config with the epilogue skipped (child started
    with BLUBLAS_WGMMA_DEBUG_NO_EPILOGUE=1) and with fp32 instead of bf16 output (twice the bytes stored)."""
    import cupy as cp
    from blublas import api, configs, launch

    os.environ["BLUBLAS_WGMMA"] = "1"
    part["no_epilogue_flag"] = launch.F_NO_EPILOGUE
    for name, lay, m, n, k in [r for r in GPT2_SHAPES if r[0] in ("fwd_fc", "dx_fc_proj", "fwd_fc_proj", "dw_fc")]:
        ta, tb = lay[0] == "t", lay[1] == "t"
        a = cp.zeros((k, m) if ta else (m, k), cp.uint16)
        b = cp.zeros((n, k) if tb else (k, n), cp.uint16)
        flops = 2.0 * m * n * k
        row = {}
        for out_dt in (cp.uint16, cp.float32):
            out = cp.empty((m, n), out_dt)
            for cfg in configs.configs_for("wgmma", 90):
                ms = _time_ms(
                    cp,
                    lambda a=a, b=b, out=out, c=cfg.name, ta=ta, tb=tb: api.gemm(
                        a, b, out, trans_a=ta, trans_b=tb, precision="bf16", config=c, splits=1
                    ),
                )
                row[f"{cfg.name}/{'bf16' if out_dt == cp.uint16 else 'f32'}_out"] = round(flops / ms / 1e9, 1)
        part[name] = row
        log(f"diag {name} (no epilogue: {bool(launch.F_NO_EPILOGUE)}): {row}")
        cp.get_default_memory_pool().free_all_blocks()


# ---------------------------------------------------------------- parent
def run_child(name: str, args: list[str], timeout: float, env: dict | None = None) -> dict:
    part_path = SCRATCH / "parts" / f"{name}.json"
    part_path.parent.mkdir(parents=True, exist_ok=True)
    t = time.time()
    try:
        proc = subprocess.run(
            [sys.executable, str(HERE), str(OUT), "--child", name, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **(env or {})},
        )
        rc = proc.returncode
        tail = (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as exc:
        rc, tail = f"timeout ({timeout} s)", str(exc.stdout or "")[-2000:]
    for line in tail.splitlines()[-40:]:
        print(f"    [{name}] {line}", flush=True)
    try:
        part = json.loads(part_path.read_text())
    except (OSError, ValueError):
        part = {}
    part["_rc"] = rc
    part["_s"] = round(time.time() - t, 1)
    if rc != 0:
        part["_tail"] = tail
        RESULT["failures"].append({"section": name, "rc": rc, "tail": tail[-1500:]})
    RESULT["sections"][name] = part
    write()
    log(f"section {name}: rc {rc} ({part['_s']} s)")
    return part


def compile_all() -> None:
    """NVRTC both Hopper files in parallel (fills the loader's cubin cache); registers/spills via cuobjdump."""
    from blublas import configs, loader

    code = (
        "import sys; sys.path.insert(0, sys.argv[2]); from blublas import loader; "
        "print(loader._cubin_with_nvrtc(sys.argv[1], '90a'))"
    )
    code_mma = "import sys; sys.path.insert(0, sys.argv[2]); from blublas import loader; loader.get_module(sys.argv[1])"
    files = [configs.FILE_OF_VARIANT["wgmma"], configs.FILE_OF_VARIANT["wgmma_tf32"]]
    t = time.time()
    procs = [
        (
            f,
            subprocess.Popen(
                [sys.executable, "-c", code, f, str(SRC)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            ),
        )
        for f in files
    ]
    # the mma.sync files (bench fall-back for layouts without a validated TMA kernel), CuPy's own cache
    mma_files = ("gemm_mma_tf32.cu", "gemm_mma_bf16.cu") if FULL else ()  # big: ~80 s of NVRTC on the H200 host
    others = [
        subprocess.Popen(
            [sys.executable, "-c", code_mma, f, str(SRC)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        for f in (*mma_files, "transpose.cu", "gemm_epilogue.cu")
    ]
    info = {}
    for f, p in procs:
        out, err = p.communicate()
        info[f] = {"rc": p.returncode, "cubin": out.strip(), "error": err[-3000:] if p.returncode else ""}
        if p.returncode == 0:
            try:
                res = subprocess.run(
                    ["cuobjdump", "-res-usage", out.strip()], capture_output=True, text=True, timeout=60
                )
                info[f]["res_usage"] = [ln.strip() for ln in res.stdout.splitlines() if "REG" in ln][:12]
            except Exception as exc:  # noqa: BLE001 - no cuobjdump on the machine
                info[f]["res_usage"] = f"unavailable: {exc}"[:200]
    for p in others:
        p.wait()
    try:
        loader.get_module("gemm_epilogue.cu")
    except Exception as exc:  # noqa: BLE001
        info["gemm_epilogue.cu"] = {"error": str(exc)[-2000:]}
    info["_s"] = round(time.time() - t, 1)
    RESULT["sections"]["compile"] = info
    write()
    log(f"compiled in {info['_s']} s: " + ", ".join(f"{f} rc {v.get('rc')}" for f, v in info.items() if f != "_s"))


def summarize() -> None:
    summary = {}
    for prec in ("bf16", "tf32", "bf16_staged"):
        rows = [r for r in RESULT["sections"].get(f"bench_{prec}", {}).get("rows", []) if r.get("ratio", 0) > 0]
        if not rows:
            continue
        rs = [r["ratio"] for r in rows]
        rg = [r["ratio_graph"] for r in rows if r.get("ratio_graph", 0) > 0]
        rh = [r["heuristic_ratio"] for r in rows if r.get("heuristic_ratio", 0) > 0]
        gm = round(math.exp(sum(math.log(x) for x in rs) / len(rs)), 3)
        worst = min(rows, key=lambda r: r["ratio"])
        summary[prec] = {
            "geomean_ratio": gm,
            "min_ratio": worst["ratio"],
            "min_ratio_shape": worst["name"],
            "shapes": len(rs),
            "target_geomean": TARGETS[prec[:4]],
            "meets_target": gm >= TARGETS[prec[:4]] and worst["ratio"] >= 0.6 and len(rs) == len(GPT2_SHAPES),
            "graph_geomean_ratio": round(math.exp(sum(math.log(x) for x in rg) / len(rg)), 3) if rg else None,
            "graph_min_ratio": min(rg) if rg else None,
            "heuristic_geomean_ratio": round(math.exp(sum(math.log(x) for x in rh) / len(rh)), 3) if rh else None,
            "geomean_by_layout": {
                lay: round(
                    math.exp(
                        sum(math.log(r["ratio"]) for r in rows if r["layout"] == lay)
                        / max(1, sum(1 for r in rows if r["layout"] == lay))
                    ),
                    3,
                )
                for lay in ("nt", "nn", "tn")
            },
        }
    RESULT["summary"] = summary
    write()


def main() -> None:
    import cupy as cp
    from blublas import loader

    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"]
    RESULT["env"] = {
        "gpu": name.decode() if isinstance(name, bytes) else str(name),
        "cc": loader.compute_capability(),
        "sms": loader.sm_count(),
        "cupy": cp.__version__,
        "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
        "command": COMMAND,
    }
    log(f"env {RESULT['env']}")
    if RESULT["env"]["cc"] != 90:
        RESULT["failures"].append({"section": "env", "error": "not sm_90: nothing to check"})
        write()
        return
    compile_all()
    smoke = run_child("smoke", [], 90)
    smoke_ok = any(v.get("ok") for k, v in smoke.items() if isinstance(v, dict) and k.startswith("bf16_blu_tma_smoke_"))
    validated: dict[str, list[str]] = {"bf16": [], "tf32": []}
    for prec, lay in GROUPS:
        part = run_child(f"correct_{prec}_{lay}", [prec, lay], 75)
        checks = {k: v for k, v in part.items() if not k.startswith("_")}
        if part["_rc"] == 0 and checks and all(v["fail"] == 0 for v in checks.values()):
            validated[prec].append(lay)
    RESULT["validated"] = validated
    RESULT["smoke_ok"] = smoke_ok
    write()
    for prec in ("bf16", "tf32"):
        if time.time() - T0 > 160:
            RESULT["failures"].append({"section": f"bench_{prec}", "error": "skipped: time limit"})
            continue
        run_child(f"bench_{prec}", [prec, ",".join(validated[prec])], max(30, 175 - (time.time() - T0)))
        summarize()
    if validated["bf16"] and time.time() - T0 < 150:  # A/B: the staged epilogue instead of the TMA stores
        run_child("bench_bf16_staged", ["bf16", ",".join(validated["bf16"])], 40, {"BLUBLAS_WGMMA_TMA_STORE": "0"})
        summarize()
    if validated["bf16"] and time.time() - T0 < 150 and FULL:  # diagnostics: epilogue skipped, fp32 output
        run_child("diag_no_epilogue", [], 40, {"BLUBLAS_WGMMA_DEBUG_NO_EPILOGUE": "1"})
        run_child("diag_with_epilogue", [], 40)
    print("\n==== blublas wgmma check summary ====")
    print(f"smoke: { ({k: v.get('ok') for k, v in smoke.items() if isinstance(v, dict)}) }")
    print(f"validated layouts: {validated}")
    for prec, s in RESULT.get("summary", {}).items():
        print(
            f"{prec}: geomean {s['geomean_ratio']}x cuBLASLt (target {s['target_geomean']}), min {s['min_ratio']} "
            f"({s['min_ratio_shape']}), by layout {s['geomean_by_layout']}; in CUDA graphs: geomean "
            f"{s['graph_geomean_ratio']} min {s['graph_min_ratio']}; library heuristic {s['heuristic_geomean_ratio']}"
        )
    print(f"failures: {len(RESULT['failures'])}; total {time.time() - T0:.1f}s; json: {OUT}/blublas_wgmma_check.json")
    write()


def child_main() -> None:
    name = sys.argv[3]
    part: dict = {}
    path = SCRATCH / "parts" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        if name == "smoke":
            sec_smoke(part)
        elif name.startswith("correct_"):
            sec_correct(part, sys.argv[4], sys.argv[5])
        elif name.startswith("diag_"):
            sec_diag(part)
        elif name.startswith("bench_"):
            sec_bench(part, sys.argv[4], [x for x in sys.argv[5].split(",") if x] if len(sys.argv) > 5 else [])
    except Exception:  # noqa: BLE001
        part["_error"] = traceback.format_exc()[-3000:]
        print(part["_error"], flush=True)
    finally:
        path.write_text(json.dumps(part, default=str))


if __name__ == "__main__":
    if CHILD == "--child":
        child_main()
    else:
        main()
