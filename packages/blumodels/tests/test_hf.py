"""Hugging Face GPT-2 round trip against transformers' GPT2LMHeadModel (test-only dependency), both directions."""

import json

import blutensor as bt
import numpy as np
import pytest
from blumodels import hf
from blumodels.cli import main
from blumodels.config import ConfigError, ModelConfig
from blumodels.gpt2 import build_model, from_hf
from models_helpers import micro_config, micro_data

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V, D, L, H, T = 97, 32, 2, 4, 16  # vocabulary padded to 128 in BluTrain: the crop and the zero rows are exercised


def _ours(model, ids):
    x = bt.tensor(ids, dtype=bt.int64)
    logits, _ = model(x, x)  # with targets: logits at every position
    return logits.detach().numpy()[..., :V].astype(np.float64)


def _theirs(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.double().numpy()


def _ids(seed=0):
    return np.random.default_rng(seed).integers(0, V, size=(2, T), dtype=np.int64)


def test_export_loads_in_transformers(tmp_path):
    cfg = ModelConfig(n_layer=L, n_head=H, d_model=D, block_size=T, vocab_size=V)
    model = build_model(cfg, seed=3)
    with bt.no_grad():  # non-zero biases and LayerNorm affine so that every tensor's mapping counts
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(bt.tensor(np.random.default_rng(len(name)).normal(0, 0.1, p.shape).astype(np.float32)))
    hf.export_hf(model, tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    ref = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ids = _ids()
    diff = np.abs(_theirs(ref, ids) - _ours(model, ids)).max()
    assert diff < 1e-4, diff


def test_import_from_transformers(tmp_path):
    torch.manual_seed(0)
    c = transformers.GPT2Config(vocab_size=V, n_positions=T, n_embd=D, n_layer=L, n_head=H, resid_pdrop=0.0,
                                embd_pdrop=0.0, attn_pdrop=0.0)
    ref = transformers.GPT2LMHeadModel(c).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ref.save_pretrained(tmp_path / "hf", safe_serialization=True)
    model = from_hf(str(tmp_path / "hf"))
    assert model.config.vocab_size == V and model.wte.weight.shape[0] == 128
    assert not model.wte.weight.detach().numpy()[V:].any()  # padded rows are zero
    ids = _ids(1)
    diff = np.abs(_theirs(ref, ids) - _ours(model, ids)).max()
    assert diff < 1e-4, diff
    # and back: export of the imported model is the same tensors transformers wrote
    hf.export_hf(model, tmp_path / "again")
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "again").eval()
    assert np.abs(_theirs(again, ids) - _theirs(ref, ids)).max() < 1e-6


def test_bad_directories_are_named(tmp_path):
    with pytest.raises(hf.HFError, match="not a directory"):
        hf.load_hf(tmp_path / "missing")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(hf.HFError, match="model_type 'bert'"):
        hf.load_hf(tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8, "n_layer": 1,
                                                            "n_head": 2, "n_positions": 8, "vocab_size": 10}))
    with pytest.raises(hf.HFError, match="no model.safetensors"):
        hf.load_hf(tmp_path / "d")


def test_cli_export_and_init_from(tmp_path, capsys):
    """export --hf of a trained run loads in transformers; train --init-from starts from it (the first step's
    loss is the exported weights' loss on that step's batches); a shape mismatch is refused before any work."""
    from blumodels.data.loader import TokenLoader
    from blumodels.trainer import Trainer

    data = micro_data()
    cfg = micro_config(data, steps=2, eval_interval=0, checkpoint_interval=0)
    for run in ("run", "run2"):
        (tmp_path / run).mkdir()
        (tmp_path / run / "config.json").write_text(json.dumps(cfg.to_dict()))
    assert main(["train", "--out", str(tmp_path / "run"), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["export", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    assert "GPT2LMHeadModel.from_pretrained" in capsys.readouterr().out  # the architecture config.json names
    files = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files  # the run's BPE comes along
    ref = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert ref.config.vocab_size == 512 and ref.config.n_layer == 2
    eot = json.loads((data / "meta.json").read_text())["eot_token"]
    assert ref.config.eos_token_id == ref.config.bos_token_id == eot
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "hf" / "tokenizer.json"))
    from blumodels.data.tokenizer import load_tokenizer

    assert tok.encode("def f(x): return x") == load_tokenizer(data).encode("def f(x): return x")

    assert main(["train", "--out", str(tmp_path / "run2"), "--quiet", "train.steps=1", "--init-from",
                 str(tmp_path / "hf")]) == 0
    first = json.loads((tmp_path / "run2" / "log.jsonl").read_text().splitlines()[0])
    loader = TokenLoader(data, "train", cfg.train.micro_batch, cfg.train.seq_len)
    losses = []
    for _ in range(cfg.grad_accum):
        x, y = loader.next_batch()
        with torch.no_grad():
            out = ref(torch.tensor(x.numpy())).logits
        losses.append(float(torch.nn.functional.cross_entropy(out.reshape(-1, 512),
                                                              torch.tensor(y.numpy()).reshape(-1))))
    assert cfg.grad_accum == 2 and abs(first["loss"] - np.mean(losses)) < 1e-4

    bad = micro_config(data)
    bad.model.n_layer = 3
    bad.train.init_from = str(tmp_path / "hf")
    with pytest.raises(ConfigError, match="model.n_layer=3 but .* has 2"):
        Trainer(bad, tmp_path / "run3")
    assert not (tmp_path / "run3").exists()
    bad = micro_config(data)
    bad.train.init_from = str(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="init_from.*not a directory"):
        Trainer(bad, tmp_path / "run3")
