"""Device memory in the Trainer (train.allocator, peaks in the log) and the memory benchmark's lean path:
recomputation and the optimizer step in backward give plain training's losses with tied embeddings."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from blumodels.config import ConfigError
from blumodels.memory import DeviceMemory
from blumodels.trainer import Trainer
from blutensor.ext import hookimpl, reset_host
from models_helpers import micro_config

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "benchmarks" / "memory_gpt2.py"


def _has_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001
        return False


def test_config_checks_the_allocator_name():
    assert micro_config().train.allocator == "blu"
    micro_config(allocator="cupy").validate()
    micro_config(allocator="caching").validate()  # bluallocator's plugin name for "blu"
    with pytest.raises(ConfigError, match=r"train.allocator must be 'blu', 'cupy' or an installed allocator "
                                          r"plugin \(blu, cupy, caching, cupy-default\), got 'torch'"):
        micro_config(allocator="torch").validate()


class FakeAllocator:
    """A third-party allocator plugin: records install() and reports fixed statistics."""

    PLUGIN_NAME = "testalloc"
    installed = 0

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def install(cls):
        cls.installed += 1

    @classmethod
    def memory_stats(cls):
        return {"allocated_bytes": 10, "reserved_bytes": 64, "peak_allocated_bytes": 32}


class FakePlugin:
    @hookimpl
    def blutrain_register_allocators(self):
        return [FakeAllocator]


def test_allocator_plugin_selected_by_name():
    """train.allocator names any installed allocator plugin: config accepts it, DeviceMemory installs it on CUDA
    (here only the plumbing: the fake needs no GPU) and reports its statistics; on the CPU nothing is installed."""
    host = reset_host(autoload=True)
    try:
        host.register(FakePlugin(), name="testalloc-pkg")
        with pytest.raises(ConfigError, match=r"got 'testaloc'; did you mean 'testalloc'"):
            micro_config(allocator="testaloc").validate()
        micro_config(allocator="testalloc").validate()
        assert DeviceMemory("cpu", "testalloc").after_step()["peak_allocated_bytes"] is None
        assert FakeAllocator.installed == 0
        m = DeviceMemory("cuda", "testalloc")
        assert FakeAllocator.installed == 1 and m.alloc is None and m.stats()["reserved_bytes"] == 64
        # the plugin keeps no reserved peak: unknown, not its current value
        assert m.after_step() == {"peak_allocated_bytes": 32, "peak_reserved_bytes": None, "reserved_bytes": 64}
    finally:
        reset_host()


def test_device_memory_on_cpu_installs_nothing():
    m = DeviceMemory("cpu", "blu")
    assert m.alloc is None and m.stats() is None
    assert m.after_step() == {"peak_allocated_bytes": None, "peak_reserved_bytes": None, "reserved_bytes": None}
    with pytest.raises(ValueError, match="train.allocator must be one of"):
        DeviceMemory("cpu", "jemalloc")


def test_trainer_log_records_carry_the_peaks(tmp_path):
    tr = Trainer(micro_config(steps=2, eval_interval=0), tmp_path / "run", quiet=True)
    tr.fit()
    tr.close()
    recs = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and all("peak_reserved_bytes" in r and "peak_allocated_bytes" in r for r in recs)


@pytest.mark.cuda
@pytest.mark.skipif(not _has_gpu(), reason="needs CuPy and a GPU")
def test_device_memory_on_cuda_flushes_once_and_reports_peaks():
    """In a fresh process: bluallocator is installed once per process, and another test's Trainer may already
    have profiled and flushed its start-up."""
    import subprocess
    import sys
    import textwrap

    body = textwrap.dedent("""
        import blutensor as bt
        from blumodels.memory import DeviceMemory

        m = DeviceMemory("cuda", "blu")
        assert m.alloc is not None and m.alloc.profiling
        x = bt.randn(1024, 1024, device="cuda")
        del x
        rec = m.after_step()
        assert m.flushed is not None and not m.alloc.profiling
        assert rec["peak_allocated_bytes"] >= 4 * 1024 * 1024
        assert rec["peak_reserved_bytes"] >= rec["peak_allocated_bytes"]
        assert m.after_step()["peak_reserved_bytes"] == rec["peak_reserved_bytes"]  # no second flush
    """)
    p = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


def _bench_module():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import importlib

    return importlib.import_module("memory_gpt2")


def _args(**kw):
    a = dict(batch=1, seq=16, layers=24, d=32, heads=2, steps=4, lr=3e-3, warmup=0, device="cpu", allocator="cupy",
             recompute=False, oib=False, no_clip=True, compile=False, sdpa_fp32="", fp32_gemm="strict")
    a.update(kw)
    return argparse.Namespace(**a)


def test_lean_paths_equal_plain_training_with_tied_embeddings():
    """The case-c code path (deep model, tied wte, recompute + optimizer in backward) on the CPU."""
    bench = _bench_module()
    ref = bench.blutrain(_args())["losses"]
    assert len(ref) == 4 and ref[-1] < ref[0]
    for kw in ({"recompute": True}, {"oib": True}, {"recompute": True, "oib": True},
               {"recompute": True, "oib": True, "warmup": 2}):
        losses = bench.blutrain(_args(**kw))["losses"]
        if "warmup" in kw:
            assert losses[0] == ref[0] and losses[-1] < losses[0]
            continue
        assert max(abs(x - y) for x, y in zip(losses, ref)) <= 1e-6, kw


def test_lean_paths_equal_pytorch():
    pytest.importorskip("torch")
    bench = _bench_module()
    ours = bench.blutrain(_args(recompute=True, oib=True))["losses"]
    theirs = bench.torch_run(_args())["losses"]
    assert max(abs(x - y) for x, y in zip(ours, theirs)) <= 1e-4


def test_benchmark_plumbing_tiny(tmp_path):
    out = tmp_path / "mem.json"
    env_path = ":".join(str(p) for p in sorted((ROOT / "packages").glob("*/src")))
    p = subprocess.run([sys.executable, str(BENCH), "--tiny", "--only", "c", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, env={"PYTHONPATH": env_path, "PATH": "/usr/bin"})
    assert p.returncode == 0, p.stderr[-2000:]
    doc = json.loads(out.read_text())
    c = doc["results"]["c"]["blutrain_lean"]
    assert "error" not in c, c
    assert len(c["losses"]) == 4 and c["lrs"][0] < c["lrs"][-1]  # warmup
    assert doc["targets"]["c:largest_model"]["steps"] == 4 and "memory_gpt2.py --tiny" in doc["command"]


def _fused_vs_generic(monkeypatch, device: str):
    import blumodels.gpt2 as gpt2
    import blutensor as bt
    import numpy as np
    from blumodels.config import ModelConfig

    cfg = ModelConfig(n_layer=2, n_head=2, d_model=64, block_size=16, vocab_size=100)
    idx = bt.tensor(np.random.default_rng(0).integers(0, 100, (2, 16)), device=device)

    def run():
        m = gpt2.build_model(cfg, device=device, seed=1)
        _, loss = m(idx, idx)
        saved = _saved_bytes(loss, {id(p._data) for p in m.parameters()}) if device == "cpu" else 0
        loss.backward()
        return float(loss.item()), {n: p.grad.to("cpu").numpy().copy() for n, p in m.named_parameters()}, saved

    # the GELU-in-the-GEMM MLP (CUDA) compares with the unfused ops within rounding (test_gpt2_fused_mlp.py); here
    # the elementwise-GELU paths run, whose gradients are bit-identical
    monkeypatch.setattr(gpt2, "_fused_mlp_inputs", lambda mlp, x: None)
    fused = run()
    monkeypatch.setattr(gpt2, "_lean_ok", lambda u, w: False)
    generic = run()
    assert fused[0] == generic[0]
    assert all(np.array_equal(fused[1][n], generic[1][n]) for n in generic[1])
    return cfg, fused[2], generic[2]


def test_fused_gelu_projection_is_bit_identical_and_saves_less(monkeypatch):
    """MLP's c_proj(gelu(u)) keeps only u for backward; losses and gradients equal the generic ops bit for bit."""
    cfg, saved_f, saved_g = _fused_vs_generic(monkeypatch, "cpu")
    # per layer: 4*d floats per token less (the GELU output)
    assert saved_g - saved_f == cfg.n_layer * 2 * 16 * 4 * cfg.d_model * 4


@pytest.mark.cuda
@pytest.mark.skipif(not _has_gpu(), reason="needs CuPy and a GPU")
def test_fused_gelu_projection_is_bit_identical_on_cuda(monkeypatch):
    _fused_vs_generic(monkeypatch, "cuda")


def _saved_bytes(loss, params: set) -> int:
    """Bytes of the distinct non-parameter buffers the autograd graph holds for backward."""
    import blutensor as bt
    import numpy as np

    def root(a):
        while isinstance(a.base, np.ndarray):
            a = a.base
        return a

    seen, stack, visited = {}, [loss.grad_fn], set()
    while stack:
        n = stack.pop()
        if n is None or id(n) in visited:
            continue
        visited.add(id(n))
        ctx = getattr(n, "ctx", None)
        if ctx is not None:
            items = list(ctx.saved) if isinstance(ctx.saved, tuple | list) else [ctx.saved]
            items += list((getattr(ctx, "__dict__", None) or {}).values())
            for s in items:
                a = s._data if isinstance(s, bt.Tensor) else s
                if isinstance(a, np.ndarray) and id(root(a)) not in params:
                    seen[id(root(a))] = root(a).nbytes
        stack.extend(getattr(n, "next", ()))
    return sum(seen.values())


def _lean_logits_run(device: str, lean: bool):
    import blumodels.gpt2 as gpt2
    import blutensor as bt
    import numpy as np
    from blumodels.config import ModelConfig

    cfg = ModelConfig(n_layer=2, n_head=2, d_model=64, block_size=16, vocab_size=100)
    m = gpt2.build_model(cfg, device=device, seed=1)
    m.lean_logits = lean
    idx = bt.tensor(np.random.default_rng(0).integers(0, 100, (2, 16)), device=device)
    logits, loss = m(idx, idx)
    loss.backward()
    return logits, float(loss.item()), {n: p.grad.to("cpu").numpy() for n, p in m.named_parameters()}


def test_lean_logits_is_a_no_op_on_cpu():
    import numpy as np

    logits, loss, grads = _lean_logits_run("cpu", True)
    ref_logits, ref_loss, ref_grads = _lean_logits_run("cpu", False)
    assert logits is not None and loss == ref_loss and all(np.array_equal(grads[n], ref_grads[n]) for n in grads)


@pytest.mark.cuda
@pytest.mark.skipif(not _has_gpu(), reason="needs CuPy and a GPU")
def test_lean_logits_on_cuda_gives_the_same_loss_and_gradients():
    import numpy as np

    logits, loss, grads = _lean_logits_run("cuda", True)
    ref_logits, ref_loss, ref_grads = _lean_logits_run("cuda", False)
    assert logits is None and ref_logits is not None  # the logits buffer now holds their gradient
    assert loss == ref_loss and all(np.array_equal(grads[n], ref_grads[n]) for n in grads)


def test_step_log_memory_on_cuda_is_the_allocators_live_bytes(monkeypatch):
    """mem_bytes on CUDA reads bt.cuda.memory_allocated (the allocator in use: bluallocator's live blocks when it
    is installed), not CuPy's default pool; an error there leaves the field empty instead of failing the step."""
    import blutensor as bt
    from blumodels import metrics

    monkeypatch.setattr(bt.cuda, "memory_allocated", lambda device=None: 123 << 20)
    assert metrics.memory_bytes("cuda") == 123 << 20

    def no_gpu(device=None):
        raise bt.DeviceError("no CUDA device")

    monkeypatch.setattr(bt.cuda, "memory_allocated", no_gpu)
    assert metrics.memory_bytes("cuda") is None
    assert metrics.memory_bytes("cpu") > 0  # peak RSS
