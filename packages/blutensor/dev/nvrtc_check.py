"""Compile every blutensor kernel with NVRTC for sm_80/86/89/90 (no GPU needed); print register-free errors.

Usage: python packages/blutensor/dev/nvrtc_check.py [file.cu ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

from cuda.bindings import nvrtc

KDIR = Path(__file__).resolve().parents[1] / "src" / "blutensor" / "backends" / "cupy" / "kernels"
ARCHS = (80, 86, 89, 90)


def compile_one(path: Path, arch: int) -> str | None:
    """None on success, else the NVRTC log. The text is the loader's (local .cuh includes inlined), so what is
    compiled here is what the GPU compiles."""
    sys.path.insert(0, str(KDIR.parents[1]))
    from blutensor.backends.cupy._loader import source

    src = source(path.name).encode()
    err, prog = nvrtc.nvrtcCreateProgram(src, path.name.encode(), 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    opts = [b"-std=c++17", f"-arch=compute_{arch}".encode()]
    (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    err, n = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * n
    nvrtc.nvrtcGetProgramLog(prog, log)
    nvrtc.nvrtcDestroyProgram(prog)
    text = log.decode(errors="replace").strip("\x00 \n")
    if res != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        return text or str(res)
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
