"""CPU proof of the TMA + wgmma shared-memory path (dev/emulate_wgmma.py): the host's tensor-map specs, the
boxes the producer issues (128-byte swizzle, zero fill outside the tensor), the descriptors of every k step
and the transpose immediates reproduce op(A) @ op(B) exactly for every layout, tile width and edge tile, and
every address the tensor cores read was written by a TMA box (a read of unwritten smem gives inf)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("emulate_wgmma", HERE / "dev" / "emulate_wgmma.py")
emu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(emu)


@pytest.mark.parametrize("layout", ["nn", "nt", "tn"])
@pytest.mark.parametrize("bn", [128, 256])
def test_bf16_tma_wgmma_operands_are_exact(layout, bn):
    assert emu.emulate_tile(layout, "bf16", bn, 128, bn, 128) == 0.0
    assert emu.emulate_tile(layout, "bf16", bn, 200, bn + 72, 136, tile=(128, bn)) == 0.0  # M/N/K edges


@pytest.mark.parametrize("layout", ["nn", "nt", "tn"])
def test_inverted_trans_b_is_detected(layout):
    assert emu.emulate_tile(layout, "bf16", 128, 128, 128, 64, fixed=False) > 1.0


@pytest.mark.parametrize("bn", [128, 256])
def test_tf32_tma_wgmma_operands_are_exact(bn):
    assert emu.emulate_tile("nt", "tf32", bn, 128, bn, 64) == 0.0
    assert emu.emulate_tile("nt", "tf32", bn, 130, bn + 6, 100, tile=(128, bn)) == 0.0


def test_swizzle_model_is_the_128b_pattern():
    # chunk c of 128-byte row r lands at chunk c ^ (r % 8): the layout the descriptors' 128B mode reads
    for r in range(16):
        for c in range(8):
            assert emu.hw_swizzle(r * 128 + c * 16) == emu.swz(r, c)


def test_kernel_source_uses_the_emulated_descriptors_and_boxes():
    src = (HERE / "src" / "blublas" / "kernels" / "gemm_wgmma.cuh").read_text()
    for frag in (
        "blu_desc(a_addr + cw * (64 * 128) + j * 2048, 64 * 128, 1024)",
        "blu_desc(a_addr + cw * (64 * 128) + j * 32, 16, 1024)",
        "TB ? blu_desc(b_addr + j * 32, 16, 1024) : blu_desc(b_addr + j * 2048, 64 * 128, 1024)",
        "blu_wgmma_m64n256k16<TA ? 1 : 0, TB ? 0 : 1>(acc, da, db)",
        "blu_tma_load3(a, tmA, tl.m0, k0, batch * zbA, fb);",
        "blu_tma_load3(a + 8192, tmA, tl.m0 + 64, k0, batch * zbA, fb);",
        "blu_tma_load3(a, tmA, k0, tl.m0, batch * zbA, fb);",
        "blu_tma_load3(b, tmB, k0, tl.n0, batch * zbB, fb);",
        "blu_tma_load3(b + i * 8192, tmB, tl.n0 + 64 * i, k0, batch * zbB, fb);",
    ):
        assert frag in src, frag


@pytest.mark.parametrize("pp", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_mbarrier_protocol_under_random_interleavings(pp, seed):
    """Producer, TMA engine and both consumer warpgroups of gemm_tma_body, interleaved at random: every
    wgmma reads its own (tile, k) stage, no TMA overwrites a stage in use, the walk finishes."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ktiles = [int(x) for x in rng.integers(1, 20, size=int(rng.integers(1, 9)))]
    emu.simulate_pipeline(int(rng.choice([3, 4, 6])), ktiles, pp, seed)


def test_ping_pong_without_turns_is_caught():
    """Without the done-barrier turns a warpgroup that steps over the other's stages can run two ring
    passes ahead, and a parity wait then passes on a stale phase: the simulation must see that."""
    with pytest.raises(AssertionError):
        for seed in range(10):
            emu.simulate_pipeline(4, [12, 3, 12, 5, 9], True, seed, turns=False)


def test_kernel_source_has_the_simulated_protocol():
    src = (HERE / "src" / "blublas" / "kernels" / "gemm_wgmma.cuh").read_text()
    for frag in (
        "blu_mbar_wait(empty_bar + 8 * stage, phase ^ 1);",
        "blu_mbar_wait(full_bar + 8 * stage, phase);",
        "blu_mbar_init(empty_bar + 8 * s, PP ? 4 : 8);",
        "if (PP && seq > 0) blu_mbar_wait(done_bar + 8 * (1 - cw), (unsigned)((seq - 1) >> 1) & 1u);",
        "phase ^= (unsigned)(stage / STAGES) & 1u;",
        "if (prev >= 0 && lane == 0) blu_mbar_arrive(empty_bar + 8 * prev);",
    ):
        assert frag in src, frag
