"""Every Trainer feature with model.family = "llama" on CPU: fp32, tf32 and bf16 autocast, accumulation, the compiled
step, checkpoints with bit-exact resume, recompute and optimizer-in-backward (equal to the plain step), the profiler,
the CLI."""

import json

import numpy as np
import pytest
from blumodels.cli import main
from blumodels.config import ConfigError, from_dict
from blumodels.trainer import Trainer
from models_helpers import micro_data

LLAMA = {"family": "llama", "n_layer": 2, "n_head": 4, "n_kv_heads": 2, "d_model": 32, "block_size": 32,
         "bias": False, "ffn_dim_multiple": 16, "tie_embeddings": False, "rope_theta": 1000.0}


def _cfg(model=None, **train):
    t = {"steps": 8, "batch_tokens": 256, "micro_batch": 4, "seq_len": 32, "lr": 3e-3, "min_lr": 3e-4,
         "warmup_steps": 2, "eval_interval": 4, "eval_steps": 2, "checkpoint_interval": 4, "device": "cpu",
         "plot": False, "seed": 7}
    t.update(train)
    return from_dict({"model": {**LLAMA, **(model or {})}, "train": t, "data": {"dir": str(micro_data())}})


def _run(out, cfg, steps=None, resume=False):
    tr = Trainer(cfg, out, quiet=True, resume=resume)
    tr.fit(steps)
    tr.close()
    losses = [r["loss"] for r in tr.history]
    return losses, {n: p.numpy().copy() for n, p in tr.model.named_parameters()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """8 steps, 2 micro-steps each (accumulation), dropout on (the RNG state matters for resume)."""
    return _run(tmp_path_factory.mktemp("llama"), _cfg({"dropout": 0.1}))


def test_trains_and_names_parameters(reference):
    losses, params = reference
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.1
    assert "layers.0.self_attn.k_proj.weight" in params and params["layers.0.self_attn.k_proj.weight"].shape == (
        16, 32)  # 2 kv heads * head_dim 8
    assert "lm_head.weight" in params  # untied


def test_resume_is_bit_exact(reference, tmp_path):
    ref_losses, ref_params = reference
    first, _ = _run(tmp_path, _cfg({"dropout": 0.1}), steps=5)
    rest, params = _run(tmp_path, _cfg({"dropout": 0.1}), resume=True)
    assert first + rest == ref_losses
    for n, p in ref_params.items():
        np.testing.assert_array_equal(params[n], p, err_msg=n)


def test_resume_refuses_other_llama_shape(reference, tmp_path):
    _run(tmp_path, _cfg(), steps=4)
    with pytest.raises(ConfigError, match="model.n_kv_heads=2 in the checkpoint, 4 now"):
        Trainer(_cfg({"n_kv_heads": 4}), tmp_path, resume=True, quiet=True)


def test_bf16_autocast_tracks_fp32(tmp_path):
    fp32, _ = _run(tmp_path / "a", _cfg(steps=3, eval_interval=0))
    bf16, _ = _run(tmp_path / "b", _cfg(steps=3, eval_interval=0, precision="bf16"))
    assert np.all(np.isfinite(bf16))
    np.testing.assert_allclose(bf16, fp32, atol=0.05)
    assert bf16 != fp32  # the bf16 path really ran


def test_tf32_is_fp32_on_cpu(tmp_path):
    """train.precision = "tf32" sets CUDA matmul precision only: on the CPU the run equals fp32 bit for bit."""
    fp32, p32 = _run(tmp_path / "a", _cfg(steps=2, eval_interval=0, checkpoint_interval=0))
    tf32, ptf = _run(tmp_path / "b", _cfg(steps=2, eval_interval=0, checkpoint_interval=0, precision="tf32"))
    assert tf32 == fp32
    for n, p in p32.items():
        np.testing.assert_array_equal(ptf[n], p, err_msg=n)


def test_compiled_step_equals_eager(tmp_path):
    """train.compile = true (the step traced by the compiler plugin; the fused add + RMSNorm is traced as its
    ops) gives the eager step's losses."""
    kw = dict(steps=2, eval_interval=0, checkpoint_interval=0, batch_tokens=128)
    eager, _ = _run(tmp_path / "eager", _cfg(**kw))
    compiled, _ = _run(tmp_path / "compiled", _cfg(**kw, compile=True))
    np.testing.assert_allclose(compiled, eager, rtol=0, atol=1e-5)


@pytest.mark.parametrize("feature", ["activation_checkpointing", "optimizer_in_backward"])
def test_recompute_and_optimizer_in_backward_equal_plain(tmp_path, feature):
    kw = dict(steps=3, eval_interval=0, batch_tokens=128, grad_clip=0.0, checkpoint_interval=0)
    plain_l, plain_p = _run(tmp_path / "plain", _cfg(**kw))
    got_l, got_p = _run(tmp_path / feature, _cfg(**kw, **{feature: True}))
    np.testing.assert_allclose(got_l, plain_l, rtol=1e-6)
    for n, p in plain_p.items():
        np.testing.assert_allclose(got_p[n], p, rtol=1e-5, atol=1e-6, err_msg=n)


def test_profile_and_sample_cli(tmp_path, capsys):
    cfg = tmp_path / "llama.toml"
    model = "\n".join(f"{k} = {json.dumps(v)}" for k, v in LLAMA.items()).replace("True", "true")
    cfg.write_text(f"[model]\n{model}\n[train]\nsteps = 2\nbatch_tokens = 128\nmicro_batch = 4\nseq_len = 32\n"
                   f"device = 'cpu'\nplot = false\neval_interval = 0\nsample_tokens = 0\n"
                   f"[data]\ndir = '{micro_data()}'\n")
    assert main(["profile", "--config", str(cfg), "--out", str(tmp_path / "prof"), "--steps", "1"]) == 0
    assert "rope" in (tmp_path / "prof" / "profile" / "summary.txt").read_text()
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["sample", "--out", str(tmp_path / "run"), "--tokens", "8", "--top-p", "0.9"]) == 0
    assert capsys.readouterr().out.strip()


@pytest.mark.parametrize("model,msg", [
    ({"n_kv_heads": 3}, r"model\.n_kv_heads=3 must divide model\.n_head=4"),
    ({"rope_scaling": "yarn"}, r"model\.rope_scaling must be 'none' or 'llama3', got 'yarn'"),
    ({"rope_theta": 0}, r"model\.rope_theta must be a positive number"),
    ({"family": "gpt2", "tie_embeddings": True}, r"model\.n_kv_heads is read by the llama family only"),
    ({"family": "gpt2", "n_kv_heads": 0}, r"model\.tie_embeddings = false: GPT-2 always ties"),
])
def test_bad_llama_keys(model, msg):
    with pytest.raises(ConfigError, match=msg):
        _cfg(model)


def test_captured_step_twin_equals_eager(tmp_path, monkeypatch):
    """train.cuda_graph with a llama: 2 eager warm-up steps, one capture, replays (the CPU twin of the capture,
    as in test_graph_step) give the eager Trainer's losses."""
    import blumodels.graph_step as gsm
    from blumodels.graph_step import EagerCapture

    def losses(graph, out):
        if graph:
            monkeypatch.setattr(gsm, "config_refusal", lambda cfg: None)
            monkeypatch.setattr(gsm, "runtime_refusal", lambda device, world=1: None)
        tr = Trainer(_cfg(steps=5, eval_interval=0, checkpoint_interval=0, batch_tokens=128, grad_clip=0.5), out,
                     quiet=True)
        tr._make_capture = EagerCapture
        tr.fit(save_final=False)
        tr.close()
        monkeypatch.undo()
        return tr, [r["loss"] for r in tr.history]

    _, ref = losses(False, tmp_path / "eager")
    tr, got = losses(True, tmp_path / "graph")
    assert [r.get("cuda_graph", False) for r in tr.history] == [False, False, True, True, True]
    assert tr._captured.last.captures == 1
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)


def test_family_is_a_registered_plugin_with_its_presets(capsys):
    from blumodels.cli import plugin_rows
    from blutensor.ext import get_host

    assert ("model", "llama", "blumodels", "0.1.0") in plugin_rows()
    fam = get_host().registry("model").get("llama")
    assert fam.presets() == ["llama-125m", "llama-1b", "llama-tiny", "llama3-8b"]
    m = fam.build({**LLAMA, "vocab_size": 512})
    assert fam.count_params(m.config) == sum(p.numel() for p in m.parameters())
    assert main(["presets"]) == 0
    text = capsys.readouterr().out
    assert "llama3-8b" in text and "8.03B" in text and "llama-1b" in text and "1.24B" in text


def _cuda_ok() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda_ok(), reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("mode", ["fp32", "tf32", "bf16", "fp32_graph", "tf32_graph", "bf16_graph"])
def test_cuda_trainer_matches_cpu(tmp_path, mode):
    """The llama Trainer on the GPU (eager and captured, fp32 and bf16) follows the CPU run of the same config
    (the CPU twin: test_trains_and_names_parameters / test_bf16_autocast_tracks_fp32 above)."""
    prec, graph = mode.split("_")[0], mode.endswith("graph")
    kw = dict(steps=4, eval_interval=0, checkpoint_interval=0, batch_tokens=128, precision=prec, deterministic=True)
    cpu, _ = _run(tmp_path / "cpu", _cfg(**kw))
    gpu, _ = _run(tmp_path / "gpu", _cfg(**kw, device="cuda", cuda_graph=graph))
    np.testing.assert_allclose(gpu, cpu, rtol=0, atol={"fp32": 2e-4, "tf32": 1e-2}.get(prec, 3e-2))


def test_families_present_without_entry_points():
    """BLUTRAIN_DISABLE_PLUGIN_AUTOLOAD=1 loads no entry point: blumodels still builds its own families."""
    import os
    import subprocess
    import sys

    code = ("from blumodels.config import model_config; from blumodels.families import build_model; "
            "print(type(build_model(model_config({'family': 'llama', 'n_layer': 1, 'n_head': 2, 'd_model': 16, "
            "'vocab_size': 64, 'block_size': 8, 'bias': False}))).__name__)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "BLUTRAIN_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert p.returncode == 0 and p.stdout.strip() == "Llama", p.stderr[-2000:]
