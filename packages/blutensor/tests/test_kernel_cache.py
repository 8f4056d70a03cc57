"""blutensor.kernel_cache: a compiled kernel is loaded from an on-disk cache only from a private directory and when
it matches the SHA-256 recorded when it was stored; a damaged one is removed (a warning names it) and rebuilt."""

import os
import warnings

import blutensor as bt
import numpy as np
import pytest
from blutensor import kernel_cache as kc
from blutensor.backends.numpy import _build


def test_store_verify_and_damage(tmp_path):
    p = tmp_path / "k.cubin"
    kc.store(p, b"\x7fELF" + bytes(range(200)))
    assert kc.verified(p) and kc.digest_path(p).name == "k.cubin.sha256"
    assert oct(os.stat(p).st_mode & 0o777) == "0o600"
    for damage in ("flip", "truncate"):
        kc.store(p, b"\x7fELF" + bytes(range(200)))
        raw = bytearray(p.read_bytes())
        if damage == "flip":
            raw[100] ^= 1
            p.write_bytes(bytes(raw))
        else:
            p.write_bytes(bytes(raw[:50]))
        with pytest.warns(RuntimeWarning, match=rf"compiled kernel {p} does not match its SHA-256 record"):
            assert kc.verified(p) is False
        assert not p.exists() and not kc.digest_path(p).exists()  # removed: the caller builds it again
    p.write_bytes(b"from before records")  # no record: rebuilt, without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kc.verified(p) is False and kc.verified(tmp_path / "absent.so") is False
    kc.store(p, b"abc")
    p.write_bytes(b"abd")
    with pytest.raises(kc.KernelCacheError, match=rf"compiled kernel {p} does not match its SHA-256 record right "
                                                  "after it was built"):
        kc.check_stored(p)


def test_shared_directory_is_replaced_by_a_private_one(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o777)
    (d / "planted.so").write_bytes(b"x")
    with pytest.warns(RuntimeWarning, match=rf"not loading test kernels from the cache {d}: {d} is writable by other "
                                            "users"):
        alt = kc.safe_directory(d, "test kernels")
    assert alt != d and oct(os.stat(alt).st_mode & 0o777) == "0o700" and not list(alt.iterdir())
    assert kc.safe_directory(d, "test kernels") == alt  # the same one for the rest of the process, one warning
    ok = tmp_path / "mine"
    assert kc.safe_directory(ok) == ok and ok.is_dir() and oct(os.stat(ok).st_mode & 0o777) == "0o700"


@pytest.fixture
def cpu_cache(tmp_path, monkeypatch):
    d = tmp_path / "cpu"
    monkeypatch.setenv("BLUTRAIN_CPU_CACHE", str(d))
    monkeypatch.delenv("BLUTRAIN_CPU_KERNELS", raising=False)
    _build.reset()
    yield d
    monkeypatch.undo()
    _build.reset()  # the next user loads the library of the default cache again


def _gelu_matches():
    x = np.linspace(-4, 4, 1001, dtype=np.float32)
    got = bt.nn.functional.gelu(bt.tensor(x), approximate="tanh").numpy().astype(np.float64)
    xd = x.astype(np.float64)
    want = 0.5 * xd * (1 + np.tanh(np.sqrt(2 / np.pi) * (xd + 0.044715 * xd ** 3)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # float32 rounding


@pytest.mark.skipif(_build._compiler() is None, reason="no C compiler")
def test_damaged_cpu_kernel_library_is_rebuilt(cpu_cache):
    cc = _build._compiler()
    so = _build.library_path(cc)
    _build._build(cc, so)  # what an earlier process left (built, recorded; not loaded here)
    assert so.parent == cpu_cache and kc.verified(so)
    raw = bytearray(so.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte in the machine code
    so.write_bytes(bytes(raw))
    with pytest.warns(RuntimeWarning, match=rf"compiled kernel {so} does not match its SHA-256 record"):
        assert _build.lib() is not None
    assert kc.verified(so) and _build.status()["build_s"] is not None  # built again, then loaded
    _gelu_matches()
