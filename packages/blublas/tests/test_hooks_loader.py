"""Plugin registration, providers on CPU, and the kernel source loader (no GPU needed)."""

from __future__ import annotations

import blublas
import numpy as np
import pluggy
import pytest
from blublas import hooks, loader


def test_hook_registers_two_gemm_providers():
    pm = pluggy.PluginManager("blutrain")
    pm.register(hooks)
    (classes,) = pm.hook.blutrain_register_gemm_providers()
    assert [c.PLUGIN_NAME for c in classes] == ["blublas", "cublas"]
    for c in classes:
        assert callable(c.is_available) and callable(c.matmul)


def test_entry_point_points_at_hooks():
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="blutrain") if ep.name == "blublas"]
    assert eps and eps[0].value == "blublas.hooks"


@pytest.mark.parametrize("provider", [hooks.BluBLASProvider, hooks.CuBLASProvider])
def test_provider_matmul_on_numpy(provider):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((6, 5)).astype(np.float32)
    w = rng.standard_normal((4, 5)).astype(np.float32)
    bias = rng.standard_normal(4).astype(np.float32)
    out = provider.matmul(
        a,
        w,
        trans_a=False,
        trans_b=True,
        out=None,
        alpha=1.0,
        beta=0.0,
        bias=bias,
        epilogue="none",
        precision="fp32",
    )
    np.testing.assert_allclose(out, a.astype(np.float64) @ w.T + bias, rtol=1e-5, atol=1e-5)
    out3 = provider.matmul(np.stack([a, a]), w, trans_b=True, precision="fp32")
    assert out3.shape == (2, 6, 4)


def test_blublas_does_not_import_blutensor():
    import subprocess
    import sys

    code = (
        "import sys, blublas, blublas.hooks, blublas.api, blublas.launch, blublas.cublas, blublas.autotune; "
        "assert 'blutensor' not in sys.modules, 'blutensor imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cublas_provider_unavailable_without_gpu():
    try:
        import cupy

        has_gpu = cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        has_gpu = False
    if not has_gpu:
        assert hooks.CuBLASProvider.is_available() is False
        assert hooks.BluBLASProvider.cuda_available() is False
    assert hooks.BluBLASProvider.is_available() is True


def test_expand_source_inlines_local_headers_once():
    src = loader.expand_source(loader.KERNEL_DIR / "gemm_mma_bf16.cu")
    assert '#include "gemm_common.cuh"' not in src
    assert src.count("struct BluEpi {") == 1
    assert "blu_gemm_bf16_" in src


def test_missing_header_is_reported_with_file_name(tmp_path):
    f = tmp_path / "k.cu"
    f.write_text('#include "nope.cuh"\n')
    with pytest.raises(FileNotFoundError, match="k.cu: included file 'nope.cuh' not found"):
        loader.expand_source(f)


def test_public_api_exports():
    assert blublas.gemm and blublas.gemm_batched and issubclass(blublas.GemmError, ValueError)
