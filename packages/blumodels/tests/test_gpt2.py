"""GPT-2 model: structure, tied weights, padded vocabulary, init, and forward/backward vs PyTorch CPU."""

import math

import blutensor as bt
import numpy as np
import pytest
from blumodels.config import ModelConfig
from blumodels.gpt2 import build_model

CFG = ModelConfig(n_layer=2, n_head=4, d_model=32, block_size=16, vocab_size=100)


def test_structure_tied_and_padded():
    m = build_model(CFG, seed=0)
    names = [n for n, _ in m.named_parameters()]
    assert "wte.weight" in names and not any("lm_head" in n for n in names)
    assert names.count("wte.weight") == 1
    assert tuple(m.wte.weight.shape) == (128, 32)  # 100 padded to a multiple of 64
    assert "blocks.0.attn.c_attn.weight" in names and "blocks.1.mlp.c_proj.bias" in names
    assert "ln_f.weight" in names and "blocks.0.ln_1.bias" in names
    L, d, V, T = 2, 32, 128, 16
    assert m.num_params() == V * d + T * d + L * (12 * d * d + 13 * d) + 2 * d
    x = bt.tensor(np.arange(10).reshape(2, 5) % 100, dtype=bt.int64)
    logits, loss = m(x, x)
    assert tuple(logits.shape) == (2, 5, 128) and loss is not None
    logits, loss = m(x)
    assert tuple(logits.shape) == (2, 1, 128) and loss is None


def test_init_statistics():
    cfg = ModelConfig(n_layer=4, n_head=4, d_model=256, block_size=64, vocab_size=512)
    m = build_model(cfg, seed=1)
    std = lambda t: float(np.std(t.numpy()))  # noqa: E731
    assert std(m.wte.weight) == pytest.approx(0.02, rel=0.03)
    assert std(m.blocks[0].attn.c_attn.weight) == pytest.approx(0.02, rel=0.03)
    r = 0.02 / math.sqrt(2 * 4)
    assert std(m.blocks[3].attn.c_proj.weight) == pytest.approx(r, rel=0.03)
    assert std(m.blocks[2].mlp.c_proj.weight) == pytest.approx(r, rel=0.03)
    assert not m.blocks[0].attn.c_attn.bias.numpy().any()
    assert (m.blocks[0].ln_1.weight.numpy() == 1).all()
    # same seed -> same model
    m2 = build_model(cfg, seed=1)
    assert np.array_equal(m.blocks[1].mlp.c_fc.weight.numpy(), m2.blocks[1].mlp.c_fc.weight.numpy())


def test_param_groups_decay_only_2d():
    m = build_model(CFG, seed=0)
    dec, nodec = m.param_groups(0.1)
    assert dec["weight_decay"] == 0.1 and nodec["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in dec["params"]) and all(p.ndim == 1 for p in nodec["params"])
    assert len(dec["params"]) + len(nodec["params"]) == len(list(m.parameters()))


def _torch_forward(m, idx, tgt, cfg):
    """A straightforward PyTorch GPT-2 on the same weights (the reference)."""
    import torch
    import torch.nn.functional as TF

    P = {n: torch.tensor(p.numpy().astype(np.float64), requires_grad=True) for n, p in m.named_parameters()}
    x = torch.tensor(idx)
    B, T = x.shape
    h = P["wte.weight"][x] + P["wpe.weight"][:T]
    H, C = cfg.n_head, cfg.d_model
    for i in range(cfg.n_layer):
        g = lambda s, i=i: P[f"blocks.{i}.{s}"]  # noqa: E731
        a = TF.layer_norm(h, (C,), g("ln_1.weight"), g("ln_1.bias"))
        qkv = a @ g("attn.c_attn.weight").T + g("attn.c_attn.bias")
        q, k, v = qkv.split(C, dim=-1)
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
        y = TF.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        h = h + y @ g("attn.c_proj.weight").T + g("attn.c_proj.bias")
        a = TF.layer_norm(h, (C,), g("ln_2.weight"), g("ln_2.bias"))
        a = TF.gelu(a @ g("mlp.c_fc.weight").T + g("mlp.c_fc.bias"), approximate="tanh")
        h = h + a @ g("mlp.c_proj.weight").T + g("mlp.c_proj.bias")
    h = TF.layer_norm(h, (C,), P["ln_f.weight"], P["ln_f.bias"])
    logits = h @ P["wte.weight"].T
    loss = TF.cross_entropy(logits.reshape(B * T, -1), torch.tensor(tgt).reshape(-1))
    loss.backward()
    return logits.detach().numpy(), float(loss.detach()), {n: p.grad.numpy() for n, p in P.items()}


def test_forward_backward_match_pytorch():
    pytest.importorskip("torch")
    m = build_model(CFG, seed=3)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, CFG.vocab_size, (3, 12))
    tgt = rng.integers(0, CFG.vocab_size, (3, 12))
    logits, loss = m(bt.tensor(idx, dtype=bt.int64), bt.tensor(tgt, dtype=bt.int64))
    loss.backward()
    ref_logits, ref_loss, ref_grads = _torch_forward(m, idx, tgt, CFG)
    np.testing.assert_allclose(logits.numpy(), ref_logits, rtol=1e-4, atol=1e-5)
    assert float(loss.item()) == pytest.approx(ref_loss, rel=1e-5)
    for n, p in m.named_parameters():
        np.testing.assert_allclose(p.grad.numpy(), ref_grads[n], rtol=1e-3, atol=2e-6, err_msg=n)
    # padded vocabulary rows only get the softmax push-down gradient, never a target's
    assert tgt.max() < CFG.vocab_size


def test_sequence_too_long():
    m = build_model(CFG, seed=0)
    with pytest.raises(ValueError, match="block_size"):
        m(bt.tensor(np.zeros((1, 17)), dtype=bt.int64))
