"""bt.autocast (bf16 mixed precision): policy per op, parameter cast cache, nesting, errors, and a small GPT-2's
losses and gradients against PyTorch's autocast(bfloat16) on CPU (CUDA twins marked ``cuda``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import blutensor as bt
import blutensor.nn.functional as F
import numpy as np
import pytest
from blutensor.ops import dispatch
from conftest import HAS_CUDA, host, rng

ROOT = Path(__file__).resolve().parents[3]
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CuPy and a CUDA GPU")


def _params(dev, *shapes, seed=0):
    r = rng(seed)
    return [bt.nn.Parameter(bt.tensor(r.standard_normal(s).astype(np.float32) * 0.5, device=dev)) for s in shapes]


def _x(dev, *shape, seed=1):
    return bt.tensor(rng(seed).standard_normal(shape).astype(np.float32), device=dev)


# ---------------------------------------------------------------- policy


def test_linear_runs_bf16_and_grads_flow_to_fp32_masters(device):
    w, b = _params(device, (6, 8), (6,))
    x = _x(device, 4, 8)
    with bt.autocast(device):
        y = F.linear(x, w, b)
    assert y.dtype is bt.bfloat16
    y.float().sum().backward()
    assert w.grad.dtype is bt.float32 and b.grad.dtype is bt.float32 and w.dtype is bt.float32
    # reference: bf16-rounded operands, fp32 accumulation; dW = sum_rows(x_bf16) (grad of ones)
    xb = host(x.to(bt.bfloat16)).astype(np.float64)
    wb = host(w.to(bt.bfloat16)).astype(np.float64)
    ref = xb @ wb.T + host(b.to(bt.bfloat16))
    np.testing.assert_allclose(host(y), ref, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(host(w.grad), np.broadcast_to(xb.sum(0), (6, 8)), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(host(b.grad), np.full(6, 4.0), rtol=1e-2)


def test_matmul_bmm_sdpa_are_lowered(device):
    a, b = _x(device, 2, 3, 8, seed=2), _x(device, 2, 8, 5, seed=3)
    q = k = v = _x(device, 2, 2, 16, 64, seed=4)
    with bt.autocast(device):
        assert bt.matmul(a, b).dtype is bt.bfloat16
        assert bt.bmm(a, b).dtype is bt.bfloat16
        assert F.scaled_dot_product_attention(q, k, v, is_causal=True).dtype is bt.bfloat16
    ref = host(a.to(bt.bfloat16)).astype(np.float64) @ host(b.to(bt.bfloat16)).astype(np.float64)
    with bt.autocast(device):
        np.testing.assert_allclose(host(bt.bmm(a, b)), ref, rtol=1e-2, atol=2e-2)


def test_mixed_elementwise_promotes_to_fp32_and_follow_ops_keep_input_dtype(device):
    x16 = _x(device, 4, 8).to(bt.bfloat16)
    x32 = _x(device, 4, 8, seed=5)
    ln_w, ln_b = _params(device, (8,), (8,))
    with bt.autocast(device):
        assert (x16 + x32).dtype is bt.float32  # torch's promotion: the residual stream stays fp32
        assert (x32 * x16).dtype is bt.float32
        assert F.layer_norm(x32, (8,), ln_w, ln_b).dtype is bt.float32
        y = F.layer_norm(x16, (8,), ln_w, ln_b)  # bf16 activation: the fp32 weights are cast down
        assert y.dtype is bt.bfloat16
        assert F.gelu(x16, approximate="tanh").dtype is bt.bfloat16
        assert F.softmax(x32, -1).dtype is bt.float32
    y.float().sum().backward()
    assert ln_w.grad.dtype is bt.float32


def test_cross_entropy_of_bf16_logits_gives_fp32_loss(device):
    z = _x(device, 6, 40).to(bt.bfloat16)
    z.requires_grad = True
    t = bt.tensor(rng(7).integers(0, 40, 6), device=device)
    with bt.autocast(device):
        loss = F.cross_entropy(z, t)
    assert loss.dtype is bt.float32
    zz = host(z).astype(np.float64)
    lse = np.log(np.exp(zz - zz.max(1, keepdims=True)).sum(1)) + zz.max(1)
    ref = (lse - zz[np.arange(6), host(t)]).mean()
    assert abs(loss.item() - ref) < 1e-5  # fp32 loss from the bf16 values: no bf16 rounding of the loss
    loss.backward()
    assert z.grad.dtype is bt.bfloat16


def test_weight_cast_cache_hits_and_invalidation():
    (w,) = _params("cpu", (5, 4))
    x = _x("cpu", 3, 4)
    with bt.autocast("cpu"):
        F.linear(x, w)
        F.linear(x, w)  # same parameter: cast once
        assert bt.amp.cache_info() == {"entries": 1, "hits": 1, "misses": 1}
        with bt.no_grad():
            w.mul_(2.0)  # in-place update: the cached copy is stale
        y = F.linear(x, w)
        assert bt.amp.cache_info()["misses"] == 2
        np.testing.assert_allclose(host(y), host(x.to(bt.bfloat16)) @ host((w).to(bt.bfloat16)).T, rtol=1e-2)
        F.linear(x.detach(), x[:, :4].detach())  # non-parameters are never cached
        assert bt.amp.cache_info()["entries"] == 1
    assert bt.amp.cache_info()["entries"] == 0  # cleared when the outermost region exits


def test_cached_cast_made_under_no_grad_is_not_reused_with_grad():
    (w,) = _params("cpu", (5, 4))
    x = _x("cpu", 3, 4)
    with bt.autocast("cpu"):
        with bt.no_grad():
            y0 = F.linear(x, w)
        assert y0.grad_fn is None
        y = F.linear(x, w)
        assert y.requires_grad
        y.float().sum().backward()
    assert w.grad is not None and w.grad.dtype is bt.float32


def test_eval_no_grad_forward():
    lin = bt.nn.Linear(4, 3)
    lin.eval()
    with bt.no_grad(), bt.autocast("cpu"):
        y = lin(_x("cpu", 2, 4))
    assert y.dtype is bt.bfloat16 and not y.requires_grad


def test_nesting_disable_and_restore():
    (w,) = _params("cpu", (5, 4))
    x = _x("cpu", 3, 4)
    assert dispatch.autocast_hook is None  # off: no hook at all on the dispatch path
    with bt.autocast("cpu"):
        assert bt.is_autocast_enabled("cpu") and not bt.is_autocast_enabled("cuda")
        with bt.autocast("cpu", enabled=False):
            assert F.linear(x, w).dtype is bt.float32
            assert not bt.is_autocast_enabled("cpu")
            with bt.autocast("cpu"):
                assert F.linear(x, w).dtype is bt.bfloat16
        assert F.linear(x, w).dtype is bt.bfloat16
        assert bt.amp.cache_info()["entries"] == 1  # inner exits keep the outer region's cache
    assert dispatch.autocast_hook is None and not bt.is_autocast_enabled("cpu")
    assert F.linear(x, w).dtype is bt.float32


def test_other_device_type_is_untouched():
    (w,) = _params("cpu", (5, 4))
    with bt.autocast("cuda"):  # no GPU needed: only cuda tensors would be affected
        assert F.linear(_x("cpu", 3, 4), w).dtype is bt.float32


def test_decorator_and_exception_exit():
    @bt.autocast("cpu")
    def f(x, w):
        return F.linear(x, w)

    (w,) = _params("cpu", (5, 4))
    assert f(_x("cpu", 3, 4), w).dtype is bt.bfloat16
    with pytest.raises(RuntimeError), bt.autocast("cpu"):
        raise RuntimeError("boom")
    assert dispatch.autocast_hook is None and bt.amp.cache_info()["entries"] == 0


def test_bad_arguments_are_clear_errors():
    with pytest.raises(bt.DTypeError, match="bfloat16.*float16"):
        bt.autocast("cpu", dtype=bt.float16)
    with pytest.raises(bt.DTypeError, match="float32"):
        bt.autocast("cuda", dtype=bt.float32)
    with pytest.raises(ValueError, match="device_type"):
        bt.autocast("tpu")


# ---------------------------------------------------------------- GPT-2 vs torch.autocast


def _gpt2_pair(device):
    pytest.importorskip("torch")
    pytest.importorskip("blumodels")
    ref = ROOT / "benchmarks" / "torch_gpt2.py"
    if not ref.exists():
        pytest.skip("benchmarks/torch_gpt2.py is not in this checkout")
    spec = importlib.util.spec_from_file_location("torch_gpt2_amp_ref", ref)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    from blumodels.config import ModelConfig
    from blumodels.gpt2 import build_model

    cfg = ModelConfig(n_layer=2, n_head=2, d_model=128, block_size=32, vocab_size=200)
    ours = build_model(cfg, device="cpu", seed=0)
    theirs = mod.from_blutrain(ours, device="cpu")
    if device != "cpu":
        ours.to(device)
    return ours, theirs, mod


def _named_grads(ours, mod):
    out = {}
    for name, p in ours.named_parameters():
        for a, b in mod._RENAME.items():
            name = name.replace(a, b)
        out[name] = p
    return out


def test_gpt2_bf16_autocast_matches_torch(device):
    import torch

    ours, theirs, mod = _gpt2_pair(device)
    r = rng(11)
    x, y = r.integers(0, 200, (2, 32)), r.integers(0, 200, (2, 32))
    with bt.autocast(device):
        _, loss = ours(bt.tensor(x, device=device), bt.tensor(y, device=device))
    assert loss.dtype is bt.float32
    loss.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tl = theirs(torch.from_numpy(x), torch.from_numpy(y))
    tl.backward()
    with torch.no_grad():
        t32 = float(theirs(torch.from_numpy(x), torch.from_numpy(y)))
    tol = 2e-2 if device == "cpu" else 3e-2
    assert abs(loss.item() - tl.item()) < tol * 0.25
    mine = _named_grads(ours, mod)
    worst = 0.0
    for name, tp in theirs.named_parameters():
        p = mine[name]
        assert p.dtype is bt.float32 and p.grad.dtype is bt.float32, name
        g, tg = host(p.grad), tp.grad.double().numpy()
        rel = np.abs(g - tg).max() / np.abs(tg).max()
        worst = max(worst, rel)
        assert rel < tol, (name, rel)
    print(f"loss ours {loss.item():.6f} torch-bf16 {tl.item():.6f} fp32 {t32:.6f}; worst grad rel diff {worst:.2e}")
    assert worst > 1e-5 or abs(loss.item() - t32) > 0  # bf16 arithmetic happened (not an fp32 run)


# ---------------------------------------------------------------- CUDA kernels of the bf16 path


@pytest.mark.cuda
@needs_gpu
def test_cuda_cast_kernel_matches_reference_rounding():
    import cupy
    from blutensor.backends import f32_to_bf16_bits
    from blutensor.backends.cupy.cast import to_bf16, to_f32

    v = rng(3).standard_normal(1000 * 8 + 5).astype(np.float32) * 100
    v[:4] = [np.inf, -np.inf, 0.0, -0.0]
    x = cupy.asarray(v)
    bits = to_bf16(x)
    ref = cupy.asarray(f32_to_bf16_bits(v, np))  # the NumPy integer-op path
    assert bool((bits == ref).all())
    assert bool((to_f32(bits) == (ref.astype(cupy.uint32) << 16).view(cupy.float32)).all())
    assert bool((to_bf16(x[1:]) == ref[1:]).all())  # unaligned start: scalar path


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("bias", [True, False])
def test_cuda_bf16_linear_matches_widened_generic(bias):
    w, b = _params("cuda", (96, 64), (96,))
    x = _x("cuda", 3, 40, 64)
    with bt.autocast("cuda"):
        y = F.linear(x, w, b if bias else None)
    assert y.dtype is bt.bfloat16
    g = _x("cuda", 3, 40, 96, seed=9)
    (y.float() * g).sum().backward()
    xb, wb = host(x.to(bt.bfloat16)), host(w.to(bt.bfloat16))
    ref = xb @ wb.T + (host(b.to(bt.bfloat16)) if bias else 0)
    np.testing.assert_allclose(host(y), ref, rtol=2e-2, atol=3e-2)
    gb = host(g.to(bt.bfloat16)).reshape(-1, 96)
    np.testing.assert_allclose(host(w.grad), gb.T @ xb.reshape(-1, 64), rtol=2e-2, atol=0.3)
    if bias:
        np.testing.assert_allclose(host(b.grad), gb.sum(0), rtol=2e-2, atol=0.1)


# ---------------------------------------------------------------- CPU twins of the CUDA bf16 GEMM classes


@pytest.fixture
def numpy_as_cupy(monkeypatch):
    """Run backends.cupy.linalg's classes on NumPy bf16 bits (uint16) through a registered provider that declares bf16
    and takes host arrays (a NumPy reference, found by its HOST_ARRAYS capability)."""
    from blutensor import ext
    from blutensor.backends import f32_to_bf16_bits
    from blutensor.backends.cupy import cast, linalg

    host = [p for p in ext.gemm_providers() if "bf16" in getattr(p, "PRECISIONS", ()) and getattr(p, "HOST_ARRAYS",
                                                                                                   False)]
    if not host:
        pytest.skip("no installed GEMM provider declares bf16 on host arrays")
    monkeypatch.setattr(linalg, "cupy", lambda: np)
    monkeypatch.setattr(linalg, "bf16_provider", lambda: host[0])
    monkeypatch.setattr(cast, "to_bf16", lambda a: f32_to_bf16_bits(a, np))
    monkeypatch.setattr(linalg, "_ones_bf16", lambda n: np.full((1, n), 0x3F80, dtype=np.uint16))
    return linalg


class _Ctx:
    out_dtype = None

    def __init__(self, needs):
        self.needs = needs


def _bits(a):
    from blutensor.backends import f32_to_bf16_bits

    return f32_to_bf16_bits(np.ascontiguousarray(a, dtype=np.float32), np)


def _val(bits):
    from blutensor.backends import bf16_bits_to_f32

    return bf16_bits_to_f32(np.asarray(bits), np).astype(np.float64)


@pytest.mark.parametrize("bias", [True, False])
def test_linear_bf16_class_on_numpy_bits(numpy_as_cupy, bias):
    r = rng(5)
    x, w, b, g = (_bits(r.standard_normal(s)) for s in ((2, 7, 16), (12, 16), (12,), (2, 7, 12)))
    ctx = _Ctx((True, True, bias))
    y = numpy_as_cupy.LinearCuda.forward(ctx, x, w, b if bias else None)
    assert y.dtype == np.uint16 and y.shape == (2, 7, 12)
    ref = _val(x) @ _val(w).T + (_val(b) if bias else 0)
    np.testing.assert_allclose(_val(y), ref, rtol=1e-2, atol=2e-2)
    gx, gw, gb = numpy_as_cupy.LinearCuda.backward(ctx, g)
    g2, x2 = _val(g).reshape(-1, 12), _val(x).reshape(-1, 16)
    np.testing.assert_allclose(_val(gx), (g2 @ _val(w)).reshape(2, 7, 16), rtol=1e-2, atol=3e-2)
    np.testing.assert_allclose(_val(gw), g2.T @ x2, rtol=1e-2, atol=3e-2)
    if bias:
        np.testing.assert_allclose(_val(gb), g2.sum(0), rtol=1e-2, atol=3e-2)
    else:
        assert gb is None


@pytest.mark.parametrize("shapes", [((3, 5, 8), (8, 6)), ((2, 3, 5, 8), (2, 3, 8, 6)), ((1, 5, 8), (1, 8, 6))])
def test_matmul_bf16_class_on_numpy_bits(numpy_as_cupy, shapes):
    r = rng(6)
    a, b = _bits(r.standard_normal(shapes[0])), _bits(r.standard_normal(shapes[1]))
    ctx = _Ctx((True, True))
    y = numpy_as_cupy.MatmulCuda.forward(ctx, a, b)
    ref = _val(a) @ _val(b)
    np.testing.assert_allclose(_val(y), ref, rtol=1e-2, atol=3e-2)
    g = _bits(r.standard_normal(ref.shape))
    ga, gb = numpy_as_cupy.MatmulCuda.backward(ctx, g)
    ga_ref = _val(g) @ np.swapaxes(_val(b), -1, -2)
    gb_ref = np.swapaxes(_val(a), -1, -2) @ _val(g)
    if len(shapes[1]) == 2:
        gb_ref = gb_ref.sum(0)
    np.testing.assert_allclose(_val(ga), ga_ref, rtol=1e-2, atol=3e-2)
    np.testing.assert_allclose(_val(gb), gb_ref, rtol=1e-2, atol=5e-2)


def test_bmm_bf16_class_on_numpy_bits(numpy_as_cupy):
    r = rng(8)
    a, b, g = (_bits(r.standard_normal(s)) for s in ((4, 5, 8), (4, 8, 6), (4, 5, 6)))
    ctx = _Ctx((True, True))
    y = numpy_as_cupy.BmmCuda.forward(ctx, a, b)
    np.testing.assert_allclose(_val(y), _val(a) @ _val(b), rtol=1e-2, atol=3e-2)
    ga, gb = numpy_as_cupy.BmmCuda.backward(ctx, g)
    np.testing.assert_allclose(_val(ga), _val(g) @ np.swapaxes(_val(b), 1, 2), rtol=1e-2, atol=3e-2)
    np.testing.assert_allclose(_val(gb), np.swapaxes(_val(a), 1, 2) @ _val(g), rtol=1e-2, atol=3e-2)
