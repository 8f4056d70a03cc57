"""gemm_simt_f32.cu compiles with NVRTC for sm_90 (every config and layout), and ptxas reports no spills
for the register-staged configs (stages == 2), which are capped at 128 registers for 2 CTAs of 256 threads
(or 1 of 512) per SM. Skipped without cuda-bindings' NVRTC."""

from __future__ import annotations

import re

import pytest
from blublas import configs, loader


def _compile_with_ptxas_log(filename: str, arch: str) -> str:
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    src = loader._source(filename)
    err, prog = nvrtc.nvrtcCreateProgram(src.encode(), filename.encode(), 0, [], [])
    opts = [b"-std=c++17", f"-arch=sm_{arch}".encode(), b"--ptxas-options=-v"]
    try:
        try:
            (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        except OSError as exc:  # no libnvrtc on this machine
            pytest.skip(f"NVRTC unavailable: {exc}")
        _, n = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * n
        nvrtc.nvrtcGetProgramLog(prog, log)
        text = log.decode(errors="replace")
        assert res == nvrtc.nvrtcResult.NVRTC_SUCCESS, text[-4000:]
        return text
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    """{kernel: {"registers", "spill_stores", "spill_loads", "stack"}} from a ``ptxas -v`` log."""
    out: dict[str, dict[str, int]] = {}
    cur = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            cur = out.setdefault(m.group(1), {})
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["registers"] = int(m.group(1))
    return out


def test_parse_ptxas_reads_registers_and_spills():
    log = (
        "ptxas info    : Compiling entry function 'blu_x' for 'sm_90'\n"
        "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
        "ptxas info    : Used 128 registers, used 1 barriers\n"
    )
    assert parse_ptxas(log) == {"blu_x": {"stack": 8, "spill_stores": 4, "spill_loads": 12, "registers": 128}}


@pytest.mark.slow
def test_simt_file_compiles_for_sm90_without_spills_in_the_register_staged_configs():
    info = parse_ptxas(_compile_with_ptxas_log("gemm_simt_f32.cu", "90"))
    for cfg in configs.ALL_CONFIGS["simt"].values():
        for lay in cfg.layouts:
            k = info.get(cfg.kernel_name(lay))
            assert k is not None, f"{cfg.kernel_name(lay)} missing from the NVRTC build"
            if cfg.stages == 2:
                assert k["spill_stores"] == 0 and k["spill_loads"] == 0, (cfg.kernel_name(lay), k)
                assert k["registers"] <= 128, (cfg.kernel_name(lay), k)
