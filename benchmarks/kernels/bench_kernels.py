"""pytest-benchmark suite: blutensor's CUDA kernels beside their PyTorch counterparts on GPT-2 124M's
training shapes (attention B x NH x HD at T = 512/1024/2048, GELU 16x1024x3072, LayerNorm 16384x768,
cross-entropy 16384x50304, AdamW and the gradient norm over GPT-2 124M's parameters).

Run on a GPU machine from the repo root, with the packages installed:
    pytest benchmarks/kernels/bench_kernels.py --benchmark-json=benchmarks/results/kernels.json
Each benchmark's ``extra_info`` holds the impl (blutrain|torch), shape, dtype, the median kernel time from
CUDA events (``device_ms``) and, for memory-bound kernels, GB/s and the fraction of the device-copy
bandwidth measured in the same process (``frac_copy_bw``; the target is >= 0.8); for attention TFLOP/s.
Without CuPy or a GPU every benchmark is skipped.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

ROUNDS = 20


def _gpt2_param_shapes() -> list[tuple[int, ...]]:
    """blutensor's dev/kernel_reference.gpt2_param_shapes (the one list the kernel checks and tests share)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages" / "blutensor" / "dev"))
    from kernel_reference import gpt2_param_shapes

    return gpt2_param_shapes()


def _cupy():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
        return cupy
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"needs CuPy and a CUDA GPU: {exc}")


def _torch():
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no GPU")
        return torch
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"needs PyTorch with CUDA: {exc}")


def _device_ms(fn, sync, event, rounds=ROUNDS) -> float:
    """Median device ms per call of fn() by CUDA events around batches of back-to-back calls (~2 ms of work
    per batch), so host launch gaps do not count for short kernels (``event()`` makes one event)."""

    def elapsed(a, b):
        return b.time_since(a) if hasattr(b, "time_since") else a.elapsed_time(b)

    for _ in range(3):
        fn()
    a, b = event(), event()
    a.record()
    fn()
    b.record()
    b.synchronize()
    batch = int(min(20, max(1, 2.0 / max(elapsed(a, b), 1e-3))))
    ts = []
    for _ in range(max(3, rounds // batch)):
        a, b = event(), event()
        a.record()
        for _ in range(batch):
            fn()
        b.record()
        b.synchronize()
        ts.append(elapsed(a, b) / batch)
    return float(np.median(ts))


class _CpEvent:
    def __init__(self):
        import cupy

        self.e = cupy.cuda.Event()

    def record(self):
        self.e.record()

    def synchronize(self):
        self.e.synchronize()

    def time_since(self, a):
        import cupy

        return cupy.cuda.get_elapsed_time(a.e, self.e)


_copy_bw: list = []


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written), measured once per process."""
    if not _copy_bw:
        cp = _cupy()
        a = cp.empty(2 * 1024**3 // 4, cp.float32)
        b = cp.empty_like(a)
        ms = _device_ms(lambda: cp.copyto(b, a), cp.cuda.Device().synchronize, _CpEvent, rounds=10)
        _copy_bw.append(2 * a.nbytes / ms / 1e6)
        del a, b
    return _copy_bw[0]


def _run(benchmark, impl, fn, info, nbytes=None, flops=None):
    """Time ``fn`` with pytest-benchmark (wall, synchronised) and CUDA events (device) into extra_info."""
    if impl == "torch":
        torch = _torch()
        sync = torch.cuda.synchronize

        def event():
            return torch.cuda.Event(enable_timing=True)
    else:
        cp = _cupy()
        sync = cp.cuda.Device().synchronize
        event = _CpEvent
    ms = _device_ms(fn, sync, event)
    info = dict(info, impl=impl, device_ms=ms)
    if nbytes:
        gbs = nbytes / ms / 1e6
        info.update(GBps=gbs, frac_copy_bw=gbs / copy_bandwidth())
    if flops:
        info["TFLOPs"] = flops / ms / 1e9
    benchmark.extra_info.update(info)

    def step():
        fn()
        sync()

    benchmark.pedantic(step, rounds=ROUNDS, iterations=1, warmup_rounds=2)


def _dev(cp, shape, storage, scale=1.0):
    a = cp.random.standard_normal(shape, dtype=cp.float32) * scale
    if storage == "bf16":
        from blutensor.ext import f32_to_bf16_bits

        return f32_to_bf16_bits(a, cp)
    return a


def _tdt(torch, storage):
    return torch.float32 if storage == "f32" else torch.bfloat16


STORAGES = ("f32", "bf16")
IMPLS = ("blutrain", "torch")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("pass_", ("fwd", "bwd"))
def test_layer_norm(benchmark, impl, storage, pass_):
    N, C = 16384, 768
    es = 4 if storage == "f32" else 2
    nbytes = (2 if pass_ == "fwd" else 3) * N * C * es
    info = dict(kernel="layer_norm", shape=f"{N}x{C}", dtype=storage, pass_=pass_)
    if impl == "torch":
        torch = _torch()
        x = torch.randn(N, C, device="cuda", dtype=_tdt(torch, storage), requires_grad=True)
        w = torch.randn(C, device="cuda", dtype=x.dtype, requires_grad=True)
        b = torch.randn(C, device="cuda", dtype=x.dtype, requires_grad=True)
        if pass_ == "fwd":
            fn = lambda: torch.nn.functional.layer_norm(x, (C,), w, b)  # noqa: E731
        else:
            y = torch.nn.functional.layer_norm(x, (C,), w, b)
            g = torch.ones_like(y)
            fn = lambda: torch.autograd.grad(y, (x, w, b), g, retain_graph=True)  # noqa: E731
    else:
        from blutensor.ext import layer_norm_backward, layer_norm_forward

        cp = _cupy()
        x, w, b = _dev(cp, (N, C), storage), _dev(cp, (C,), storage), _dev(cp, (C,), storage)
        if pass_ == "fwd":
            fn = lambda: layer_norm_forward(x, w, b)  # noqa: E731
        else:
            _, mean, rstd, _ = layer_norm_forward(x, w, b)
            g = _dev(cp, (N, C), storage)
            fn = lambda: layer_norm_backward(g, x, w, mean, rstd)  # noqa: E731
    _run(benchmark, impl, fn, info, nbytes=nbytes)


@pytest.mark.parametrize("impl", ("blutrain", "blutrain_unfused", "torch"))
@pytest.mark.parametrize("pass_", ("fwd", "bwd"))
def test_add_layer_norm_autocast(benchmark, impl, pass_):
    """GPT-2's residual add + LayerNorm under bf16 autocast (bf16 sublayer output, float32 residual stream and
    weights, bf16 normalised output): the fused op (``add_layer_norm_*``) against the sequence it replaces
    (widening add, float32 LayerNorm, cast to bf16; backward: widening cast of the bf16 gradient, LayerNorm backward
    with the residual gradient, bf16 rounding of the sublayer's gradient) and PyTorch's add + layer_norm + cast."""
    N, C = 16384, 768
    # fwd: read x (bf16) and r, write h and y (bf16); bwd: read gy (bf16), gh, h, write dres and dx (bf16)
    nbytes = N * C * (2 + 4 + 4 + 2) if pass_ == "fwd" else N * C * (2 + 4 + 4 + 4 + 2)
    info = dict(kernel="add_layer_norm", shape=f"{N}x{C}", dtype="bf16_f32_bf16_f32", pass_=pass_)
    if impl == "torch":
        torch = _torch()
        a = torch.randn(N, C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        r = torch.randn(N, C, device="cuda", requires_grad=True)
        w = torch.randn(C, device="cuda", requires_grad=True)
        b = torch.randn(C, device="cuda", requires_grad=True)

        def fwd():
            h = r + a
            return h, torch.nn.functional.layer_norm(h, (C,), w, b).to(torch.bfloat16)

        if pass_ == "fwd":
            fn = fwd
        else:
            h, y = fwd()
            gy, gh = torch.ones_like(y), torch.ones_like(h)
            fn = lambda: torch.autograd.grad((h, y), (a, r, w, b), (gh, gy), retain_graph=True)  # noqa: E731
        _run(benchmark, impl, fn, info, nbytes=nbytes)
        return
    from blutensor.ext import (
        add_layer_norm_backward,
        add_layer_norm_forward,
        add_widen,
        cast_to_bf16,
        cast_to_f32,
        layer_norm_backward,
        layer_norm_forward,
    )

    cp = _cupy()
    a, r = _dev(cp, (N, C), "bf16"), _dev(cp, (N, C), "f32")
    w, b = _dev(cp, (C,), "f32"), _dev(cp, (C,), "f32")
    gy, gh = _dev(cp, (N, C), "bf16"), _dev(cp, (N, C), "f32")
    if impl == "blutrain":
        h, _, mean, rstd = add_layer_norm_forward(a, r, w, b, 1e-5, np.uint16)
        dw, db = cp.zeros(C, cp.float32), cp.zeros(C, cp.float32)
        fn = (lambda: add_layer_norm_forward(a, r, w, b, 1e-5, np.uint16)) if pass_ == "fwd" else \
            (lambda: add_layer_norm_backward(gy, gh, h, w, mean, rstd, np.uint16, True, True, dw, db))
    else:
        def fwd():
            h = add_widen(r, a)
            return h, cast_to_bf16(layer_norm_forward(h, w, b)[0])

        h = add_widen(r, a)
        _, mean, rstd, _ = layer_norm_forward(h, w, b)

        def bwd():
            dx, _, _ = layer_norm_backward(cast_to_f32(gy), h, w, mean, rstd, gh)
            return dx, cast_to_bf16(dx)

        fn = fwd if pass_ == "fwd" else bwd
    _run(benchmark, impl, fn, info, nbytes=nbytes)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("pass_", ("fwd", "bwd"))
def test_gelu(benchmark, impl, storage, pass_):
    shape = (16, 1024, 3072)
    n = math.prod(shape)
    es = 4 if storage == "f32" else 2
    nbytes = (2 if pass_ == "fwd" else 3) * n * es
    info = dict(kernel="gelu_tanh", shape="16x1024x3072", dtype=storage, pass_=pass_)
    if impl == "torch":
        torch = _torch()
        x = torch.randn(*shape, device="cuda", dtype=_tdt(torch, storage))
        g = torch.randn_like(x)
        if pass_ == "fwd":
            fn = lambda: torch.nn.functional.gelu(x, approximate="tanh")  # noqa: E731
        else:
            fn = lambda: torch.ops.aten.gelu_backward(g, x, approximate="tanh")  # noqa: E731
    else:
        from blutensor.ext import gelu_backward, gelu_forward

        cp = _cupy()
        x, g = _dev(cp, shape, storage), _dev(cp, shape, storage)
        fn = (lambda: gelu_forward(x, "tanh")) if pass_ == "fwd" else (lambda: gelu_backward(g, x, "tanh"))
    _run(benchmark, impl, fn, info, nbytes=nbytes)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("storage", STORAGES)
def test_cross_entropy_fwd_and_logits_grad(benchmark, impl, storage):
    N, C = 16384, 50304
    es = 4 if storage == "f32" else 2
    info = dict(kernel="cross_entropy(loss+dlogits)", shape=f"{N}x{C}", dtype=storage)
    if impl == "torch":
        torch = _torch()
        z = torch.randn(N, C, device="cuda", dtype=_tdt(torch, storage), requires_grad=True)
        t = torch.randint(0, 50257, (N,), device="cuda")

        def fn():
            torch.nn.functional.cross_entropy(z, t).backward()
            z.grad = None
    else:
        from blutensor.ext import cuda_cross_entropy_forward as cross_entropy_forward

        cp = _cupy()
        z = _dev(cp, (N, C), storage)
        t = cp.random.randint(0, 50257, N).astype(cp.int64)
        fn = lambda: cross_entropy_forward(z, t, want_grad=True, inplace_grad=True)  # noqa: E731
    _run(benchmark, impl, fn, info, nbytes=2 * N * C * es)  # minimum traffic: read + write the logits once


BF16_M = 16384  # GPT-2 124M B=16 x T=1024 tokens


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("direction", ("f32_to_bf16", "bf16_to_f32"))
def test_bf16_cast(benchmark, impl, direction):
    """The autocast weight/activation cast, 16384x768 elements."""
    n = BF16_M * 768
    info = dict(kernel="cast", shape=f"{BF16_M}x768", dtype=direction, pass_="fwd")
    if impl == "torch":
        torch = _torch()
        x = torch.randn(n, device="cuda", dtype=torch.float32 if direction == "f32_to_bf16" else torch.bfloat16)
        fn = (lambda: x.to(torch.bfloat16)) if direction == "f32_to_bf16" else (lambda: x.to(torch.float32))
    else:
        from blutensor.ext import cast_to_bf16, cast_to_f32

        cp = _cupy()
        x32 = cp.random.standard_normal(n, dtype=cp.float32)
        x = x32 if direction == "f32_to_bf16" else cast_to_bf16(x32)
        fn = (lambda: cast_to_bf16(x)) if direction == "f32_to_bf16" else (lambda: cast_to_f32(x))
    _run(benchmark, impl, fn, info, nbytes=n * 6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", (768, 2304, 3072))
def test_bf16_bias_grad(benchmark, impl, n):
    """Bias gradient of a bf16 linear: column sums of (16384, n) bf16 (a GEMV on the GEMM provider; torch:
    its own sum)."""
    info = dict(kernel="bias_grad", shape=f"{BF16_M}x{n}", dtype="bf16", pass_="bwd")
    if impl == "torch":
        torch = _torch()
        g = torch.randn(BF16_M, n, device="cuda", dtype=torch.bfloat16)
        fn = lambda: g.sum(0)  # noqa: E731
    else:
        from blutensor.ext import bf16_bias_grad, bf16_gemm_provider

        cp = _cupy()
        g = _dev(cp, (BF16_M, n), "bf16")
        prov = bf16_gemm_provider()
        fn = lambda: bf16_bias_grad(prov, g)  # noqa: E731
    _run(benchmark, impl, fn, info, nbytes=BF16_M * n * 2)


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_linear_gemm(benchmark, impl):
    """One bf16 GEMM of GPT-2's MLP: (16384, 768) @ (3072, 768)^T."""
    info = dict(kernel="bf16_gemm", shape=f"{BF16_M}x768->3072", dtype="bf16", pass_="fwd")
    if impl == "torch":
        torch = _torch()
        x = torch.randn(BF16_M, 768, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(3072, 768, device="cuda", dtype=torch.bfloat16)
        fn = lambda: x @ w.T  # noqa: E731
    else:
        from blutensor.ext import bf16_gemm, bf16_gemm_provider

        cp = _cupy()
        x, w = _dev(cp, (BF16_M, 768), "bf16"), _dev(cp, (3072, 768), "bf16")
        prov = bf16_gemm_provider()
        fn = lambda: bf16_gemm(prov, x, w, trans_b=True)  # noqa: E731
    _run(benchmark, impl, fn, info, flops=2 * BF16_M * 768 * 3072)


GPT2_SHAPES = _gpt2_param_shapes()  # GPT-2 124M parameter shapes, model order


@pytest.mark.parametrize("impl", IMPLS)
def test_adamw_gpt2(benchmark, impl):
    total = sum(math.prod(s) for s in GPT2_SHAPES)
    info = dict(kernel="adamw", shape=f"GPT-2 124M ({len(GPT2_SHAPES)} tensors, {total} elements)", dtype="f32")
    if impl == "torch":
        torch = _torch()
        ps = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in GPT2_SHAPES]
        for p in ps:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(ps, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
        fn = opt.step
    else:
        from blutensor.ext import multi_tensor_adamw

        cp = _cupy()
        ps = [_dev(cp, s, "f32").ravel() for s in GPT2_SHAPES]
        gs = [_dev(cp, s, "f32").ravel() for s in GPT2_SHAPES]
        ms = [cp.zeros(math.prod(s), cp.float32) for s in GPT2_SHAPES]
        vs = [cp.zeros(math.prod(s), cp.float32) for s in GPT2_SHAPES]
        fn = lambda: multi_tensor_adamw(ps, gs, ms, vs, 10, 6e-4, 0.9, 0.95, 1e-8, 0.1)  # noqa: E731
    _run(benchmark, impl, fn, info, nbytes=28 * total)  # read p, g, m, v; write p, m, v


@pytest.mark.parametrize("impl", IMPLS)
def test_grad_norm_gpt2(benchmark, impl):
    total = sum(math.prod(s) for s in GPT2_SHAPES)
    info = dict(kernel="grad_norm", shape="GPT-2 124M", dtype="f32")
    if impl == "torch":
        torch = _torch()
        gs = [torch.randn(s, device="cuda") for s in GPT2_SHAPES]
        fn = lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gs)))  # noqa: E731
    else:
        from blutensor.ext import global_grad_norm

        cp = _cupy()
        gs = [_dev(cp, s, "f32").ravel() for s in GPT2_SHAPES]
        fn = lambda: global_grad_norm(gs)  # noqa: E731
    _run(benchmark, impl, fn, info, nbytes=4 * total)


ATTN = [(T, B, H, D) for T in (512, 1024) for (B, H, D) in ((1, 12, 64), (4, 12, 64), (8, 16, 64), (16, 12, 64))] + [
    (2048, B, H, D) for (B, H, D) in ((1, 16, 64), (1, 32, 128), (4, 32, 128))
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("variant", ("f32", "tf32", "bf16"))
@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("pass_", ("fwd", "bwd"))
@pytest.mark.parametrize("cfg", ATTN, ids=lambda c: f"T{c[0]}-{c[1]}x{c[2]}x{c[3]}")
def test_attention(benchmark, impl, variant, causal, pass_, cfg):
    T, B, H, D = cfg
    flops = 4 * B * H * T * T * D * (0.5 if causal else 1.0) * (2.5 if pass_ == "bwd" else 1.0)
    info = dict(kernel="attention", shape=f"T={T} {B}x{H}x{D}", dtype=variant, causal=causal, pass_=pass_)
    if impl == "torch":
        torch = _torch()
        torch.backends.cuda.matmul.allow_tf32 = variant == "tf32"
        dt = torch.bfloat16 if variant == "bf16" else torch.float32
        q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        if pass_ == "fwd":
            fn = lambda: sdpa(q, k, v, is_causal=causal)  # noqa: E731
        else:
            o = sdpa(q, k, v, is_causal=causal)
            g = torch.randn_like(o)
            fn = lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True)  # noqa: E731
    else:
        from blutensor.ext import flash_attention_backward, flash_attention_forward

        cp = _cupy()
        storage = "bf16" if variant == "bf16" else "f32"
        q, k, v = (_dev(cp, (B * H, T, D), storage) for _ in range(3))
        if pass_ == "fwd":
            fn = lambda: flash_attention_forward(q, k, v, causal, None, variant)  # noqa: E731
        else:
            o, lse = flash_attention_forward(q, k, v, causal, None, variant)
            do = _dev(cp, (B * H, T, D), storage)
            fn = lambda: flash_attention_backward(q, k, v, o, lse, do, causal, None, variant)  # noqa: E731
    _run(benchmark, impl, fn, info, flops=flops)


#: bf16 attention on Hopper: BluTrain's wgmma kernels (and its mma.sync ones) against PyTorch SDPA with the cuDNN
#: backend (the kernel torch.compile's GPT-2 runs on the H200)
HOPPER_IMPLS = ("blutrain_wgmma", "blutrain_mma", "torch_cudnn")


@pytest.mark.parametrize("impl", HOPPER_IMPLS)
@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("pass_", ("fwd", "bwd"))
@pytest.mark.parametrize("cfg", [(1024, 16, 12, 64), (2048, 4, 32, 128)], ids=lambda c: f"T{c[0]}-{c[1]}x{c[2]}x{c[3]}")
def test_attention_hopper_vs_cudnn(benchmark, impl, causal, pass_, cfg):
    T, B, H, D = cfg
    flops = 4 * B * H * T * T * D * (0.5 if causal else 1.0) * (2.5 if pass_ == "bwd" else 1.0)
    info = dict(kernel="attention_hopper", shape=f"T={T} {B}x{H}x{D}", dtype="bf16", causal=causal, pass_=pass_)
    if impl == "torch_cudnn":
        torch = _torch()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def fwd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return sdpa(q, k, v, is_causal=causal)

        if pass_ == "fwd":
            fn = fwd
        else:
            o = fwd()
            g = torch.randn_like(o)
            fn = lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True)  # noqa: E731
        _run(benchmark, "torch", fn, dict(info, impl_detail=impl), flops=flops)
        return
    from blutensor.ext import flash_attention_backward, flash_attention_forward

    cp = _cupy()
    if impl == "blutrain_wgmma" and cp.cuda.Device().compute_capability != "90":
        pytest.skip("the wgmma kernels need an sm_90 GPU")
    variant = "bf16_wgmma" if impl == "blutrain_wgmma" else "bf16"
    q, k, v = (_dev(cp, (B * H, T, D), "bf16") for _ in range(3))
    if pass_ == "fwd":
        fn = lambda: flash_attention_forward(q, k, v, causal, None, variant)  # noqa: E731
    else:
        o, lse = flash_attention_forward(q, k, v, causal, None, variant)
        do = _dev(cp, (B * H, T, D), "bf16")
        fn = lambda: flash_attention_backward(q, k, v, o, lse, do, causal, None, variant)  # noqa: E731
    _run(benchmark, "blutrain", fn, dict(info, impl_detail=impl), flops=flops)
