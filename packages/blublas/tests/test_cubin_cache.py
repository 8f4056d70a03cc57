"""Cached arch-specific cubins (BLUBLAS_CACHE_DIR/kernels) are checked with blutensor's kernel-cache checks, which
the plugin host hands to blublas: a damaged cubin is rebuilt (a warning names it), a shared directory is not used,
and blublas alone (no plugin host) builds into a private directory. The NVRTC call is replaced by a recorder (no
GPU here); everything around it is the real code."""

import os

import pytest
from blublas import loader

kc = pytest.importorskip("blutensor.ext").kernel_cache  # the checks blutensor hands to plugins


@pytest.fixture
def fake_nvrtc(monkeypatch, tmp_path):
    calls = []

    def compile_(src, filename, arch):
        calls.append((filename, arch))
        return b"\x7fELF cubin of " + filename.encode() + b" " + bytes(64), "12.0"

    monkeypatch.setattr(loader, "_nvrtc_cubin_cupy", compile_)
    monkeypatch.setattr(loader, "_source", lambda filename: f"// source of {filename}\n")
    monkeypatch.setenv("BLUBLAS_CACHE_DIR", str(tmp_path / "blublas"))
    monkeypatch.setattr(loader, "_kernel_cache", None)
    monkeypatch.setattr(loader, "_private_dir", None)
    return calls


def test_plugin_host_hands_blublas_the_checks(monkeypatch):
    from blutensor.ext import reset_host

    monkeypatch.setattr(loader, "_kernel_cache", None)
    reset_host()
    assert loader._kernel_cache is kc


def test_damaged_cubin_is_rebuilt(fake_nvrtc, tmp_path):
    loader.use_kernel_cache(kc)
    out = loader._cubin_with_nvrtc("gemm_wgmma_bf16.cu", "90a")
    assert out.parent == tmp_path / "blublas" / "kernels" and kc.verified(out)
    assert loader._cubin_with_nvrtc("gemm_wgmma_bf16.cu", "90a") == out and len(fake_nvrtc) == 1  # loaded again
    raw = bytearray(out.read_bytes())
    raw[20] ^= 0x40
    out.write_bytes(bytes(raw))
    with pytest.warns(RuntimeWarning, match=rf"compiled kernel {out} does not match its SHA-256 record"):
        assert loader._cubin_with_nvrtc("gemm_wgmma_bf16.cu", "90a") == out
    assert len(fake_nvrtc) == 2 and kc.verified(out) and out.read_bytes().startswith(b"\x7fELF cubin of")


def test_shared_cache_directory_is_not_used(fake_nvrtc, tmp_path):
    loader.use_kernel_cache(kc)
    shared = tmp_path / "blublas" / "kernels"
    shared.mkdir(parents=True)
    os.chmod(shared, 0o777)
    with pytest.warns(RuntimeWarning, match=rf"not loading blublas cubins from the cache {shared}"):
        out = loader._cubin_with_nvrtc("transpose.cu", "90a")
    assert out.parent != shared and not list(shared.iterdir()) and kc.verified(out)


def test_blublas_alone_builds_privately(fake_nvrtc, tmp_path):
    a = loader._cubin_with_nvrtc("transpose.cu", "90a")
    b = loader._cubin_with_nvrtc("transpose.cu", "90a")
    assert a == b and a.parent != tmp_path / "blublas" / "kernels" and len(fake_nvrtc) == 2  # nothing trusted
    assert oct(os.stat(a.parent).st_mode & 0o777) == "0o700"
