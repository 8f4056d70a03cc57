"""Every CUDA kernel file of every package compiles with NVRTC for sm_80, sm_86, sm_89 and sm_90.

Runs without a GPU (NVRTC is a compiler library), so a broken kernel fails CI. Files are discovered under
packages/*/src/**/kernels/*.cu, so kernels added later by any package are checked automatically. Local
quoted includes resolve against the file's own directory (-I); CUDA headers (cuda_bf16.h, ...) come from
the nvidia-cuda-runtime wheel or a CUDA toolkit when one is found. A file may ask for extra targets with a
comment ``// blu-nvrtc-archs: 90a`` (arch-specific features such as wgmma). Skips only when cuda-bindings
(``cuda.bindings.nvrtc``) is not installed.
"""

from __future__ import annotations

import glob
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("80", "86", "89", "90")
KERNELS = sorted(
    {
        Path(p)
        for p in glob.glob(str(ROOT / "packages" / "*" / "src" / "**" / "kernels" / "**" / "*.cu"), recursive=True)
    }
)

try:
    from cuda.bindings import nvrtc
except ImportError:  # pragma: no cover - CI installs cuda-bindings
    nvrtc = None


def _nvrtc_major() -> int:
    err, major, _minor = nvrtc.nvrtcVersion()
    return int(major)


def _toolkit_major(inc: Path) -> int | None:
    cuda_h = inc / "cuda.h"
    if not cuda_h.is_file():
        return None
    m = re.search(r"#define\s+CUDA_VERSION\s+(\d+)", cuda_h.read_text(errors="ignore"))
    return int(m.group(1)) // 1000 if m else None


def cuda_include_dirs() -> list[str]:
    """Directories holding CUDA headers usable with this NVRTC (matching major version first)."""
    major = _nvrtc_major()
    found: list[Path] = []
    for sp in [Path(p) for p in sys.path if p]:
        for sub in ("nvidia/cuda_runtime/include", f"nvidia/cu{major}/include", "nvidia/cuda_nvrtc/include"):
            d = sp / sub
            if (d / "cuda_bf16.h").is_file() or (d / "cuda_runtime.h").is_file():
                found.append(d)
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    homes += sorted(glob.glob("/usr/local/cuda*"), reverse=True)
    toolkit = [Path(h) / "include" for h in homes if h and (Path(h) / "include" / "cuda.h").is_file()]
    found += [d for d in toolkit if _toolkit_major(d) == major]
    found += [d for d in toolkit if _toolkit_major(d) != major]  # last resort: another major version
    out, seen = [], set()
    for d in found:
        key = str(d.resolve())
        if key not in seen:
            seen.add(key)
            out.append(key)
    return out


def compile_file(path: Path, arch: str) -> tuple[bool, str]:
    """Compile ``path`` to PTX for compute_<arch>; returns (ok, compiler log)."""
    src = path.read_bytes()
    err, prog = nvrtc.nvrtcCreateProgram(src, path.name.encode(), 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    # PTX for the virtual architecture, unoptimised (-G): the whole NVRTC front end and PTX generation run for
    # each architecture, so every language, type, template and arch-guard error shows. Optimised builds
    # (NVVM -O3 plus ptxas) happen on the GPU for the device itself; here they cost ~50x more time (minutes
    # per GEMM file on 2 cores) and find nothing the front end does not.
    opts = [b"-std=c++17", f"-arch=compute_{arch}".encode(), b"-G", f"-I{path.parent}".encode()]
    opts += [f"-I{d}".encode() for d in cuda_include_dirs()]
    try:
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        return res == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace").strip("\x00 \n")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def extra_archs(path: Path) -> list[str]:
    """Arch-specific targets a kernel file declares with ``blu-nvrtc-archs: 90a[, ...]``."""
    m = re.search(r"blu-nvrtc-archs:\s*([0-9a-z ,]+)", path.read_text(errors="ignore"))
    return [a for a in m.group(1).replace(",", " ").split() if a not in ARCHS] if m else []


CASES = [(p, a) for p in KERNELS for a in ARCHS + tuple(extra_archs(p))]


def test_kernel_files_found():
    """The discovery glob sees the kernels of the packages that ship them."""
    assert KERNELS, "no .cu files found under packages/*/src/**/kernels/"


@pytest.mark.skipif(
    nvrtc is None,
    reason="cuda-bindings (cuda.bindings.nvrtc) is not installed: pip install blublas[nvrtc]",
)
@pytest.mark.parametrize("path,arch", CASES, ids=[f"{p.relative_to(ROOT / 'packages')}-sm_{a}" for p, a in CASES])
def test_nvrtc_compiles(path: Path, arch: str):
    ok, log = compile_file(path, arch)
    assert ok, f"NVRTC failed to compile {path.relative_to(ROOT)} for sm_{arch}:\n{log}"
