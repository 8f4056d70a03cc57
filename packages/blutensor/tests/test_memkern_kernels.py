"""Memory-bound kernels (layer_norm, gelu, cross_entropy, grad_norm): NVRTC builds of every entry the launchers
name, and NumPy twins of the index maps and reduction orders the CUDA code uses (no GPU needed)."""

from __future__ import annotations

import re

import pytest

FILES = ("layer_norm.cu", "gelu.cu", "cross_entropy.cu", "grad_norm.cu")


def _ptx(file: str, arch: int) -> str:
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    from blutensor.cuda_ops._loader import source

    err, prog = nvrtc.nvrtcCreateProgram(source(file).encode(), file.encode(), 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    opts = [b"-std=c++17", f"-arch=compute_{arch}".encode()]
    (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, n = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * n
    nvrtc.nvrtcGetProgramLog(prog, log)
    assert res == nvrtc.nvrtcResult.NVRTC_SUCCESS, f"{file} sm_{arch}: {log.decode(errors='replace')}"
    _, n = nvrtc.nvrtcGetPTXSize(prog)
    ptx = b" " * n
    nvrtc.nvrtcGetPTX(prog, ptx)
    nvrtc.nvrtcDestroyProgram(prog)
    return ptx.decode(errors="replace")


def _entries(ptx: str) -> set[str]:
    return set(re.findall(r"\.entry (blu_\w+)\(", ptx))


@pytest.mark.parametrize("arch", (80, 90))
@pytest.mark.parametrize("file", FILES)
def test_memkern_files_compile_with_nvrtc(file, arch):
    assert _entries(_ptx(file, arch))


def test_layer_norm_register_entries_match_the_launcher():
    """Every register-resident width the launcher may pick has its entry in layer_norm.cu."""
    from blutensor.cuda_ops import layer_norm as ln

    have = _entries(_ptx("layer_norm.cu", 90))
    want = {f"blu_layer_norm_forward_r{nv}_{s}" for nv in ln._FWD_NV for s in ("f32", "bf16")}
    want |= {f"blu_layer_norm_backward_r{nv}_{s}" for s, nvs in ln._BWD_NV.items() for nv in nvs}
    want |= {f"blu_layer_norm_{k}_{s}" for k in ("forward", "backward", "backward_reduce") for s in ("f32", "bf16")}
    assert want <= have, want - have
