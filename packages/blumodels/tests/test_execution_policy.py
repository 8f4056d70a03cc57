"""The Trainer builds ONE execution policy from the [train] table (blumodels.execution.policy_from_config) and runs
its set-up and methods inside it; the process outside a Trainer call is left as it was."""

from __future__ import annotations

import blutensor as bt
import pytest
from blumodels.execution import policy_from_config
from blumodels.trainer import Trainer
from blutensor import ext
from models_helpers import micro_config


@pytest.fixture(autouse=True)
def _fresh_policy():
    bt.policy.reset_defaults()
    yield
    bt.policy.reset_defaults()


def test_policy_fields_come_from_the_config():
    t = micro_config(precision="bf16", fp32_gemm="3xtf32", deterministic=True).train
    p = policy_from_config(t, "cpu")
    assert (p.precision, p.fp32_gemm, p.deterministic, p.gemm) == ("bf16", "3xtf32", True, "auto")
    assert p == bt.ExecutionPolicy(precision="bf16", fp32_gemm="3xtf32", deterministic=True)
    with bt.policy.scope(attention_backward="split", validate_indices="sync"):  # the rest: the enclosing policy
        q = policy_from_config(t, "cpu")
    assert (q.attention_backward, q.validate_indices, q.precision) == ("split", "sync", "bf16")
    assert policy_from_config(micro_config().train, "cpu") == bt.ExecutionPolicy()


def test_trainer_runs_its_steps_under_the_config_policy(tmp_path):
    """Every op of a training step and of an evaluation sees the run's policy (deterministic, bf16 with autocast
    on); before and after the Trainer's calls the process default is unchanged."""
    seen = []

    def observer(op, inputs, attrs, run):
        pol = ext.current_policy()
        seen.append((op, pol.deterministic, pol.precision, ext.autocast_active()))
        return run()

    tr = Trainer(micro_config(steps=2, precision="bf16", deterministic=True, eval_interval=0), tmp_path / "run",
                 quiet=True)
    try:
        assert tr.policy == bt.ExecutionPolicy(precision="bf16", deterministic=True)
        assert bt.policy.current() == bt.ExecutionPolicy()
        ext.add_op_observer(observer)
        try:
            rec = tr.train_step()
            n_step = len(seen)
            tr.evaluate(1)
        finally:
            ext.remove_op_observer(observer)
        assert rec["step"] == 0 and n_step > 20 and len(seen) > n_step
        assert all(s[1:3] == (True, "bf16") for s in seen)
        assert any(s[0] == "linear" and s[3] for s in seen)  # bf16 autocast around the forward
        assert not bt.are_deterministic_algorithms_enabled() and bt.get_matmul_precision() == "fp32"
    finally:
        tr.close()
