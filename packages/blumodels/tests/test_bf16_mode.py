"""train.precision = 'bf16': bt.autocast around forward + loss, float32 master weights and AdamW state (CPU twin
of the CUDA bf16 step; on the GPU: blutensor's test_bf16_cuda.py for the kernels and
`benchmarks/e2e_gpt2.py` with `--precision bf16` against PyTorch's bf16 autocast)."""

from __future__ import annotations

import blutensor as bt
import numpy as np
import pytest
from blumodels.trainer import Trainer
from models_helpers import micro_config


def _run(tmp_path, precision, steps=4, spy=None):
    tr = Trainer(micro_config(steps=steps, precision=precision, eval_interval=100, checkpoint_interval=100),
                 tmp_path / precision, quiet=True)
    recs = []
    for _ in range(steps):
        if spy is not None:
            spy.clear()
        recs.append(tr.train_step())
        tr.step += 1
    return tr, recs


@pytest.fixture
def linear_dtypes():
    """Records the dtypes of every linear call (an observer on dispatch)."""
    from blutensor import ext

    seen: list = []

    def obs(op, inputs, attrs, run):
        if op == "linear":
            seen.append(tuple(x.dtype for x in inputs if isinstance(x, bt.Tensor)))
        return run()

    ext.add_op_observer(obs)
    yield seen
    ext.remove_op_observer(obs)


def test_bf16_trains_in_bf16_with_fp32_masters(tmp_path, linear_dtypes):
    tr, recs = _run(tmp_path, "bf16", spy=linear_dtypes)
    # the forward's GEMMs ran in bf16 (inputs, weights and biases)
    assert linear_dtypes and all(all(d is bt.bfloat16 for d in dts) for dts in linear_dtypes)
    # master weights, grads (before zero_grad: checked through the optimizer state) and AdamW moments stay fp32
    for p in tr.model.parameters():
        assert p.dtype is bt.float32
    st = tr.optimizer.state
    assert st and all(v.dtype is bt.float32 for s in st.values() for v in s.values() if isinstance(v, bt.Tensor))
    assert all(np.isfinite(r["loss"]) for r in recs)
    assert not bt.is_autocast_enabled("cpu")  # the region closed


def test_bf16_loss_tracks_fp32(tmp_path):
    _, r16 = _run(tmp_path, "bf16")
    _, r32 = _run(tmp_path, "fp32")
    l16 = np.array([r["loss"] for r in r16])
    l32 = np.array([r["loss"] for r in r32])
    assert np.abs(l16 - l32).max() < 2e-2, (l16, l32)
    assert np.abs(l16 - l32).max() > 0  # bf16 really changed the arithmetic
    assert l16[-1] < l16[0]  # and it learns


def test_bf16_evaluate_runs_under_no_grad(tmp_path, linear_dtypes):
    tr = Trainer(micro_config(steps=1, precision="bf16"), tmp_path, quiet=True)
    v = tr.evaluate(1)
    assert np.isfinite(v)
    assert linear_dtypes and all(dts[0] is bt.bfloat16 for dts in linear_dtypes)
    assert all(p.grad is None for p in tr.model.parameters())


def test_fp32_has_no_autocast(tmp_path, linear_dtypes):
    _run(tmp_path, "fp32", steps=1, spy=linear_dtypes)
    assert linear_dtypes and all(all(d is bt.float32 for d in dts) for dts in linear_dtypes)


def test_bf16_with_activation_checkpointing_is_exact(tmp_path):
    """The recompute in backward replays the block under the forward's autocast settings (bf16), so gradients
    and losses equal the plain bf16 run bit for bit."""
    _, plain = _run(tmp_path / "a", "bf16", steps=3)
    tr = Trainer(micro_config(steps=3, precision="bf16", activation_checkpointing=True, eval_interval=100,
                              checkpoint_interval=100), tmp_path / "b", quiet=True)
    ckpt = []
    for _ in range(3):
        ckpt.append(tr.train_step())
        tr.step += 1
    assert [r["loss"] for r in ckpt] == [r["loss"] for r in plain]
    assert [r["grad_norm"] for r in ckpt] == [r["grad_norm"] for r in plain]
