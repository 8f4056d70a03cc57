"""Llama training in BluTrain equals the same training in PyTorch, in fp32 on the CPU: the Trainer's pieces
(``make_optimizer``: AdamW over the model's decay / no-decay groups; ``lr_at``: warmup + cosine; ``TrainStep``:
accumulation, global-norm clipping) against transformers' ``LlamaForCausalLM`` (exported with ``to_hf(padded_vocab=
True)``, so the softmax runs over the same columns) with ``torch.optim.AdamW`` and ``clip_grad_norm_``, from the
same weights on the same batches. Every semantic of a step shows up here: the loss of each step, its gradient norm,
the clipped gradients and the parameters after it."""

from __future__ import annotations

import blutensor as bt
import numpy as np
import pytest
from blumodels.config import load_preset
from blumodels.llama.hf import to_hf
from blumodels.llama.model import build_model
from blumodels.step import TrainStep
from blumodels.trainer import lr_at, make_optimizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

STEPS, ACCUM, B, T = 10, 2, 2, 32


def _run_config():
    cfg = load_preset("llama-tiny")
    m, t = cfg.model, cfg.train
    m.n_layer, m.d_model, m.n_head, m.n_kv_heads, m.block_size, m.vocab_size = 2, 64, 4, 2, T, 200  # padded to 256
    m.ffn_hidden = 160
    t.steps, t.warmup_steps, t.lr, t.min_lr, t.micro_batch, t.seq_len = STEPS, 4, 2e-3, 2e-4, B, T
    t.batch_tokens = ACCUM * B * T
    t.weight_decay, t.grad_clip = 0.1, 0.5  # clipping active on most steps (norms ~1-2)
    cfg.validate()
    assert cfg.grad_accum == ACCUM
    return cfg


def _batches():
    # windows of this file's docstring (ASCII bytes: ids < 128) at random offsets: a text the model learns, so that
    # the loss falls and the gradients change from step to step
    text = np.frombuffer(__doc__.encode(), dtype=np.uint8).astype(np.int64)
    rng = np.random.default_rng(0)
    starts = rng.integers(0, text.size - T - 1, (STEPS, ACCUM, B))
    return [np.stack([np.stack([text[o:o + T + 1] for o in row]) for row in st]) for st in starts]


def _torch_name(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("tie", [True, False])
def test_llama_training_matches_pytorch(tie):
    torch.manual_seed(0)
    cfg = _run_config()
    cfg.model.tie_embeddings = tie
    t = cfg.train
    model = build_model(cfg.model, device="cpu", seed=0)
    state, hcfg = to_hf(model, padded_vocab=True)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hcfg, attn_implementation="sdpa"))
    hf.load_state_dict({k: torch.tensor(v) for k, v in state.items()}, strict=False)
    hf.train()
    opt = make_optimizer(model, cfg)
    lrs = [lr_at(s, cfg) for s in range(STEPS)]
    assert lrs[0] == pytest.approx(t.lr / 4) and lrs[3] == pytest.approx(t.lr) and lrs[-1] > t.min_lr
    step = TrainStep(model, opt, list(model.parameters()), device="cpu", lr_schedule=lrs, accum=cfg.grad_accum,
                     grad_clip=t.grad_clip)
    # PyTorch's reference recipe: decay on matrices and embeddings, none on the RMSNorm weights
    decay = [p for p in hf.parameters() if p.ndim >= 2]
    other = [p for p in hf.parameters() if p.ndim < 2]
    assert other and all(p.ndim == 1 for p in other)
    topt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay}, {"params": other,
                              "weight_decay": 0.0}], lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    V = hf.config.vocab_size
    assert V == model.config.padded_vocab_size == 256
    ours = dict(model.named_parameters())
    theirs = dict(hf.named_parameters())
    assert {_torch_name(k) for k in ours} == set(theirs)
    losses = []
    for s, batch in enumerate(_batches()):
        micro = iter(batch)

        def next_batch(it=micro):
            c = next(it)
            return bt.tensor(c[:, :-1]), bt.tensor(c[:, 1:])

        step.run(next_batch, lrs[s])
        r = step.read()
        for g in topt.param_groups:
            g["lr"] = lrs[s]
        tl = 0.0
        for c in batch:
            x, y = torch.tensor(c[:, :-1]), torch.tensor(c[:, 1:])
            loss = torch.nn.functional.cross_entropy(hf(x).logits.view(-1, V), y.reshape(-1))
            (loss / ACCUM).backward()
            tl += loss.item() / ACCUM
        tn = float(torch.nn.utils.clip_grad_norm_(hf.parameters(), t.grad_clip))
        losses.append((r.loss, tl))
        assert r.loss == pytest.approx(tl, rel=1e-5), f"step {s}: loss {r.loss} vs PyTorch {tl}"
        assert r.grad_norm == pytest.approx(tn, rel=1e-5), f"step {s}: grad norm {r.grad_norm} vs PyTorch {tn}"
        if s in (0, 1, STEPS - 1):
            # by step 10 the parameters differ by float32 rounding amplified through Adam's normalisation (a few
            # 1e-7), and the gradients of the attention projections by up to ~1e-5 with it
            tol = 1e-5 if s < 2 else 3e-5
            for k, p in ours.items():
                g = _rel(p.grad.numpy(), theirs[_torch_name(k)].grad.numpy())
                assert g < tol, f"step {s}: clipped gradient of {k} differs by {g:.2e} (relative)"
        topt.step()
        topt.zero_grad(set_to_none=True)
        if s in (0, 1, STEPS - 1):
            for k, p in ours.items():
                d = _rel(p.detach().numpy(), theirs[_torch_name(k)].detach().numpy())
                assert d < 1e-5, f"after step {s}: parameter {k} differs by {d:.2e} (relative)"
    assert losses[-1][0] < losses[0][0] - 0.3  # it trained (the comparison is not of two idle runs)
