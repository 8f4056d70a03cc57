"""NumPy emulation of blublas's kernel contract (argument list, flags, split-K layout, TMA tensor maps), run by the
repository's fake CUDA device (testing/fake_cuda/) for every blublas kernel launch. It checks the Python launch
plumbing (argument order, leading dimensions, batch strides, flags, grids, shared memory) on a CPU-only machine; the
CUDA code itself is checked by NVRTC (tests/test_nvrtc_compile.py) and on a GPU (the cuda-marked tests/test_gpu*.py).
"""

from __future__ import annotations

import re

import fake_cuda
import numpy as np
from blublas import configs
from blublas.reference import bf16_bits_to_f32, f32_to_bf16_bits, gelu_tanh
from fake_cuda import DistinctArray as ndarray
from fake_cuda import host_view

LAUNCHES: list[dict] = []  # one record per emulated launch: name, grid, block, smem (+ flags for GEMMs)
_TYPES: dict[str, list[str]] = {}
_GEMM_ENTRY = re.compile(r"blu_gemm_(simt|tf32|bf16)_\w+_(nn|nt|tn)")


def install(monkeypatch, tmp_path, sm90: bool = False):
    """The fake CUDA device as ``cupy`` for one test (the tests' ``fcp`` fixtures), its kernels emulated here: fresh
    blublas state (loader modules, functions, smem limits, workspaces, wgmma probe verdicts, launch memo, tensor
    maps), NVRTC bypassed, the cache dir under ``tmp_path``; ``sm90``: an H200-like device (cc 90, 132 SMs)."""
    from blublas import launch, loader, tma

    cp = fake_cuda.install(monkeypatch, kernels=_resolve, host_array_args=True, runtime_version=13000,
                           name="FakeGPU", distinct_arrays=True)
    monkeypatch.setenv("BLUBLAS_CACHE_DIR", str(tmp_path))
    for name in ("_modules", "_functions", "_smem_set", "_workspaces"):
        monkeypatch.setattr(loader, name, {})
    monkeypatch.setattr(loader, "_cubin_with_nvrtc", lambda f, a: tmp_path / f"{f}.cubin")
    monkeypatch.setattr(launch, "_probe_results", {})
    monkeypatch.setattr("blublas.memo._launch_memo", {})
    import blutensor.ext as bt_ext

    monkeypatch.setattr(tma, "_encoder", bt_ext.tma)  # blutensor's encoder, as the plugin host hands it over
    monkeypatch.setattr(bt_ext.tma, "_CUDA", GeometryDriver())  # the driver's entry point (no libcuda here)
    monkeypatch.setattr(tma, "_searched", True)
    monkeypatch.setattr(tma, "_checked", set())
    bt_ext.tma.clear_cache()
    if sm90:
        monkeypatch.setattr(loader, "compute_capability", lambda device_id=None: 90)
        monkeypatch.setattr(loader, "sm_count", lambda device_id=None: 132)
    LAUNCHES.clear()
    return cp


def _resolve(module, name: str):
    """The emulator of entry point ``name`` of ``module`` (a RawModule); KeyError where the module has none, as
    CuPy's get_function fails."""
    if module.path:
        assert "wgmma" in module.path and name.startswith("blu_gemm_wgmma_"), (module.path, name)
    else:
        assert "-std=c++17" in module.options, module.options
        if name not in module.names and not _GEMM_ENTRY.fullmatch(name):
            raise KeyError(name)
    return emulate


def _f(x: np.ndarray, bf16: bool) -> np.ndarray:
    return bf16_bits_to_f32(x).astype(np.float64) if bf16 else x.astype(np.float64)


def _epilogue(acc, C, bias, P, M, N, ldc, ldp, z_c, z_p, alpha, beta, flags):
    obf = bool(flags & 16)
    odt = np.uint16 if obf else np.float32
    c = host_view(C + z_c * (2 if obf else 4), odt, (M, N), (ldc, 1))
    v = alpha * acc
    if flags & 32:
        v = v + beta * _f(c, obf)
    if flags & 1:
        bdt = np.uint16 if flags & 2 else np.float32
        v = v + _f(host_view(bias, bdt, (N,), (1,)), bool(flags & 2))
    if flags & 4:
        if flags & 8:
            p = host_view(P + z_p * (2 if obf else 4), odt, (M, N), (ldp, 1))
            p[...] = f32_to_bf16_bits(v.astype(np.float32)) if obf else v
        v = gelu_tanh(v)
    c[...] = f32_to_bf16_bits(v.astype(np.float32)) if obf else v.astype(np.float32)


_TMAP_FMT = "<QQQQQQQQQQ"  # ptr, dims[3], strides[2], box[3], itemsize


class GeometryDriver(fake_cuda.TensorMapDriver):
    """The fake device's cuTensorMapEncodeTiled writing the map's geometry into its 128 bytes (address, dims,
    strides, box, element size), so the emulated TMA kernels below read the operands through the map."""

    ITEMSIZE = {7: 4, 9: 2}  # CUtensorMapDataType: FLOAT32, BFLOAT16

    def pack(self, call: dict) -> bytes:
        import struct

        raw = struct.pack(_TMAP_FMT, call["addr"], *call["dims"], *call["strides"], *call["box"],
                          self.ITEMSIZE[call["dtype"]])
        return raw + bytes(128 - len(raw))


def _tmaphost_view(tm: np.ndarray, dtype) -> tuple[np.ndarray, tuple]:
    """(batch, rows, cols) view of the operand a fake tensor map describes, and its box."""
    import struct

    ptr, d0, d1, d2, s0, s1, b0, b1, b2, isz = struct.unpack(_TMAP_FMT, tm.tobytes()[:80])
    assert isz == np.dtype(dtype).itemsize and s0 % isz == 0 and s1 % isz == 0 and b2 == 1
    return host_view(ptr, dtype, (d2, d1, d0), (s1 // isz, s0 // isz, 1)), (b0, b1)


def _param_types(name: str) -> list[str]:
    """C parameter types of kernel ``name`` read from the real .cu sources (macro parameter list for GEMMs)."""
    from blublas.loader import KERNEL_DIR, expand_source

    if name.startswith("blu_gemm_") and not name.startswith(("blu_gemm_splitk_reduce", "blu_gemm_epilogue_apply")):
        text = (KERNEL_DIR / "gemm_common.cuh").read_text()
        body = re.search(r"#define BLU_GEMM_PARAMS\s*\\\n(.*?)\n#define", text, re.S).group(1)
    else:
        fname = "split_tf32.cu" if name.startswith("blu_split_tf32") else "gemm_epilogue.cu"
        if name.startswith("blu_transpose"):
            fname = "transpose.cu"
        text = expand_source(KERNEL_DIR / fname)
        body = re.search(rf"void {name}\((.*?)\)\s*{{", text, re.S).group(1)
    body = body.replace("\\", " ")
    if name.startswith("blu_gemm_wgmma"):  # + BLU_TMA_PARAMS
        text = (KERNEL_DIR / "gemm_wgmma.cuh").read_text()
        tma = re.search(r"#define BLU_TMA_PARAMS((?:.*\\\n)*.*)", text).group(1).replace("\\", " ")
        body += ", " + tma.replace("__grid_constant__ ", "")
    out = []
    for decl in body.split(","):
        decl = " ".join(decl.split())
        out.append("ptr" if "*" in decl else decl.rsplit(" ", 1)[0].replace("const ", ""))
    return out


_NP_OF_C = {"ptr": (np.uint64,), "int": (np.int32,), "i64": (np.int64,), "long long": (np.int64,),
            "float": (np.float32,), "BluTmap": (np.ndarray,)}


def emulate(kernel, grid: tuple, block: tuple, args: tuple, shared_mem: int) -> None:
    """Run one launch of a blublas kernel: its arguments checked against the C signature in the .cu sources, the
    launch recorded in LAUNCHES, the kernel's documented effect computed with NumPy on the memory the pointers
    address."""
    name = kernel.name
    types_ = _TYPES.get(name)
    if types_ is None:
        types_ = _TYPES[name] = _param_types(name)
    assert len(args) == len(types_), (name, len(args), types_)
    for i, (a, t) in enumerate(zip(args, types_, strict=True)):
        ok = isinstance(a, ndarray) if t == "ptr" and isinstance(a, ndarray) else isinstance(a, _NP_OF_C[t])
        assert ok, f"{name} argument {i}: C type {t}, got {type(a).__name__}"
    vals = [int(a.data.ptr) if isinstance(a, ndarray) else a.item() for a in args]
    LAUNCHES.append({"name": name, "grid": grid, "block": block, "smem": shared_mem})
    if name.startswith("blu_gemm_splitk_reduce"):
        W, C, bias, P, M, N, batch, splits, ldc, ldp, sC, sP, alpha, beta, flags = vals
        if name.endswith("_v4"):  # column quads x rows: the grid must cover every (row, quad)
            assert N % 4 == 0 and W % 16 == 0 and block == (256,), (N, W, block)
            assert grid[0] * 256 >= N // 4 and 1 <= grid[1] <= min(batch * M, 65535), (grid, N, M)
        for b in range(batch):
            acc = sum(
                host_view(W + 4 * ((b * splits + s) * M * N), np.float32, (M, N), (N, 1)).astype(np.float64)
                for s in range(splits)
            )
            _epilogue(acc, C, bias, P, M, N, ldc, ldp, b * sC, b * sP, alpha, beta, flags)
        return
    if name == "blu_transpose_f32":
        src, dst, rows, cols, lds, ldd, sbs, dbs = vals
        assert grid == (-(-cols // 32), -(-rows // 32), grid[2]) and block == (32, 8), (grid, block)
        for z in range(grid[2]):
            a = host_view(src + 4 * z * sbs, np.float32, (rows, cols), (lds, 1))
            host_view(dst + 4 * z * dbs, np.float32, (cols, rows), (ldd, 1))[...] = a.T
        return
    if name.startswith("blu_split_tf32_concat"):
        _split_tf32(name, grid, block, vals)
        return
    if name == "blu_gemm_epilogue_apply":
        C, bias, P, M, N, batch, ldc, ldp, sC, sP, flags = vals
        obf = bool(flags & 16)
        for b in range(batch):
            cur = _f(host_view(C + b * sC * (2 if obf else 4), np.uint16 if obf else np.float32, (M, N), (ldc, 1)), obf)
            _epilogue(cur, C, bias, P, M, N, ldc, ldp, b * sC, b * sP, 1.0, 0.0, flags & ~32)
        return
    m = re.fullmatch(r"blu_gemm_(simt|tf32|bf16|wgmma_tf32|wgmma)_(\d\w+)_(nn|nt|tn)", name)
    assert m, name
    variant, cname, layout = m.groups()
    cfg = configs.ALL_CONFIGS[variant][cname]
    assert layout in cfg.layouts, (name, cfg.layouts)
    assert block == (cfg.threads,), (block, cfg.threads)
    assert shared_mem == cfg.smem_bytes(layout), (shared_mem, cfg.smem_bytes(layout))
    if shared_mem > 48 * 1024:
        assert kernel.max_dynamic_shared_size_bytes >= shared_mem, "dynamic smem limit not raised"
    tma = variant in configs.TMA_VARIANTS
    if tma:  # persistent grid; operands read through the (fake-encoded) tensor maps only
        tmA, tmB, tmC, nz, bmask = args[21:]
        vals = vals[:21]
        nz, bmask = int(nz), int(bmask)
        tiles = -(-vals[6] // cfg.bn) * -(-vals[5] // cfg.bm) * nz
        assert grid == (min(tiles, 132),), (grid, tiles)
        for tm in (tmA, tmB, tmC):  # by value: CuPy passes a one-element NumPy array's bytes
            assert isinstance(tm, np.ndarray) and tm.size == 1 and tm.dtype.itemsize == 128, tm
    (A, B, C, bias, P, M, N, K, lda, ldb, ldc, ldp, sA, sB, sC, sP, alpha, beta, flags, splits, chunk) = vals
    if not tma:
        assert len(args) == 21
        assert grid[0] == -(-N // cfg.bn) and grid[1] == -(-M // cfg.bm), (grid, M, N)
        nz = grid[2]
    bf = variant in ("bf16", "wgmma")
    if flags & 128:  # paired output stores: 2-element alignment of C (and P), even ld and batch stride
        osz = 2 if flags & 16 else 4
        assert C % (2 * osz) == 0 and ldc % 2 == 0 and (nz == 1 or sC % 2 == 0), "pair flag misused"
        if flags & 8:
            assert P % (2 * osz) == 0 and ldp % 2 == 0 and (nz == 1 or sP % 2 == 0), "pair flag misused"
    LAUNCHES[-1]["flags"] = flags
    if flags & 256:  # VEC8 (TMA kernels): 16-byte stores of 8 columns
        osz = 2 if flags & 16 else 4
        assert variant in configs.TMA_VARIANTS, "VEC8 outside the TMA kernels"
        assert C % 16 == 0 and (ldc * osz) % 16 == 0 and (nz == 1 or (sC * osz) % 16 == 0), "VEC8 misused"
        if flags & 8:
            assert P % 16 == 0 and (ldp * osz) % 16 == 0 and (nz == 1 or (sP * osz) % 16 == 0), "VEC8 misused"
    tma_store = bool(flags & 1024)
    if tma_store:  # the output through tmC: plain alpha (+ bias) epilogue, boxes of 128 B x 64 rows
        assert tma and not flags & (4 | 8 | 32), "TMA-store flag with GELU, pre-activation or beta"
        odt = np.uint16 if flags & 16 else np.float32
        vc, box_c = _tmaphost_view(tmC, odt)
        assert box_c == (128 // np.dtype(odt).itemsize, 64), box_c
        osz = np.dtype(odt).itemsize
        assert vc.shape == (nz, M, N) and vc.strides[1:] == (ldc * osz, osz), (vc.shape, vc.strides, nz, M, N)
        for z in range(nz):  # the map's z-th matrix is the one the epilogue below writes
            assert vc[z].ctypes.data == C + z * sC * osz, "tmC does not describe the output"
    if flags & 64:
        per = 8 if bf else 4
        assert A % 16 == 0 and B % 16 == 0 and lda % per == 0 and ldb % per == 0, "vector path misused"
    ta, tb = layout[0] == "t", layout[1] == "t"
    idt = np.uint16 if bf else np.float32
    if tma:
        esz = np.dtype(idt).itemsize
        va, box_a = _tmaphost_view(tmA, idt)
        vb, box_b = _tmaphost_view(tmB, idt)
        assert va.shape[1:] == ((K, M) if ta else (M, K)) and vb.shape[1:] == ((N, K) if tb else (K, N))
        assert box_a == (128 // esz, cfg.bk if ta else cfg.bm), box_a  # what gemm_wgmma.cuh loads
        assert box_b == (128 // esz, cfg.bn if tb else cfg.bk), box_b
        assert splits == 1 or chunk % cfg.bk == 0, "a split's last k tile would read the next split"
    for z in range(nz):
        b, s = divmod(z, splits)
        k0, k1 = s * chunk, min(K, (s + 1) * chunk)
        if tma:
            a = va[b if bmask & 1 else 0]
            bb = vb[b if bmask & 2 else 0]
        else:
            a = host_view(A + b * sA * np.dtype(idt).itemsize, idt, (K, M) if ta else (M, K), (lda, 1))
            bb = host_view(B + b * sB * np.dtype(idt).itemsize, idt, (N, K) if tb else (K, N), (ldb, 1))
        a = _f(a, bf)
        bb = _f(bb, bf)
        opa = a.T if ta else a
        opb = bb.T if tb else bb
        acc = opa[:, k0:k1] @ opb[k0:k1, :] if k1 > k0 else np.zeros((M, N))
        _epilogue(acc, C, bias, P, M, N, ldc, ldp, z * sC, z * sP, alpha, beta, flags)


def _split_tf32(name, grid, block, vals):
    """kernels/split_tf32.cu: P TF32 parts (hi, or lo where lo_mask has bit j) of each stored operand entry,
    written densely along K (horiz: columns, else rows)."""
    from blublas.reference import split_tf32

    src, dst, rows, cols, ld, sbs, nb, parts, lo_mask, horiz = vals
    vec = 4 if name.endswith("_v4") else 1
    if vec == 4:
        assert cols % 4 == 0 and ld % 4 == 0 and sbs % 4 == 0 and src % 16 == 0 and dst % 16 == 0, "v4 misused"
    assert grid[1] >= 1 and grid[0] * block[0] >= 1 and parts in (2, 3) and 0 <= lo_mask < (1 << parts)
    x = host_view(src, np.float32, (nb, rows, cols), (sbs, ld, 1))
    hi, lo = split_tf32(np.ascontiguousarray(x))
    if horiz:
        d = host_view(dst, np.float32, (nb, rows, parts, cols), (parts * rows * cols, parts * cols, cols, 1))
    else:
        d = host_view(dst, np.float32, (nb, parts, rows, cols), (parts * rows * cols, rows * cols, cols, 1))
    for j in range(parts):
        part = lo if (lo_mask >> j) & 1 else hi
        if horiz:
            d[:, :, j, :] = part
        else:
            d[:, j] = part


