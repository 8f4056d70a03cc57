"""Precision logger: dumps, file round trips, BluTrain vs BluTrain and BluTrain vs PyTorch."""

from __future__ import annotations

import importlib.util

import blutensor as bt
import blutensor.nn.functional as F
import numpy as np
import pytest
from bluprofiler import Adapter, PrecisionLogger, TorchPrecisionLogger, compare, gpt2_adapter, load_dump
from bluprofiler.demo import GPT, PRESETS
from bluprofiler.precision import PrecisionError

torch = pytest.importorskip("torch")
from torch_gpt import CUSTOM_RULES, TorchGPT, load_from_ours  # noqa: E402

C = PRESETS["tiny"]


def _batch(seed=3):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, C.vocab_size, (C.batch_size, C.block_size + 1))
    return idx[:, :-1], idx[:, 1:]


def ours_dump(model, x, y, device="cpu"):
    xi = bt.tensor(x, dtype=bt.int64, device=device)
    yi = bt.tensor(y, dtype=bt.int64, device=device)
    with PrecisionLogger(model) as log:
        logits = model(xi)
        loss = F.cross_entropy(logits.view(-1, C.vocab_size), yi.view(-1))
        log.capture("loss", loss)
    loss.backward()
    log.capture_grads(model)
    return log


def torch_dump(tm, x, y):
    with TorchPrecisionLogger(tm) as log:
        logits = tm(torch.from_numpy(np.ascontiguousarray(x)))
        loss = torch.nn.functional.cross_entropy(logits.view(-1, C.vocab_size), torch.from_numpy(y).reshape(-1))
        log.capture("loss", loss)
    loss.backward()
    log.capture_grads()
    return log


def test_keys_cover_ops_modules_and_grads():
    bt.manual_seed(0)
    m = GPT(C)
    x, y = _batch()
    log = ours_dump(m, x, y)
    keys = list(log.tensors)
    ops = [k for k in keys if k[0].isdigit()]
    assert ops[0] == "0:arange" or ops[0].endswith(":embedding") or ":" in ops[0]
    assert [int(k.split(":")[0]) for k in ops] == list(range(len(ops)))  # every op call, in order
    assert "module:transformer.h.0.attn.c_attn" in keys and "module:<root>" in keys
    # inner modules are recorded before the module that contains them
    assert keys.index("module:transformer.h.0.ln_1") < keys.index("module:transformer.h.0")
    names = [n for n, _ in m.named_parameters()]
    assert [k[5:] for k in keys if k.startswith("grad:")] == names
    np.testing.assert_array_equal(log.tensors["module:<root>"], m(bt.tensor(x, dtype=bt.int64)).numpy())


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_save_load_round_trip_keeps_order(tmp_path, suffix):
    if suffix == ".safetensors":
        pytest.importorskip("safetensors")
    bt.manual_seed(0)
    m = GPT(C)
    x, y = _batch()
    log = ours_dump(m, x, y)
    p = log.save(tmp_path / f"dump{suffix}")
    back = load_dump(p)
    assert list(back) == list(log.tensors)
    for k, v in log.tensors.items():
        np.testing.assert_array_equal(back[k], v)
    with pytest.raises(PrecisionError, match="safetensors or .npz"):
        log.save(tmp_path / "dump.pt")


def test_blutrain_vs_blutrain_same_seed_is_exact_and_divergence_is_located(tmp_path):
    x, y = _batch()
    bt.manual_seed(0)
    a = ours_dump(GPT(C), x, y)
    bt.manual_seed(0)
    m = GPT(C)
    b = ours_dump(m, x, y)
    r = compare(a, b, rtol=0.0, atol=0.0)
    assert r.ok and all(row.rel_l2 == 0.0 for row in r.rows)
    # perturb one weight of block 1's MLP: the first divergence is that op/module, not earlier
    bt.manual_seed(0)
    m2 = GPT(C)
    # one element (a uniform shift would cancel: LayerNorm outputs sum to zero over features)
    m2.transformer.h[1].mlp.c_fc.weight._data[3, 5] += 0.05
    c = ours_dump(m2, x, y)
    r = compare(c, a, rtol=1e-6, keys="^module:")
    assert r.first_divergence.key == "module:transformer.h.1.mlp.c_fc"
    assert all(row.ok for row in r.rows[: r.rows.index(r.first_divergence)])
    txt = r.report()
    assert ">>> module:transformer.h.1.mlp.c_fc" in txt and "first divergence: module:transformer.h.1.mlp.c_fc" in txt
    # relative L2 of the perturbed output equals a float64 recomputation
    key = "module:transformer.h.1.mlp.c_fc"
    d = c.tensors[key].astype(np.float64) - a.tensors[key]
    assert r.rows[[row.key for row in r.rows].index(key)].rel_l2 == pytest.approx(
        np.linalg.norm(d) / np.linalg.norm(a.tensors[key].astype(np.float64)), rel=1e-9)


@pytest.mark.parametrize("style", ["hf", "custom"])
def test_blutrain_vs_pytorch_through_adapter(style, tmp_path):
    x, y = _batch()
    bt.manual_seed(0)
    ours = GPT(C)
    tm = TorchGPT(C, style)
    load_from_ours(tm, ours)
    a = ours_dump(ours, x, y)
    b = torch_dump(tm, x, y)
    adapter = gpt2_adapter("hf", ours="demo") if style == "hf" else Adapter(rules=CUSTOM_RULES)
    ext = ".safetensors" if importlib.util.find_spec("safetensors") else ".npz"
    a.save(tmp_path / f"ours{ext}")
    b.save(tmp_path / "torch.npz")
    r = compare(tmp_path / f"ours{ext}", tmp_path / "torch.npz", adapter=adapter, rtol=2e-5)
    assert r.ok, r.report()
    keys = {row.key for row in r.rows}
    assert "loss" in keys and "module:transformer.h.1.attn.c_attn" in keys
    assert "grad:transformer.h.0.mlp.c_fc.weight" in keys and "grad:transformer.wte.weight" in keys
    assert not [k for k in r.only_reference if k.startswith("grad:")]
    # without the adapter's transposes (hf) or names (custom) the comparison must fail
    if style == "hf":
        bad = compare(a, b, adapter=gpt2_adapter("nanogpt", ours="demo"), rtol=2e-5, keys="^grad:")
        assert not bad.ok and "c_attn.weight" in bad.first_divergence.key
    else:
        with pytest.raises(PrecisionError, match="no common keys"):
            compare(a, b, keys="^grad:")


def test_torch_divergence_located_in_forward_order():
    x, y = _batch()
    bt.manual_seed(0)
    ours = GPT(C)
    tm = TorchGPT(C, "hf")
    load_from_ours(tm, ours)
    with torch.no_grad():
        tm.transformer.h[0].ln_2.bias.add_(1e-2)
    r = compare(ours_dump(ours, x, y), torch_dump(tm, x, y), adapter=gpt2_adapter("hf", ours="demo"), rtol=2e-5)
    assert r.first_divergence.key == "module:transformer.h.0.ln_2"


def _blumodels_and_reference():
    """blumodels.gpt2 and benchmarks/torch_gpt2.py when this checkout has them (else skip)."""
    import importlib.util
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    try:
        import blumodels.gpt2  # noqa: F401
    except ImportError:
        src = root / "packages" / "blumodels" / "src"
        if not (src / "blumodels" / "gpt2.py").exists():
            pytest.skip("blumodels.gpt2 is not available")
        sys.path.insert(0, str(src))
    ref = root / "benchmarks" / "torch_gpt2.py"
    if not ref.exists():
        pytest.skip("benchmarks/torch_gpt2.py (the PyTorch GPT-2 reference) is not in this checkout")
    spec = importlib.util.spec_from_file_location("torch_gpt2_reference", ref)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from blumodels.config import ModelConfig
    from blumodels.gpt2 import build_model

    return ModelConfig, build_model, mod


def test_blumodels_gpt2_vs_the_pytorch_reference_through_gpt2_adapter():
    ModelConfig, build_model, ref = _blumodels_and_reference()
    cfg = ModelConfig(n_layer=2, n_head=2, d_model=32, block_size=16, vocab_size=96)
    ours = build_model(cfg, device="cpu", seed=0)
    tm = ref.from_blutrain(ours, device="cpu")
    x, y = _batch()
    xi, yi = bt.tensor(x, dtype=bt.int64), bt.tensor(y, dtype=bt.int64)
    with PrecisionLogger(ours) as log:
        _, loss = ours(xi, yi)
    loss.backward()
    log.capture_grads(ours)
    with TorchPrecisionLogger(tm) as tlog:
        tloss = tm(torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y)))
    tloss.backward()
    tlog.capture_grads()
    r = compare(log, tlog, adapter=gpt2_adapter("reference"), rtol=2e-5)
    assert r.ok, r.report()
    keys = {row.key for row in r.rows}
    assert {"module:<root>.out1", "module:blocks.1.attn.c_proj", "grad:blocks.0.mlp.c_fc.weight",
            "grad:wte.weight"} <= keys
    assert not [k for k in r.only_reference if k.startswith("grad:")]
    # a perturbed reference weight shows up at the first module that reads it
    with torch.no_grad():
        tm.blocks[1].attn_proj.weight[2, 3] += 0.05
    with TorchPrecisionLogger(tm) as tlog2:
        tm(torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y)))
    r2 = compare(log, tlog2, adapter=gpt2_adapter("reference"), rtol=2e-5, keys="^module:")
    assert r2.first_divergence.key == "module:blocks.1.attn.c_proj"


def test_gpt2_adapter_names_and_crop():
    a = gpt2_adapter("hf")
    assert a.map_key("grad:transformer.h.3.attn.c_attn.weight") == "grad:blocks.3.attn.c_attn.weight"
    assert a.map_key("module:transformer.ln_f") == "module:ln_f" and a.map_key("module:lm_head") == "module:<root>"
    assert a.map_key("module:transformer.h.0.attn.out1") is None
    d = a.apply({"grad:transformer.h.0.mlp.c_fc.weight": np.arange(6.0).reshape(2, 3)})
    assert d["grad:blocks.0.mlp.c_fc.weight"].shape == (3, 2)
    assert gpt2_adapter("reference").map_key("grad:blocks.1.mlp_proj.bias") == "grad:blocks.1.mlp.c_proj.bias"
    assert gpt2_adapter("reference", ours="demo").map_key("grad:blocks.1.c_attn.weight") == \
        "grad:transformer.h.1.attn.c_attn.weight"
    # padded vocabulary: ours (128 rows) is compared on the reference's 96 rows
    w = np.random.default_rng(0).standard_normal((128, 4))
    r = compare({"grad:wte.weight": w}, {"grad:transformer.wte.weight": w[:96]}, adapter=a, rtol=0)
    assert r.ok and "cropped" in r.rows[0].note
    with pytest.raises(ValueError, match="source"):
        gpt2_adapter("keras")


def test_compare_errors_and_nonfinite():
    a = {"x": np.ones(3, np.float32), "y": np.array([1.0, np.nan])}
    b = {"x": np.ones((3, 1), np.float32), "y": np.array([1.0, np.nan]), "z": np.zeros(2)}
    r = compare(a, b)
    assert r.rows[0].ok  # (3,) vs (3, 1): same values
    assert not r.rows[1].ok and "non-finite" in r.rows[1].note
    assert r.only_reference == ["z"]
    r2 = compare({"x": np.ones(3)}, {"x": np.ones(4)})
    assert not r2.ok and "shape" in r2.rows[0].note
    with pytest.raises(PrecisionError, match="does not exist"):
        load_dump("/nonexistent/dump.npz")


@pytest.mark.cuda
def test_cpu_vs_cuda_dump():

    x, y = _batch()
    bt.manual_seed(0)
    m = GPT(C)
    a = ours_dump(m, x, y)
    bt.manual_seed(0)
    g = GPT(C).to("cuda")
    prev = bt.get_matmul_precision()
    bt.set_matmul_precision("fp32")  # strict fp32: TF32 would differ by ~1e-3
    try:
        b = ours_dump(g, x, y, device="cuda")
    finally:
        bt.set_matmul_precision(prev)
    r = compare(b, a, rtol=1e-4)
    assert r.ok, r.report()
    assert len(r.rows) == len(a.tensors)


def test_compare_command(tmp_path, capsys):
    pytest.importorskip("safetensors")
    from bluprofiler.compare import main

    x = np.linspace(0, 1, 10, dtype=np.float32)
    from bluprofiler import save_dump

    save_dump({"module:a": x, "grad:w": x * 2}, tmp_path / "a.npz")
    save_dump({"module:a": x, "grad:w": x * 2 + 1e-3}, tmp_path / "b.safetensors")
    assert main([str(tmp_path / "a.npz"), str(tmp_path / "b.safetensors"), "--json", str(tmp_path / "r.json")]) == 1
    out = capsys.readouterr().out
    assert ">>> grad:w" in out and "first divergence: grad:w" in out
    assert main([str(tmp_path / "a.npz"), str(tmp_path / "b.safetensors"), "--rtol", "1e-2"]) == 0
    import json

    assert json.loads((tmp_path / "r.json").read_text())["first_divergence"] == "grad:w"
    with pytest.raises(SystemExit):
        main([str(tmp_path / "a.npz"), str(tmp_path / "a.npz"), "--adapter", "bert:x"])
