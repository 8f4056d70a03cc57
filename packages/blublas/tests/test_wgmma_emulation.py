"""CPU proof of the wgmma shared-memory path (dev/emulate_wgmma.py): the swizzled loaders, the descriptors
of every k step and the transpose immediates reproduce op(A) @ op(B) exactly for every layout, tile width
and load path, and every address the tensor cores read was written by the loader (so no read leaves the
stage: the old inverted trans-b read up to 6 KB past the last stage, the H200's cudaErrorIllegalAddress)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("emulate_wgmma", HERE / "dev" / "emulate_wgmma.py")
emu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(emu)


@pytest.mark.parametrize("layout", ["nn", "nt", "tn"])
@pytest.mark.parametrize("bn,shape,vec", [(128, (128, 128, 128), True), (256, (77, 247, 70), False)])
def test_bf16_wgmma_operands_are_exact(layout, bn, shape, vec):
    assert emu.emulate_bf16_tile(layout, bn, *shape, vec=vec) == 0.0


@pytest.mark.parametrize("layout", ["nn", "nt", "tn"])
def test_old_inverted_trans_b_is_detected(layout):
    err = emu.emulate_bf16_tile(layout, 128, 64, 128, 64, vec=True, fixed=False)
    assert err > 1.0  # inf (reads of never-written bytes, i.e. outside the B tile) for nn/tn


@pytest.mark.parametrize("bn", [128, 256])
def test_tf32_wgmma_operands_are_exact(bn):
    assert emu.emulate_tf32_tile(bn, 128, bn, 64, vec=True) == 0.0
    assert emu.emulate_tf32_tile(bn, 70, bn - 5, 45, vec=False) == 0.0


def test_kernel_source_uses_the_emulated_immediates_and_descriptors():
    src = (HERE / "src" / "blublas" / "kernels" / "gemm_wgmma_bf16.cu").read_text()
    assert "blu_wgmma<BN, TA ? 1 : 0, TB ? 0 : 1>(acc, da, db);" in src
    assert re.search(r"TA \? blu_desc\(a_addr \+ wg \* \(BK \* 128\) \+ j \* 2048, BK \* 128, 1024\)", src)
    assert "blu_desc(a_addr + wg * (64 * 128) + j * 32, 16, 1024)" in src
    assert "TB ? blu_desc(b_addr + j * 32, 16, 1024) : blu_desc(b_addr + j * 2048, BK * 128, 1024)" in src
