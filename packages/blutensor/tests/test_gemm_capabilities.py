"""GEMM providers are chosen by what they declare (PRECISIONS, CAPTURE_SAFE, is_available), never by name."""

from __future__ import annotations

import blutensor as bt
import pytest
from blutensor import ext


def _provider(name: str, precisions: tuple[str, ...], available: bool = True, capture_safe: bool = False) -> type:
    return type(name.replace("-", "_"), (), {
        "PLUGIN_NAME": name, "PRECISIONS": precisions, "CAPTURE_SAFE": capture_safe,
        "is_available": classmethod(lambda cls: available),
        "matmul": staticmethod(lambda a, b, **_: a @ b)})


@pytest.fixture
def host():
    from blutensor.backends.cupy import linalg

    h = ext.reset_host(autoload=False)
    linalg._provider_cache.clear()
    try:
        yield h
    finally:
        bt.set_gemm_provider(None)
        linalg._provider_cache.clear()
        ext.reset_host()


def _register(h, *provs):
    class Plugin:
        @ext.hookimpl
        def blutrain_register_gemm_providers(self):
            return list(provs)

    h.register(Plugin(), name="test-gemm-providers")


def test_bf16_gemms_go_to_the_first_available_provider_declaring_bf16(host):
    from blutensor.backends.cupy.linalg import bf16_provider

    strict = _provider("p-strict", ("fp32",))
    gone = _provider("p-gone", ("fp32", "bf16"), available=False)
    low = _provider("p-low", ("fp32", "tf32", "bf16"))
    _register(host, strict, gone, low)
    bt.set_gemm_provider("p-strict")
    assert bf16_provider() is low  # the selected one does not declare bf16; the unavailable one is skipped
    bt.set_gemm_provider("p-low")
    assert bf16_provider() is low
    assert bf16_provider() is low  # cached per selected provider


def test_without_a_bf16_provider_the_bf16_path_has_none(host):
    from blutensor.backends.cupy.linalg import bf16_provider

    _register(host, _provider("p-strict", ("fp32",)))
    bt.set_gemm_provider("p-strict")
    assert bf16_provider() is None  # the generic op on widened float32 runs instead
    assert ext.XpGemm.PRECISIONS == ("fp32",) and ext.XpGemm.CAPTURE_SAFE is False


def test_3xtf32_runs_only_on_providers_declaring_it(host, monkeypatch):
    from blutensor import gemm

    seen = []

    def provider(name, precisions):
        p = _provider(name, precisions)
        p.matmul = staticmethod(lambda a, b, precision="fp32", **_: seen.append((name, precision)) or a @ b)
        return p

    import numpy as np

    a = np.ones((2, 3), np.float32)
    b = np.ones((3, 2), np.float32)
    with bt.policy.scope(fp32_gemm="3xtf32"):
        for p in (provider("p-strict", ("fp32",)), provider("p-split", ("fp32", "3xtf32"))):
            gemm.provider_matmul(p, a, b, np)
    assert seen == [("p-strict", "fp32"), ("p-split", "3xtf32")]


def test_capture_safe_list_follows_the_declaration(host):
    safe = _provider("p-safe", ("fp32",), capture_safe=True)
    _register(host, safe, _provider("p-unsafe", ("fp32",)))
    assert ext.capture_safe_gemm_providers() == [safe]
    assert {p.PLUGIN_NAME for p in ext.gemm_providers()} >= {"p-safe", "p-unsafe", "xp"}
