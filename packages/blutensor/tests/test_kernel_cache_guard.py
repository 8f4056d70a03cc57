"""Compiled kernels are never loaded from a kernel cache another user can write (CPU: the check alone)."""

import os
import sys
from pathlib import Path

import pytest
from blutensor.backends.cupy import _loader

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "testing"))
import fake_cuda  # noqa: E402


def test_private_cache_is_used(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    (d / "abc.cubin").write_bytes(b"x")
    os.chmod(d / "abc.cubin", 0o600)
    assert _loader.kernel_cache_problem(d) is None
    assert _loader.kernel_cache_problem(tmp_path / "missing") is None  # CuPy creates it, privately


@pytest.mark.parametrize("how", ["world_writable_dir", "group_writable_file", "symlink_dir", "symlink_file"])
def test_shared_or_tampered_cache_is_refused(tmp_path, monkeypatch, how):
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    os.chmod(d, 0o700)
    f = d / "abc.cubin"
    f.write_bytes(b"planted")
    os.chmod(f, 0o600)
    if how == "world_writable_dir":
        os.chmod(d, 0o777)
    elif how == "group_writable_file":
        os.chmod(f, 0o620)
    elif how == "symlink_file":
        f.unlink()
        f.symlink_to(tmp_path / "elsewhere.cubin")
    else:
        (tmp_path / "link").symlink_to(d)
        d = tmp_path / "link"
    why = _loader.kernel_cache_problem(d)
    assert why is not None and str(tmp_path) in why
    monkeypatch.setenv("CUPY_CACHE_DIR", str(d))
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY", raising=False)
    monkeypatch.setattr(_loader, "_cache_checked", {})
    with pytest.warns(RuntimeWarning, match="not loading compiled CUDA kernels from the shared cache"):
        assert _loader.guard_kernel_cache() is False
    assert os.environ["CUPY_CACHE_IN_MEMORY"] == "1"  # CuPy then compiles in memory, loads nothing from there


def test_module_checks_the_cache_before_compiling(tmp_path, monkeypatch):
    """The guard runs before CuPy's RawModule (a fake CuPy records the order)."""
    order = []
    cp = fake_cuda.make_cupy()  # the shared fake device
    fake_module = cp.RawModule

    def raw_module(*a, **k):
        order.append(("compile", os.environ.get("CUPY_CACHE_IN_MEMORY")))
        return fake_module(*a, **k)

    cp.RawModule = raw_module
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o777)
    monkeypatch.setenv("CUPY_CACHE_DIR", str(d))
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY", raising=False)
    monkeypatch.setattr(_loader, "_cache_checked", {})
    monkeypatch.setattr(_loader, "_modules", {})
    monkeypatch.setattr(_loader, "cupy", lambda: cp)
    name = sorted(p.name for p in _loader.KERNEL_DIR.glob("*.cu"))[0]
    with pytest.warns(RuntimeWarning):
        _loader.module(name)
    assert order == [("compile", "1")] and len(cp.device.modules) == 1
