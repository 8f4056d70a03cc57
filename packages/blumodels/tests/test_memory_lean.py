"""Memory-lean Trainer options: activation checkpointing and the optimizer step fused into backward give
the plain run's losses and weights exactly; incompatible settings are refused by the config."""

import json

import pytest
from blumodels.config import ConfigError
from blumodels.trainer import Trainer
from models_helpers import micro_config

LEAN = {"batch_tokens": 128, "grad_clip": 0.0}  # one micro-step per step, no clipping


def _run(tmp_path, name, **kw):
    cfg = micro_config(**{**LEAN, **kw})
    cfg.model.dropout = 0.1  # recomputation must replay the dropout masks exactly
    tr = Trainer(cfg, tmp_path / name, quiet=True)
    tr.fit()
    params = {n: p.numpy().copy() for n, p in tr.model.named_parameters()}
    tr.close()
    logs = [json.loads(x) for x in (tmp_path / name / "log.jsonl").read_text().splitlines()]
    return [r["loss"] for r in logs], params, logs


def test_lean_options_are_bit_exact(tmp_path):
    ref_losses, ref_params, _ = _run(tmp_path, "plain")
    for opts in ({"activation_checkpointing": True}, {"optimizer_in_backward": True},
                 {"activation_checkpointing": True, "optimizer_in_backward": True}):
        losses, params, logs = _run(tmp_path, "_".join(opts), **opts)
        assert losses == ref_losses, opts
        assert all((params[n] == ref_params[n]).all() for n in ref_params), opts
        if opts.get("optimizer_in_backward"):
            assert all(r["grad_norm"] is None for r in logs)  # gradients were freed as they were used


def test_lean_resume_is_bit_exact(tmp_path):
    opts = {"activation_checkpointing": True, "optimizer_in_backward": True, "checkpoint_interval": 4}
    ref, _, _ = _run(tmp_path, "ref", **opts)
    cfg = micro_config(**{**LEAN, **opts})
    cfg.model.dropout = 0.1
    a = Trainer(cfg, tmp_path / "cut", quiet=True)
    a.fit(steps=4)
    a.close()
    b = Trainer(cfg, tmp_path / "cut", resume=True, quiet=True)
    b.fit()
    b.close()
    logs = [json.loads(x) for x in (tmp_path / "cut" / "log.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in logs] == ref


@pytest.mark.parametrize("kw,msg", [
    ({"batch_tokens": 256, "grad_clip": 0.0}, r"incompatible with gradient accumulation \(grad_accum = 2\)"),
    ({"batch_tokens": 128, "grad_clip": 1.0}, r"incompatible with gradient clipping \(train.grad_clip = 1.0\)"),
    ({"batch_tokens": 128, "grad_clip": 0.0, "nan_policy": "skip"}, r"cannot honour train.nan_policy = 'skip'"),
])
def test_config_refuses_incompatible_settings(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        micro_config(optimizer_in_backward=True, **kw).validate()


def _step_peaks(tmp_path, name, steps=3, **kw):
    """Per step: the peak host memory during the step (tracemalloc sees every NumPy buffer: parameters, AdamW
    moments, gradients, gradients still waiting inside the engine, activations), on a model whose gradients
    outweigh its activations (6 layers, d_model 128, 16 tokens per step)."""
    import tracemalloc

    cfg = micro_config(**{**LEAN, **kw, "steps": steps, "eval_interval": 0, "checkpoint_interval": 0,
                          "micro_batch": 1, "seq_len": 16, "batch_tokens": 16})
    cfg.model.d_model, cfg.model.n_head, cfg.model.n_layer = 128, 2, 6
    tracemalloc.start()
    out = []
    try:
        tr = Trainer(cfg, tmp_path / name, quiet=True)
        for _ in range(steps):
            tracemalloc.reset_peak()
            tr.fit(tr.step + 1, save_final=False)
            out.append(tracemalloc.get_traced_memory()[1])
    finally:
        tracemalloc.stop()
    tr.close()
    return out, sum(p._data.nbytes for p in tr.params.values())


def test_optimizer_in_backward_steady_state_peak_is_below_plain_training(tmp_path):
    """The optimizer in backward uses and frees each gradient as soon as it is ready, at every step (not only
    the first): its steady-state step peak stays at its first step's and below plain training's. (A leaf's
    gradient that waited in the engine until backward ended, as it did from the second backward on when leaves
    were ordered by their first use, kept a full set alive from the second step on.)"""
    lean, total = _step_peaks(tmp_path, "oib", optimizer_in_backward=True)
    plain, _ = _step_peaks(tmp_path, "plain")
    print(f"step peaks above baseline: optimizer-in-backward {lean}, plain {plain} (gradients {total} B)")
    for k in (1, 2):  # steady state: below plain training, and no higher than the first step
        assert lean[k] < plain[k] - 0.25 * total, (k, lean, plain, total)
        assert lean[k] < lean[0] + 0.4 * total, (k, lean, total)  # step 0 creates the moments as it goes
