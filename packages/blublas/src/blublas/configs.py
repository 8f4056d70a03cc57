"""Tile configurations of every kernel variant, the per-architecture lists, and the shape heuristic.

The names and numbers mirror the ``BLU_*_CONFIG`` lines of the .cu files (a test checks the two agree).
Per-architecture lists are ordered by preference and filtered by the opt-in shared memory of that
architecture; ``choose`` picks a (config, split-K) pair with a small wave-quantisation cost model, and the
autotuner (autotune.py) replaces that guess by a measurement when asked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import settings as _settings
from .errors import GemmError, ProviderUnavailable

#: precision -> kernel variant -> source file
VARIANT_OF_PRECISION = {"fp32": "simt", "tf32": "tf32", "bf16": "bf16"}
FILE_OF_VARIANT = {
    "simt": "gemm_simt_f32.cu",
    "tf32": "gemm_mma_tf32.cu",
    "bf16": "gemm_mma_bf16.cu",
    "wgmma": "gemm_wgmma_bf16.cu",
    "wgmma_tf32": "gemm_wgmma_tf32.cu",
}
#: variants compiled for an arch-specific target (sm_90a): only on exactly that compute capability
ARCH_SPECIFIC = {"wgmma": 90, "wgmma_tf32": 90}
#: variants whose kernels read A and B through TMA tensor maps (persistent grid, launch.tma_ok operands)
TMA_VARIANTS = ("wgmma", "wgmma_tf32")
#: precision -> extra sm_90a variants (opt-in, see wgmma_enabled)
EXTRA_VARIANTS = {"bf16": ("wgmma",), "tf32": ("wgmma_tf32",)}
LAYOUTS = ("nn", "nt", "tn")


@dataclass(frozen=True)
class TileConfig:
    """One compiled tile shape of one variant."""

    variant: str
    name: str
    bm: int
    bn: int
    bk: int
    threads: int
    stages: int
    layouts: tuple[str, ...] = ("nn", "nt", "tn")

    def smem_bytes(self, layout: str) -> int:
        """Dynamic shared memory this config needs for ``layout`` ('nn', 'nt' or 'tn')."""
        ta, tb = layout[0] == "t", layout[1] == "t"
        bm, bn, bk, st = self.bm, self.bn, self.bk, self.stages
        if self.variant == "simt":
            return st * 4 * (bk * (bm + 4) + bk * (bn + 4))
        if self.variant in TMA_VARIANTS:
            # stages of 128-byte rows, 16 KB of epilogue buffers per consumer warpgroup (two 8 KB TMA-store
            # boxes), +1024 to align the base, mbarriers
            return st * 128 * (bm + bn) + 2 * 16384 + 1024 + 16 * st + 16
        if self.variant == "tf32":
            a = bk * (bm + 8) if ta else bm * (bk + 4)
            b = bn * (bk + 4) if tb else bk * (bn + 8)
            return st * 4 * (a + b)
        a = bk * (bm + 8) if ta else bm * (bk + 8)
        b = bn * (bk + 8) if tb else bk * (bn + 8)
        return st * 2 * (a + b)

    def max_smem_bytes(self) -> int:
        return max(self.smem_bytes(lay) for lay in self.layouts)

    def kernel_name(self, layout: str) -> str:
        """The extern "C" entry point, e.g. blu_gemm_bf16_128x128x32_w2x2_s4_nt."""
        return f"blu_gemm_{self.variant}_{self.name}_{layout}"


def _mma(variant: str, bm: int, bn: int, bk: int, wm: int, wn: int, st: int) -> TileConfig:
    return TileConfig(variant, f"{bm}x{bn}x{bk}_w{wm}x{wn}_s{st}", bm, bn, bk, wm * wn * 32, st)


def _wgmma(bm: int, bn: int, st: int, pp: bool = False) -> TileConfig:
    """TMA + warp-specialized persistent bf16 kernel: 1 producer + 2 consumer warpgroups (384 threads), which
    share each tile (ws, cooperative) or take turns on alternate tiles (pp, ping-pong)."""
    return TileConfig("wgmma", f"{bm}x{bn}x64_{'pp' if pp else 'ws'}_s{st}", bm, bn, 64, 384, st)


def _wgmma_tf32(bm: int, bn: int, st: int, pp: bool = False) -> TileConfig:
    """The same kernel for tf32; NT only in the kernel: launch.py copies NN/TN's M/N-major operands K-major."""
    return TileConfig("wgmma_tf32", f"{bm}x{bn}x32_{'pp' if pp else 'ws'}_s{st}", bm, bn, 32, 384, st)


def _simt(bm: int, bn: int, bk: int, st: int) -> TileConfig:
    return TileConfig("simt", f"{bm}x{bn}x{bk}_s{st}", bm, bn, bk, (bm // 8) * (bn // 8), st)


ALL_CONFIGS: dict[str, dict[str, TileConfig]] = {
    "bf16": {
        c.name: c
        for c in (
            _mma("bf16", 128, 256, 32, 2, 4, 4),
            _mma("bf16", 128, 128, 32, 2, 2, 4),
            _mma("bf16", 128, 128, 64, 2, 2, 3),
            _mma("bf16", 64, 128, 32, 2, 2, 4),
            _mma("bf16", 128, 256, 64, 2, 4, 3),  # sm_90 candidate (166 KB of smem)
        )
    },
    "wgmma": {c.name: c for c in (_wgmma(128, 256, 4), _wgmma(128, 128, 6, pp=True), _wgmma(128, 128, 6))},
    "wgmma_tf32": {
        c.name: c for c in (_wgmma_tf32(128, 256, 4), _wgmma_tf32(128, 128, 6, pp=True), _wgmma_tf32(128, 128, 6))
    },
    "tf32": {
        c.name: c
        for c in (
            _mma("tf32", 128, 128, 32, 2, 2, 3),
            _mma("tf32", 128, 128, 16, 2, 4, 4),
            _mma("tf32", 128, 64, 32, 2, 2, 3),
            _mma("tf32", 64, 64, 32, 2, 2, 4),
            _mma("tf32", 128, 256, 32, 2, 4, 3),  # sm_90 candidate (166 KB of smem)
        )
    },
    "simt": {
        c.name: c
        for c in (
            _simt(128, 128, 8, 4),
            _simt(128, 128, 16, 3),
            _simt(128, 64, 8, 4),
            _simt(64, 64, 8, 4),
            # stages == 2: register-staged double buffer, 16-byte global loads, warp tile 32 x 64 (on sm_90 the
            # fastest on GPT-2's fp32 GEMMs, well ahead of the cp.async configs above:
            # benchmarks/results/blublas_simt_h200.json)
            _simt(128, 128, 8, 2),
        )
    },
}


@dataclass(frozen=True)
class ArchInfo:
    """What the heuristic knows about an architecture (per-SM rates are rough, only their ratios matter)."""

    cc: int
    smem_optin: int  # max dynamic shared memory per block, bytes
    smem_per_sm: int
    sms_default: int
    rate: dict[str, float]  # variant -> flop/s per SM (sustained, mma.sync / FFMA)
    bandwidth: float  # bytes/s of DRAM
    order: dict[str, tuple[str, ...]]  # variant -> preferred configs


ARCHS: dict[int, ArchInfo] = {
    80: ArchInfo(
        80,
        166912,
        167936,
        108,
        {"bf16": 2.3e12, "tf32": 1.15e12, "simt": 0.18e12},
        1.9e12,
        {
            "bf16": ("128x256x32_w2x4_s4", "128x128x64_w2x2_s3", "128x128x32_w2x2_s4", "64x128x32_w2x2_s4"),
            "tf32": ("128x128x32_w2x2_s3", "128x128x16_w2x4_s4", "128x64x32_w2x2_s3", "64x64x32_w2x2_s4"),
            "simt": ("128x128x8_s4", "128x128x16_s3", "128x64x8_s4", "64x64x8_s4", "128x128x8_s2"),
        },
    ),
    86: ArchInfo(
        86,
        101376,
        102400,
        84,
        {"bf16": 0.85e12, "tf32": 0.43e12, "simt": 0.43e12},
        0.9e12,
        {
            "bf16": ("128x128x32_w2x2_s4", "64x128x32_w2x2_s4"),
            "tf32": ("128x128x16_w2x4_s4", "128x64x32_w2x2_s3", "64x64x32_w2x2_s4"),
            "simt": ("128x128x8_s4", "128x64x8_s4", "64x64x8_s4", "128x128x8_s2"),
        },
    ),
    89: ArchInfo(
        89,
        101376,
        102400,
        128,
        {"bf16": 1.3e12, "tf32": 0.65e12, "simt": 0.65e12},
        1.0e12,
        {
            "bf16": ("128x128x32_w2x2_s4", "64x128x32_w2x2_s4"),
            "tf32": ("128x128x16_w2x4_s4", "128x64x32_w2x2_s3", "64x64x32_w2x2_s4"),
            "simt": ("128x128x8_s4", "128x64x8_s4", "64x64x8_s4", "128x128x8_s2"),
        },
    ),
    90: ArchInfo(
        90,
        232448,
        233472,
        132,
        {"bf16": 3.0e12, "tf32": 1.5e12, "simt": 0.5e12, "wgmma": 5.5e12, "wgmma_tf32": 2.7e12},
        4.0e12,
        {
            # known-good configs first (the heuristic's tie order), then the sm_90 candidates for the autotuner
            "bf16": (
                "128x256x32_w2x4_s4",
                "128x128x64_w2x2_s3",
                "128x128x32_w2x2_s4",
                "64x128x32_w2x2_s4",
                "128x256x64_w2x4_s3",
            ),
            "tf32": (
                "128x128x32_w2x2_s3",
                "128x128x16_w2x4_s4",
                "128x64x32_w2x2_s3",
                "64x64x32_w2x2_s4",
                "128x256x32_w2x4_s3",
            ),
            # sm_90 (benchmarks/blublas/bench_gemm_configs.py): the register-staged 128x128x8_s2 won every GPT-2
            # fp32 shape over the cp.async configs and the 128x256 / 256x128 tiles
            # (benchmarks/results/blublas_simt_h200.json)
            "simt": ("128x128x8_s2",),
            "wgmma": ("128x256x64_ws_s4", "128x128x64_pp_s6", "128x128x64_ws_s6"),
            "wgmma_tf32": ("128x256x32_ws_s4", "128x128x32_pp_s6", "128x128x32_ws_s6"),
        },
    ),
}

#: TMA kernels on the H200 (benchmarks/blublas/bench_gemm_configs.py timings, least squares over the GPT-2 shapes,
#: +-15%): seconds per k tile and fixed seconds per output tile (epilogue, pipeline refill) of one CTA
TMA_TILE_COST = {
    "128x256x64_ws_s4": (0.640e-6, 6.7e-6),
    "128x128x64_pp_s6": (0.352e-6, 2.6e-6),
    "128x128x64_ws_s6": (0.372e-6, 3.4e-6),
    "128x256x32_ws_s4": (0.641e-6, 7.8e-6),
    "128x128x32_pp_s6": (0.332e-6, 2.7e-6),
    "128x128x32_ws_s6": (0.335e-6, 5.2e-6),
}

SPLIT_CHOICES = (1, 2, 3, 4, 6, 8, 12, 16)
#: per-variant split lists: SIMT tiles fill 132 SMs x 2 CTAs best with 7 or 11 splits on GPT-2's dW shapes
#: (on sm_90, 7 splits beat 6 or 8 on dW 768x768x16384, and 11 is the best on 3072x768x16384)
SPLIT_CHOICES_OF_VARIANT = {"simt": (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 14, 16)}
MAX_WORKSPACE_BYTES = 128 << 20  # split-K partial products larger than this are not considered


def arch_info(cc: int) -> ArchInfo:
    """The table entry for compute capability ``cc`` (e.g. 90); newer chips use the closest older entry."""
    if cc < 80:
        raise ProviderUnavailable(
            f"blublas kernels need compute capability >= 8.0 (cp.async, mma.sync); this device is "
            f"sm_{cc}. Use the 'cublas' provider instead."
        )
    return ARCHS[max(k for k in ARCHS if k <= cc)]


def wgmma_mode() -> str:
    """BLUBLAS_WGMMA (blublas.settings, read once): 'on' (``1``) use the sm_90a wgmma kernels, 'off' (``0``)
    never, 'auto' (unset) use them once a quick on-device self-test against float64 has passed (see
    launch.usable_variants)."""
    return _settings.get().wgmma


def wgmma_enabled() -> bool:
    """Whether the wgmma variants may be considered at all (mode 'on' or 'auto')."""
    return wgmma_mode() != "off"


def variants_for(precision: str, cc: int) -> list[str]:
    """Kernel variants that may serve ``precision`` on compute capability ``cc`` (primary first)."""
    out = [VARIANT_OF_PRECISION[precision]]
    if wgmma_enabled():
        out += [v for v in EXTRA_VARIANTS.get(precision, ()) if cc == ARCH_SPECIFIC[v]]
    return out


def configs_for(variant: str, cc: int) -> list[TileConfig]:
    """The configs of ``variant`` tuned for ``cc``, in preference order, that fit its shared memory."""
    if variant in ARCH_SPECIFIC and cc != ARCH_SPECIFIC[variant]:
        return []
    info = arch_info(cc)
    table = ALL_CONFIGS[variant]
    order = info.order.get(variant, ())
    return [table[n] for n in order if table[n].max_smem_bytes() <= info.smem_optin]


def get_config(variant: str, name: str) -> TileConfig:
    """Look a config up by name, with an error listing the valid names."""
    try:
        return ALL_CONFIGS[variant][name]
    except KeyError:
        raise GemmError(
            f"unknown {variant} tile config {name!r}; known: {sorted(ALL_CONFIGS.get(variant, {}))}"
        ) from None


def k_chunk_for(cfg: TileConfig, k: int, splits: int) -> tuple[int, int]:
    """(k_chunk, effective splits): k range per split rounded up to the tile depth, no empty splits."""
    if splits <= 1:
        return max(k, 1), 1
    chunk = -(-k // splits)
    chunk = -(-chunk // cfg.bk) * cfg.bk
    return chunk, -(-k // chunk)


def estimate_seconds(
    cfg: TileConfig,
    splits: int,
    m: int,
    n: int,
    k: int,
    batch: int,
    cc: int,
    sms: int,
    out_bytes: int,
    layout: str | None = None,
) -> float:
    """Rough run time of ``cfg`` with ``splits`` on an (m, n, k) x batch problem (for ranking only)."""
    info = arch_info(cc)
    chunk, splits = k_chunk_for(cfg, k, splits)
    ctas = -(-m // cfg.bm) * -(-n // cfg.bn) * batch * splits
    cost = TMA_TILE_COST.get(cfg.name) if cfg.variant in TMA_VARIANTS else None
    if cost is not None:  # persistent kernels: ceil(tiles / SMs) tiles per CTA, each t0 + k tiles x t_k
        t_k, t0 = cost
        t = -(-ctas // sms) * (t0 + -(-chunk // cfg.bk) * t_k) + 4e-6
        if splits > 1:
            t += batch * m * n * (8.0 * splits + 2 * out_bytes) / info.bandwidth + 4e-6
        if cfg.variant == "wgmma_tf32" and layout in ("nn", "tn"):  # K-major copies: read + write fp32
            t += batch * ((k * n) + (k * m if layout == "tn" else 0)) * 8.0 / (0.7 * info.bandwidth) + 3e-6
        return t
    acc_regs = cfg.bm * cfg.bn // cfg.threads
    regs = min(255, acc_regs + 48)
    occ = max(
        1,
        min(
            info.smem_per_sm // max(cfg.max_smem_bytes(), 1),
            2048 // cfg.threads,
            65536 // (cfg.threads * regs),
        ),
    )
    intensity = cfg.bm * cfg.bn / (cfg.bm + cfg.bn)
    eff = min(1.0, (intensity / 85.3) ** 0.35)
    waves = math.ceil(ctas / (sms * occ))
    per_cta = 2.0 * cfg.bm * cfg.bn * (chunk + 2 * cfg.bk) / (info.rate[cfg.variant] / occ * eff)
    t = waves * per_cta + 4e-6
    if splits > 1:
        t += batch * m * n * (8.0 * splits + 2 * out_bytes) / info.bandwidth + 4e-6
    if cfg.variant == "wgmma_tf32" and layout in ("nn", "tn"):  # K-major copies: read + write fp32
        copied = (k * n) + (k * m if layout == "tn" else 0)
        t += batch * copied * 8.0 / (0.7 * info.bandwidth) + 3e-6
    return t


def candidates(
    variant: str, cc: int, m: int, n: int, k: int, batch: int, layout: str | None = None
) -> list[tuple[TileConfig, int]]:
    """All (config, splits) pairs worth trying on this shape and layout (what the autotuner measures).

    Split-K only where the output tiles fill fewer than two waves of the GPU: with more, splitting adds the
    partial products' traffic and a reduction for no gain in occupancy (single-call autotuner timings picked
    2 splits for some 768-tile fp32 GEMMs that then ran slower back to back)."""
    out = []
    sms = arch_info(cc).sms_default
    for cfg in configs_for(variant, cc):
        if layout is not None and layout not in cfg.layouts:
            continue
        few_tiles = -(-m // cfg.bm) * -(-n // cfg.bn) * max(batch, 1) < 2 * sms
        for s in SPLIT_CHOICES_OF_VARIANT.get(variant, SPLIT_CHOICES):
            if s == 1:
                out.append((cfg, s))
            elif (
                few_tiles
                and k >= 1024
                and k >= 2 * s * cfg.bk
                and k_chunk_for(cfg, k, s)[1] == s
                and 4 * batch * m * n * s <= MAX_WORKSPACE_BYTES
            ):
                out.append((cfg, s))
    return out


def candidates_for_precision(
    precision: str,
    cc: int,
    m: int,
    n: int,
    k: int,
    batch: int,
    layout: str | None = None,
    variants: list[str] | None = None,
) -> list:
    """``candidates`` of every variant serving ``precision`` on ``cc`` (and ``layout``), or of ``variants``."""
    out = []
    for v in variants if variants is not None else variants_for(precision, cc):
        out += candidates(v, cc, m, n, k, batch, layout)
    return out


def choose(
    variant: str,
    cc: int,
    m: int,
    n: int,
    k: int,
    batch: int = 1,
    sms: int | None = None,
    out_bytes: int = 4,
    precision: str | None = None,
    layout: str | None = None,
    variants: list[str] | None = None,
) -> tuple[TileConfig, int]:
    """Heuristic (config, splits) for a shape: the lowest estimated time among the candidates
    (of ``variant``, or of every variant serving ``precision`` when given)."""
    sms = sms or arch_info(cc).sms_default
    best = None
    best_split = None
    cands = (
        candidates_for_precision(precision, cc, m, n, k, batch, layout, variants)
        if precision
        else candidates(variant, cc, m, n, k, batch, layout)
    )
    for cfg, s in cands:
        t = estimate_seconds(cfg, s, m, n, k, batch, cc, sms, out_bytes, layout)
        if s == 1 and (best is None or t < best[0]):
            best = (t, cfg, s)
        if s > 1 and (best_split is None or t < best_split[0]):
            best_split = (t, cfg, s)
    assert best is not None
    if best_split is not None and best_split[0] < 0.9 * best[0]:  # split-K only when clearly better
        best = best_split
    return best[1], best[2]
