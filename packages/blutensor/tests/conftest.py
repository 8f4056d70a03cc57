"""Shared fixtures and checks for blutensor's tests.

- ``device``: 'cpu' always, 'cuda' (marked ``cuda``) only when ``bt.cuda.is_available()``.
- :func:`gradcheck`: analytic gradients vs float64 central finite differences.
- :func:`check_vs_torch`: forward values and gradients vs PyTorch CPU (float64).
"""

from __future__ import annotations

import blutensor as bt
import numpy as np
import pytest

HAS_CUDA = bt.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not HAS_CUDA, reason="needs CuPy and a CUDA GPU")])]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """Every device test runs on 'cpu', and on 'cuda' where a GPU is present."""
    return request.param


@pytest.fixture(autouse=True)
def _seeded():
    """Each test starts from the same default Philox stream and with grad mode on."""
    bt.manual_seed(0)
    prev = bt.is_grad_enabled()
    bt.set_grad_enabled(True)
    yield
    bt.set_grad_enabled(prev)
    bt.policy.reset_defaults()  # a setter or env change of one test does not reach the next


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def host(t) -> np.ndarray:
    """A tensor's values as a NumPy float64 (or original integer) array."""
    a = t.numpy() if isinstance(t, bt.Tensor) else np.asarray(t)
    return a.astype(np.float64) if a.dtype.kind == "f" or a.dtype.name == "bfloat16" else a


def bt_inputs(arrays, device, dtype=bt.float64, requires_grad=True):
    """blutensor tensors on ``device`` from NumPy arrays (floating ones require grad)."""
    out = []
    for a in arrays:
        a = np.asarray(a)
        if a.dtype.kind == "f":
            out.append(bt.tensor(a, dtype=dtype, device=device, requires_grad=requires_grad))
        else:
            out.append(bt.tensor(a, device=device))
    return out


def _weights(shape, seed=1234):
    return np.random.default_rng(seed).standard_normal(shape)


def _scalarize(out, w):
    """sum(out * w) as a scalar blutensor loss (w a fixed random projection)."""
    return (out * bt.tensor(w, dtype=out.dtype, device=out.device)).sum()


def gradcheck(fn, arrays, device="cpu", eps: float = 1e-6, rtol: float = 1e-5, atol: float = 1e-7,
              skip=()):
    """Check d sum(fn(*x) * w)/dx against central finite differences in float64.

    ``arrays`` are NumPy arrays (float ones are differentiated, integer ones passed as index
    tensors); ``skip`` lists input positions not to check. Returns the analytic gradients.
    """
    ts = bt_inputs(arrays, device)
    out = fn(*ts)
    w = _weights(tuple(out.shape))
    _scalarize(out, w).backward()
    grads = [t.grad for t in ts]
    for i, a in enumerate(arrays):
        a = np.asarray(a)
        if a.dtype.kind != "f" or i in skip:
            continue
        assert grads[i] is not None, f"input {i} got no gradient"
        num = np.zeros(a.shape)
        flat = a.astype(np.float64).reshape(-1)
        for j in range(flat.size):
            vals = []
            for s in (+1, -1):
                pert = flat.copy()
                pert[j] += s * eps
                args = [bt.tensor(pert.reshape(a.shape), dtype=bt.float64, device=device) if k == i else
                        t.detach() for k, t in enumerate(ts)]
                with bt.no_grad():
                    vals.append(float((host(fn(*args)) * w).sum()))
            num.reshape(-1)[j] = (vals[0] - vals[1]) / (2 * eps)
        np.testing.assert_allclose(host(grads[i]), num, rtol=rtol, atol=atol,
                                   err_msg=f"gradient of input {i} vs finite differences")
    return grads


def check_vs_torch(bt_fn, torch_fn, arrays, device="cpu", rtol: float = 1e-7, atol: float = 1e-9):
    """Forward values and gradients of ``bt_fn`` vs ``torch_fn`` (PyTorch CPU), both in float64."""
    torch = pytest.importorskip("torch")
    ts = bt_inputs(arrays, device)
    tt = [torch.tensor(np.asarray(a), dtype=torch.float64, requires_grad=True) if np.asarray(a).dtype.kind == "f"
          else torch.tensor(np.asarray(a)) for a in arrays]
    out = bt_fn(*ts)
    ref = torch_fn(*tt)
    np.testing.assert_allclose(host(out), ref.detach().numpy(), rtol=rtol, atol=atol, err_msg="forward vs torch")
    w = _weights(tuple(out.shape))
    _scalarize(out, w).backward()
    (ref * torch.tensor(w)).sum().backward()
    for i, (a, b) in enumerate(zip(ts, tt)):
        if b.grad is None:
            continue
        np.testing.assert_allclose(host(a.grad), b.grad.numpy(), rtol=rtol, atol=atol,
                                   err_msg=f"gradient of input {i} vs torch")
    return out


def check_forward(bt_fn, np_fn, arrays, device="cpu", dtype=bt.float64, rtol: float = 1e-10, atol: float = 1e-12):
    """Forward of ``bt_fn`` on ``device`` vs a NumPy float64 reference ``np_fn``."""
    ts = bt_inputs(arrays, device, dtype=dtype, requires_grad=False)
    out = bt_fn(*ts)
    ref = np_fn(*[np.asarray(a) for a in arrays])
    np.testing.assert_allclose(host(out), np.asarray(ref, dtype=np.float64) if np.asarray(ref).dtype.kind == "f"
                               else ref, rtol=rtol, atol=atol)
    return out
