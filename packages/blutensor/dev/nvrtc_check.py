"""Compile every blutensor kernel with NVRTC for sm_80/86/89/90 (no GPU needed); print register-free errors.

Usage: python packages/blutensor/dev/nvrtc_check.py [file.cu ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

from cuda.bindings import nvrtc

KDIR = Path(__file__).resolve().parents[1] / "src" / "blutensor" / "backends" / "cupy" / "kernels"
ARCHS = (80, 86, 89, 90)


def nvrtc_log(name: str, arch: str, extra: tuple[bytes, ...] = ()) -> tuple[bool, str]:
    """(success, log) of compiling kernel file ``name`` with NVRTC for ``arch`` (``compute_90a``: PTX, ``sm_90a``:
    SASS). The text is the loader's (local .cuh includes inlined), so what is compiled here is what the GPU
    compiles."""
    sys.path.insert(0, str(KDIR.parents[3]))  # the src directory
    from blutensor.backends.cupy._loader import source

    err, prog = nvrtc.nvrtcCreateProgram(source(name).encode(), name.encode(), 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    opts = [b"-std=c++17", f"-arch={arch}".encode(), *extra]
    (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    err, n = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * n
    nvrtc.nvrtcGetProgramLog(prog, log)
    nvrtc.nvrtcDestroyProgram(prog)
    text = log.decode(errors="replace").strip("\x00 \n")
    ok = res == nvrtc.nvrtcResult.NVRTC_SUCCESS
    return ok, text if text or ok else str(res)


def compile_one(path: Path, arch: int) -> str | None:
    """None on success, else the NVRTC log."""
    ok, text = nvrtc_log(path.name, f"compute_{arch}")
    if not ok:
        return text
    if text:
        print(f"  [{path.name} sm_{arch} warnings]\n{text}")
    return None


def main(argv: list[str]) -> int:
    files = [Path(a) for a in argv] or sorted(KDIR.glob("*.cu"))
    bad = 0
    for f in files:
        for arch in ARCHS:
            log = compile_one(f, arch)
            status = "ok" if log is None else "FAIL"
            print(f"{f.name:28s} sm_{arch}: {status}")
            if log:
                bad += 1
                print(log[:4000])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
