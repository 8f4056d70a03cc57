"""NumPy emulation of the shared-memory side of kernels/gemm_wgmma.cuh (no GPU): the host's tensor-map
specs (blublas.launch.tma_specs: dims, byte strides, boxes, read here straight from host memory through the
spec's pointer and strides), the TMA boxes the producer issues (coordinates as in gemm_tma_body) written with
the 128-byte swizzle (16-byte chunk index XOR address bits 7-9, zero fill outside the tensor), the matrix
descriptors of each k16/k8 step (blu_wgmma_slice), and the way wgmma walks a descriptor (CUTLASS's canonical
GMMA layouts: K-major ``((8,m),(T,2k)):((8T,SBO),(1,T))``, MN-major ``((T,8,m),(8,k)):((1,T,LBO),(8T,SBO))``,
in elements, then Swizzle<3,4,3> on the absolute byte address). imm-trans 0 reads the K-major form, 1 the
MN-major one.

It reconstructs every operand tile the tensor cores would see for each consumer warpgroup and k step of one
output tile, multiplies them, and compares with op(A) @ op(B) in float64. With the B transpose immediate
inverted (``fixed=False``) NN/NT/TN are wrong: the emulation can fail. The GPU run confirms the model.

Usage: python packages/blublas/dev/emulate_wgmma.py
"""

from __future__ import annotations

import numpy as np

ATOM_ROW = 128  # bytes per swizzled row


def swz(r: int, c: int) -> int:
    """blu_swz: byte offset of 16-byte chunk c of 128-byte row r (Swizzle<3,4,3>)."""
    return r * 128 + ((c ^ (r & 7)) << 4)


def hw_swizzle(addr: int) -> int:
    """What the hardware does to an address read through a 128B-swizzle descriptor."""
    return addr ^ (((addr >> 7) & 7) << 4)


def read_operand(smem: dict, start: int, lbo: int, sbo: int, trans: int, mn: int, kk: int, esz: int) -> np.ndarray:
    """The (mn x kk) operand tile wgmma reads from a descriptor (start, LBO, SBO, 128B swizzle)."""
    per = 16 // esz
    out = np.full((mn, kk), np.nan)
    for i in range(mn):
        for k in range(kk):
            if trans == 0:  # K-major: 8-row groups SBO apart, k contiguous inside the 128-byte row
                off = (i % 8) * 128 + (i // 8) * sbo + (k // per) * 16 + (k % per) * esz
            else:  # MN-major: 64-element (128-byte) atoms LBO apart, 8-k-row groups SBO apart
                off = (i % (128 // esz)) * esz + (i // (128 // esz)) * lbo + (k % 8) * 128 + (k // 8) * sbo
            out[i, k] = smem.get(hw_swizzle(start + off), np.nan)
    return out


def _stored(spec) -> np.ndarray:
    """(batch, rows, cols) view of host memory through a TmapSpec's pointer, dims and byte strides."""
    import ctypes

    dt = np.uint16 if spec.itemsize == 2 else np.float32
    cols, rows, nb = spec.dims
    span = (nb - 1) * spec.strides[1] + (rows - 1) * spec.strides[0] + cols * spec.itemsize
    buf = (ctypes.c_byte * span).from_address(spec.ptr)
    base = np.frombuffer(buf, dtype=dt)
    return np.lib.stride_tricks.as_strided(base, (nb, rows, cols), (spec.strides[1], spec.strides[0], spec.itemsize))


def tma_box(smem: dict, dst: int, spec, c0: int, c1: int, c2: int) -> None:
    """cp.async.bulk.tensor.3d of one box at (c0, c1, c2) into smem at 1024-aligned ``dst``, 128B swizzle."""
    from blublas.reference import bf16_bits_to_f32

    assert dst % 1024 == 0 and spec.box[0] * spec.itemsize == 128
    mem = _stored(spec)
    cols, rows, nb = spec.dims
    for r in range(spec.box[1]):
        for i in range(spec.box[0]):
            gr, gc = c1 + r, c0 + i
            v = 0.0
            if 0 <= gr < rows and 0 <= gc < cols and 0 <= c2 < nb:
                x = mem[c2, gr, gc]
                v = float(bf16_bits_to_f32(np.array([x]))[0]) if spec.itemsize == 2 else float(x)
            smem[hw_swizzle(dst + r * 128 + i * spec.itemsize)] = v


def emulate_tile(
    layout: str,
    precision: str,
    bn: int,
    m: int,
    n: int,
    k: int,
    tile: tuple[int, int] = (0, 0),
    fixed: bool = True,
    seed: int = 0,
) -> float:
    """One output tile (m0, n0) = tile of gemm_tma_body for ``layout``/``precision`` (all k tiles, both
    consumer warpgroups); max |emulated - reference| over the tile (inf: a read of never-written smem)."""
    from blublas import configs, launch
    from blublas.api import plan
    from blublas.reference import f32_to_bf16_bits

    rng = np.random.default_rng(seed)
    ta, tb = layout[0] == "t", layout[1] == "t"
    bf = precision == "bf16"
    a = rng.integers(-4, 5, size=(k, m) if ta else (m, k)).astype(np.float32)
    b = rng.integers(-4, 5, size=(n, k) if tb else (k, n)).astype(np.float32)
    a_st, b_st = (f32_to_bf16_bits(a), f32_to_bf16_bits(b)) if bf else (a, b)
    p = plan(
        a_st,
        b_st,
        None,
        trans_a=ta,
        trans_b=tb,
        alpha=1.0,
        beta=0.0,
        bias=None,
        epilogue="none",
        save_preact=None,
        precision=precision,
        batched=False,
    )
    variant = "wgmma" if bf else "wgmma_tf32"
    cfg = next(c for c in configs.ALL_CONFIGS[variant].values() if c.bn == bn)
    spec_a, spec_b = launch.tma_specs(p, cfg)
    bm, bk = 128, cfg.bk
    m0, n0 = tile
    a_bytes = bm * 128
    base = 1024 * 7  # any 1024-aligned stage
    acc = np.zeros((bm, bn))
    for k0 in range(0, k, bk):
        smem: dict = {}
        if ta:  # the producer's boxes, as issued in gemm_tma_body
            tma_box(smem, base, spec_a, m0, k0, 0)
            tma_box(smem, base + 8192, spec_a, m0 + 64, k0, 0)
        else:
            tma_box(smem, base, spec_a, k0, m0, 0)
        if tb:
            tma_box(smem, base + a_bytes, spec_b, k0, n0, 0)
        else:
            for i in range(bn // 64):
                tma_box(smem, base + a_bytes + i * 8192, spec_b, n0 + 64 * i, k0, 0)
        a_addr, b_addr = base, base + a_bytes
        for cw in range(2):
            for j in range(4):  # blu_wgmma_slice's descriptors, verbatim
                if not bf:
                    da = (a_addr + cw * (64 * 128) + j * 32, 16, 1024)
                    db = (b_addr + j * 32, 16, 1024)
                    at = read_operand(smem, *da, 0, 64, 8, 4)
                    bt = read_operand(smem, *db, 0, bn, 8, 4)
                else:
                    if ta:
                        da = (a_addr + cw * (64 * 128) + j * 2048, 64 * 128, 1024)
                    else:
                        da = (a_addr + cw * (64 * 128) + j * 32, 16, 1024)
                    db = (b_addr + j * 32, 16, 1024) if tb else (b_addr + j * 2048, 64 * 128, 1024)
                    trans_b = (0 if tb else 1) if fixed else (1 if tb else 0)
                    at = read_operand(smem, *da, 1 if ta else 0, 64, 16, 2)
                    bt = read_operand(smem, *db, trans_b, bn, 16, 2)
                acc[cw * 64 : cw * 64 + 64] += at @ bt.T
    full = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b).astype(np.float64)
    ref = np.zeros((bm, bn))
    blk = full[m0 : m0 + bm, n0 : n0 + bn]
    ref[: blk.shape[0], : blk.shape[1]] = blk
    return float(np.max(np.abs(acc - ref))) if np.all(np.isfinite(acc)) else float("inf")


def main() -> None:
    for layout in ("nn", "nt", "tn"):
        for bn in (128, 256):
            err = emulate_tile(layout, "bf16", bn, 200, bn + 72, 136, tile=(128, bn))
            old = emulate_tile(layout, "bf16", bn, 128, bn, 64, fixed=False)
            print(f"bf16 {layout} BN={bn} edge tile: max err {err:g}; inverted trans-b {old:g}")
    for bn in (128, 256):
        print(f"tf32 nt BN={bn}: max err {emulate_tile('nt', 'tf32', bn, 130, bn + 6, 100, tile=(128, bn)):g}")


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    main()


# ---------------------------------------------------------------- the mbarrier protocol of gemm_tma_body
class MBar:
    """An mbarrier: ``phase`` completed phases; a phase completes when its arrivals and tx bytes are in."""

    def __init__(self, count: int):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def _maybe_complete(self) -> None:
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def arrive(self, expect_tx: int = 0) -> None:
        self.tx += expect_tx
        self.pending -= 1
        assert self.pending >= 0, "more arrivals than the barrier's count"
        self._maybe_complete()

    def complete_tx(self, nbytes: int) -> None:
        self.tx -= nbytes
        self._maybe_complete()

    def try_wait(self, parity: int) -> bool:
        """mbarrier.try_wait.parity: true once the phase of that parity has completed (current phase's
        parity differs), which is also true for a phase two passes in the future: the hazard the kernel's
        turn order has to rule out."""
        return (self.phase & 1) != parity


def simulate_pipeline(
    stages: int, ktiles: list[int], pp: bool, seed: int = 0, steps: int = 200000, turns: bool = True
) -> int:
    """Random interleavings of gemm_tma_body's producer, TMA engine and two consumer warpgroups for one CTA
    whose walk has ``ktiles[i]`` k tiles at tile i; asserts every wgmma reads the stage holding its own
    (tile, k) and that no TMA overwrites a stage still being read; returns the scheduler steps used.
    ``turns=False`` drops the ping-pong turn order (the done barriers): that must be caught."""
    rng = np.random.default_rng(seed)
    full = [MBar(1) for _ in range(stages)]
    empty = [MBar(4 if pp else 8) for _ in range(stages)]
    done = [MBar(1), MBar(1)]
    smem: list = [None] * stages
    readers = [0] * stages
    inflight: list = []  # TMA loads: (stage, (tile, kt))
    owner = [(i % 2) if pp else None for i in range(len(ktiles))]

    def producer():
        stage, phase = 0, 0
        for i, kt_n in enumerate(ktiles):
            for kt in range(kt_n):
                while not empty[stage].try_wait(phase ^ 1):
                    yield
                full[stage].arrive(expect_tx=1)
                inflight.append((stage, (i, kt)))
                stage += 1
                if stage == stages:
                    stage, phase = 0, phase ^ 1
                yield

    def consumer(cw: int):
        stage, phase = 0, 0
        for seq, kt_n in enumerate(ktiles):
            if pp and owner[seq] != cw:
                stage += kt_n
                phase ^= (stage // stages) & 1
                stage %= stages
                continue
            if pp and seq > 0 and turns:
                while not done[1 - cw].try_wait(((seq - 1) >> 1) & 1):
                    yield
            prev = -1
            for kt in range(kt_n):
                while not full[stage].try_wait(phase):
                    yield
                assert smem[stage] == (seq, kt), f"wg{cw} read {smem[stage]} for {(seq, kt)} at stage {stage}"
                readers[stage] += 1
                yield  # the wgmma group reads asynchronously until the next wait<1>
                if prev >= 0:
                    readers[prev] -= 1
                    for _ in range(4):
                        empty[prev].arrive()
                prev = stage
                stage += 1
                if stage == stages:
                    stage, phase = 0, phase ^ 1
            if pp:
                done[cw].arrive()
            yield
            if prev >= 0:
                readers[prev] -= 1
                for _ in range(4):
                    empty[prev].arrive()
            yield  # epilogue

    actors = {"p": producer(), "c0": consumer(0), "c1": consumer(1)}
    for n in range(steps):
        live = list(actors) + (["tma"] if inflight else [])
        if not live:
            return n
        who = live[rng.integers(len(live))]
        if who == "tma":
            st, val = inflight.pop(rng.integers(len(inflight)))
            assert readers[st] == 0, f"TMA overwrote stage {st} while a wgmma group reads it"
            smem[st] = val
            full[st].complete_tx(1)
            continue
        try:
            next(actors[who])
        except StopIteration:
            del actors[who]
    raise AssertionError("deadlock or livelock: the walk did not finish")
