"""On-device self-test of the opt-in sm_90a (wgmma) kernels, isolated in a child process.

A wrong wgmma kernel can fault (cudaErrorIllegalAddress), which poisons the CUDA context of the process it
ran in; so by default the self-test runs in a subprocess (``python -m blublas.selftest``) and only its
verdict comes back. Verdicts are cached on disk per (GPU, kernel source digest, variant, layout) in
``$BLUBLAS_CACHE_DIR/wgmma_selftest.json``, so a fixed kernel is re-tested and a good one is tested once.
``BLUBLAS_WGMMA_PROBE=inproc`` runs it in the calling process instead (tests on fake CuPy do this).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from . import settings

#: problems every config must pass: aligned (16-byte cp.async path), odd edges (element path), and enough k
#: tiles to wrap every pipeline stage (the last stage ends at the end of the shared-memory allocation)
PROBE_SHAPES = ((200, 264, 136), (130, 70, 99), (257, 129, 330))


def tma_shape(m: int, n: int, k: int, layout: str, precision: str) -> tuple[int, int, int]:
    """(m, n, k) with the stored rows' contiguous extents (the leading dimensions of contiguous operands)
    rounded up to 16 bytes, as TMA needs; the other extents keep their odd tile edges."""
    per = 8 if precision == "bf16" else 4
    ta, tb = layout[0] == "t", layout[1] == "t"

    def up(x: int) -> int:
        return -(-x // per) * per

    m2 = up(m) if ta else m
    n2 = n if tb else up(n)
    k2 = up(k) if (not ta or tb) else k
    return m2, n2, k2
PROBE_TIMEOUT_S = settings.Settings.selftest_timeout  # BLUBLAS_SELFTEST_TIMEOUT overrides; a hung child fails


def probe_inproc(variant: str, layout: str, precision: str, cc: int) -> tuple[bool, str]:
    """Every config of ``variant`` on PROBE_SHAPES with bias, GELU, pre-activation and beta vs float64."""
    import cupy
    import numpy as np

    from . import configs
    from .testing import check_case, make_case

    rng = np.random.default_rng(1234)
    try:
        for cfg in configs.configs_for(variant, cc):
            if layout not in cfg.layouts:
                continue
            for shape in PROBE_SHAPES:
                if variant in configs.TMA_VARIANTS:
                    shape = tma_shape(*shape, layout, precision)
                case = make_case(
                    rng,
                    *shape,
                    layout=layout,
                    precision=precision,
                    bias="f32",
                    epilogue="gelu",
                    save_preact=True,
                    beta=0.5,
                )
                err = check_case(case, cupy, config=cfg.name, splits=1)
                if not err <= case.tol:
                    return False, f"{cfg.name} {layout} {shape}: error {err:.3g} > {case.tol}"
    except Exception as exc:  # noqa: BLE001 - e.g. no NVRTC for sm_90a, or a kernel fault
        return False, f"{type(exc).__name__}: {str(exc)[:300]}"
    return True, ""


def _cache_path() -> Path:
    from .autotune import cache_dir

    return cache_dir() / "wgmma_selftest.json"


def cache_key(variant: str, layout: str, device_id: int) -> str:
    """(GPU name, driver, kernel source digest, variant, layout): a changed kernel is tested again."""
    import cupy

    from . import configs, loader

    try:
        name = cupy.cuda.runtime.getDeviceProperties(device_id)["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        drv = str(cupy.cuda.runtime.driverGetVersion())
    except Exception:  # noqa: BLE001 - fake CuPy in tests
        name, drv = "unknown", "0"
    src = loader._source(configs.FILE_OF_VARIANT[variant])
    digest = hashlib.sha256(src.encode()).hexdigest()[:16]
    return f"{name}|drv{drv}|{variant}|{layout}|{digest}"


def _read_cache() -> dict:
    try:
        data = json.loads(_cache_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, ok: bool, why: str) -> None:
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_cache()
        data[key] = {"ok": ok, "why": why}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".wgmma_selftest.", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass  # read-only cache dir: the verdict still holds for this process


def probe_subprocess(variant: str, layout: str, precision: str, cc: int, device_id: int) -> tuple[bool, str]:
    """probe_inproc in a child process (a kernel fault cannot poison this process's CUDA context)."""
    env = dict(os.environ)
    src_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["CUDA_VISIBLE_DEVICES"] = _visible_device(device_id)
    cmd = [sys.executable, "-m", "blublas.selftest", variant, layout, precision, str(cc)]
    from . import tma

    if tma.available():  # the child encodes its tensor maps with the module this process was given
        cmd += ["--tma-encoder", tma.encoder().__name__]
    try:
        timeout = settings.get().selftest_timeout
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"self-test process failed: {type(exc).__name__}: {exc}"
    for line in reversed(res.stdout.splitlines()):
        if line.startswith("BLUBLAS_SELFTEST "):
            verdict = json.loads(line[len("BLUBLAS_SELFTEST ") :])
            return bool(verdict["ok"]), str(verdict.get("why", ""))
    return False, f"self-test process exited {res.returncode} without a verdict: {res.stderr[-500:]}"


def _visible_device(device_id: int) -> str:
    """CUDA_VISIBLE_DEVICES for the child so that its device 0 is our ``device_id``."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis:
        items = [v.strip() for v in vis.split(",") if v.strip()]
        if 0 <= device_id < len(items):
            return items[device_id]
    return str(device_id)


def probe(variant: str, layout: str, precision: str, cc: int, device_id: int) -> tuple[bool, str]:
    """Cached verdict, else run the self-test (subprocess by default) and cache it."""
    inproc = settings.get().wgmma_probe == "inproc"
    key = cache_key(variant, layout, device_id)
    hit = _read_cache().get(key)
    if isinstance(hit, dict) and "ok" in hit:
        return bool(hit["ok"]), str(hit.get("why", ""))
    if inproc:
        ok, why = probe_inproc(variant, layout, precision, cc)
    else:
        ok, why = probe_subprocess(variant, layout, precision, cc, device_id)
    _write_cache(key, ok, why)
    return ok, why


def main(argv: list[str]) -> int:
    """``variant layout precision cc [--tma-encoder MODULE]``: one probe, its verdict printed as a JSON line;
    MODULE (importable name) is the TMA tensor-map encoder the parent process uses (blutensor.ext.tma's module)."""
    argv = list(argv)
    if "--tma-encoder" in argv:
        import importlib

        from . import tma

        i = argv.index("--tma-encoder")
        tma.use_encoder(importlib.import_module(argv[i + 1]))
        del argv[i : i + 2]
    variant, layout, precision, cc = argv[0], argv[1], argv[2], int(argv[3])
    ok, why = probe_inproc(variant, layout, precision, cc)
    print("BLUBLAS_SELFTEST " + json.dumps({"ok": ok, "why": why}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
