"""Every kernel file compiles with NVRTC (the pip nvidia-cuda-nvrtc, through cuda-bindings; no GPU needed) for
the architectures the loader uses: sm_80 and sm_90 for the portable files, sm_90a for the Hopper files (whose
body exists only there), and every configured entry point exists. The generated wgmma wrappers in
gemm_wgmma.cuh are what dev/gen_wgmma.py emits."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from blublas import configs, loader

HERE = Path(__file__).resolve().parents[1]


def _nvrtc_available() -> bool:
    try:
        from cuda.bindings import nvrtc

        return nvrtc.nvrtcVersion()[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS
    except Exception:  # noqa: BLE001 - no cuda-bindings / no NVRTC library
        return False


needs_nvrtc = pytest.mark.skipif(not _nvrtc_available(), reason="cuda-bindings NVRTC not available")


@needs_nvrtc
@pytest.mark.parametrize("variant", ["wgmma", "wgmma_tf32"])
def test_hopper_files_compile_for_sm90a_with_every_entry(variant):
    fname = configs.FILE_OF_VARIANT[variant]
    cubin, _ver = loader._nvrtc_cubin_bindings(loader._source(fname), fname, "90a")
    for cfg in configs.ALL_CONFIGS[variant].values():
        for lay in cfg.layouts if variant == "wgmma" else ("nt",):  # tf32: one NT kernel serves every layout
            assert cfg.kernel_name(lay).encode() in cubin, cfg.kernel_name(lay)
    if variant == "wgmma":
        assert b"blu_tma_smoke" in cubin


@needs_nvrtc
@pytest.mark.parametrize("arch", ["80", "90"])
def test_hopper_files_compile_to_stubs_elsewhere(arch):
    for v in ("wgmma", "wgmma_tf32"):
        fname = configs.FILE_OF_VARIANT[v]
        loader._nvrtc_cubin_bindings(loader._source(fname), fname, arch)


def test_configs_mirror_the_cu_instantiations():
    for variant, macro in (("wgmma", "BLU_WGMMA_CONFIG"), ("wgmma_tf32", "BLU_WGMMA_TF32_CONFIG")):
        text = (loader.KERNEL_DIR / configs.FILE_OF_VARIANT[variant]).read_text()
        found = {
            m.group(1): tuple(int(x) for x in m.group(2, 3, 4, 5, 6))
            for m in re.finditer(rf"^{macro}\((\w+), (\d+), (\d+), (\d+), (\d+), ([01])\)", text, re.M)
        }
        want = {
            c.name: (c.bm, c.bn, c.bk, c.stages, int("_pp_" in c.name)) for c in configs.ALL_CONFIGS[variant].values()
        }
        assert found == want, variant


def test_generated_wrappers_match_the_generator():
    spec = importlib.util.spec_from_file_location("gen_wgmma", HERE / "dev" / "gen_wgmma.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.generated_block() in (loader.KERNEL_DIR / "gemm_wgmma.cuh").read_text()


def test_tma_configs_fit_hopper_shared_memory():
    for v in configs.TMA_VARIANTS:
        for c in configs.ALL_CONFIGS[v].values():
            assert c.threads == 384 and c.bm == 128 and c.bk * (2 if v == "wgmma" else 4) == 128
            assert c.max_smem_bytes() <= configs.arch_info(90).smem_optin, c.name


def test_smem_formula_matches_the_kernel_layout():
    text = (loader.KERNEL_DIR / "gemm_wgmma.cuh").read_text()
    assert "#define BLU_EPI_LD 40" in text and "#define BLU_EPI_BYTES (64 * BLU_EPI_LD * 4)" in text
    assert "#define BLU_EPI_AREA 16384" in text and 64 * 40 * 4 <= 16384  # staged path fits the TMA boxes' area
    assert "STAGES * STAGE_BYTES + 2 * BLU_EPI_AREA" in text
    c = configs.ALL_CONFIGS["wgmma"]["128x256x64_ws_s4"]
    assert c.smem_bytes("nt") == 4 * (128 + 256) * 128 + 2 * 16384 + 1024 + 4 * 16 + 16


@needs_nvrtc
def test_hopper_kernels_are_compact():
    """Unrolled per-fragment epilogues made the kernels 180-340 KB of SASS, refetched into the instruction
    cache at every tile (H200: ~8 us per 128 x 128 tile). The staged epilogue is a compact loop; the TMA-store
    epilogue adds two straight-line per-box variants (bf16 and fp32 boxes) of ~15 KB each."""
    import struct

    for v in ("wgmma", "wgmma_tf32"):
        fname = configs.FILE_OF_VARIANT[v]
        cubin, _ = loader._nvrtc_cubin_bindings(loader._source(fname), fname, "90a")
        shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
        secs = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
        stroff = secs[shstrndx][4]
        sizes = {}
        for sec in secs:
            name = cubin[stroff + sec[0] : cubin.index(b"\0", stroff + sec[0])].decode()
            if name.startswith(".text.blu_gemm_wgmma"):
                sizes[name] = sec[5]
        assert sizes and max(sizes.values()) < 96 * 1024, sizes
