"""Activation checkpointing and the optimizer step fused into backward equal plain training exactly."""

import blutensor as bt
import numpy as np
import pytest
from blutensor import nn
from blutensor.errors import ArgumentError, DTypeError
from blutensor.nn import functional as F
from blutensor.utils import OptimizerInBackward, checkpoint


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d, dtype="float64")
        self.fc = nn.Linear(d, 4 * d, dtype="float64")
        self.proj = nn.Linear(4 * d, d, dtype="float64")

    def forward(self, x):
        return x + F.dropout(self.proj(F.gelu(self.fc(self.ln(x)), "tanh")), 0.2, self.training)


class Net(nn.Module):
    def __init__(self, ckpt):
        super().__init__()
        self.ckpt = ckpt
        self.blocks = nn.ModuleList([Block(8) for _ in range(3)])
        self.head = nn.Linear(8, 5, dtype="float64")

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x) if self.ckpt else b(x)
        return self.head(x)


def train(ckpt, oib, steps=4):
    bt.manual_seed(0)
    net = Net(ckpt)
    opt = bt.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    if oib:
        opt = OptimizerInBackward(opt)
    rng = np.random.default_rng(1)
    losses = []
    for _ in range(steps):
        x = bt.tensor(rng.standard_normal((6, 8)))
        t = bt.tensor(rng.integers(0, 5, 6))
        loss = F.cross_entropy(net(x), t)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.numpy().copy() for p in net.parameters()], opt


def test_checkpoint_is_bit_exact_with_dropout():
    a, b = train(False, False), train(True, False)
    assert a[0] == b[0]
    assert all((p == q).all() for p, q in zip(a[1], b[1]))


def test_optimizer_in_backward_is_bit_exact_and_frees_grads():
    a, c = train(False, False), train(False, True)
    assert a[0] == c[0]
    assert all((p == q).all() for p, q in zip(a[1], c[1]))
    opt = c[2]
    assert opt.updates == 4 * len(opt._groups)
    assert all(p.grad is None for g in opt.param_groups for p in g["params"])


def test_both_together():
    a, d = train(False, False), train(True, True)
    assert a[0] == d[0]


def test_checkpoint_keeps_no_activations():
    bt.manual_seed(0)
    blk = Block(8)
    x = bt.randn(4, 8, dtype="float64", requires_grad=True)
    y = checkpoint(blk, x)
    # the recorded graph holds one node for the whole block, whose inputs are the params and x
    assert y.grad_fn.op == "_Checkpoint"
    assert len([n for n in y.grad_fn.next if n is not None]) == len(list(blk.parameters())) + 1
    y.sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in blk.parameters())


def _adamw_f64(p, grads, lrs, b1=0.9, b2=0.999, eps=1e-8, wd=0.1):
    """NumPy float64 AdamW (PyTorch's update order) over the gradient sequence ``grads`` with lr ``lrs``."""
    x, m, v = p.astype(np.float64), np.zeros(p.shape), np.zeros(p.shape)
    for t, (g, lr) in enumerate(zip(grads, lrs), 1):
        x *= 1 - lr * wd
        m += (1 - b1) * (g - m)
        v = b2 * v + (1 - b2) * g * g
        x -= (lr / (1 - b1 ** t)) * m / (np.sqrt(v) / np.sqrt(1 - b2 ** t) + eps)
    return x


def _device_scalar_run(device, lr_dtype):
    """3 steps of loss = sum(w * c_t) with OIB reading lr and count from device arrays; returns w, grads, lrs."""
    rng = np.random.default_rng(4)
    w0 = rng.standard_normal((5, 7)).astype(np.float32)
    w = bt.nn.Parameter(bt.tensor(w0, device=device))
    opt = OptimizerInBackward(bt.optim.AdamW([w], lr=123.0, weight_decay=0.1))  # the host lr must not be used
    xp = np if device == "cpu" else __import__("cupy")
    lr, count = xp.zeros(1, dtype=lr_dtype), xp.zeros(1, dtype=np.float32)
    opt.set_device_scalars(lr=lr, step=count)
    lrs, grads = [1e-2, 3e-2, 2e-2], []
    for a in lrs:
        c = rng.standard_normal((5, 7)).astype(np.float32)
        lr[...] = a
        count += 1
        opt.optimizer.state.get(w, {})["step"] = 99  # nor the host count (created on the first update)
        (w * bt.tensor(c, device=device)).sum().backward()
        assert w.grad is None
        grads.append(c.astype(np.float64))
    lrs_seen = [float(np.float32(a)) if lr_dtype == np.float32 else a for a in lrs]
    return w0, w.numpy(), grads, lrs_seen


def test_optimizer_in_backward_device_scalars_equal_float64_adamw():
    for lr_dtype in (np.float64, np.float32):
        w0, got, grads, lrs = _device_scalar_run("cpu", lr_dtype)
        np.testing.assert_allclose(got, _adamw_f64(w0, grads, lrs), rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not bt.cuda.is_available(), reason="needs a CUDA GPU")
def test_optimizer_in_backward_device_scalars_on_cuda_equal_float64_adamw():
    w0, got, grads, lrs = _device_scalar_run("cuda", np.float32)
    np.testing.assert_allclose(got, _adamw_f64(w0, grads, lrs), rtol=1e-5, atol=1e-6)


def test_set_device_scalars_refuses_bad_input():
    w = bt.nn.Parameter(bt.zeros(3))
    one = np.zeros(1, np.float32)
    with pytest.raises(ArgumentError, match="only AdamW"):
        OptimizerInBackward(bt.optim.SGD([w], lr=0.1)).set_device_scalars(one, one)
    with pytest.raises(ArgumentError, match="amsgrad"):
        OptimizerInBackward(bt.optim.AdamW([w], amsgrad=True)).set_device_scalars(one, one)
    opt = OptimizerInBackward(bt.optim.AdamW([w]))
    with pytest.raises(DTypeError, match="step must be a 1-element float32"):
        opt.set_device_scalars(one, np.zeros(2, np.float32))
    with pytest.raises(DTypeError, match="lr must be a 1-element"):
        opt.set_device_scalars(np.zeros(1, np.int64), one)
    with pytest.raises(DTypeError, match="lr must be a 1-element"):
        opt.set_device_scalars(0.1, one)
