"""Hugging Face interop of the llama family: logits within 1e-4 of transformers' LlamaForCausalLM on small random
configs (GQA, tied/untied, Llama 3 RoPE scaling), in both directions, and through a saved model directory."""

import blutensor as bt
import numpy as np
import pytest
from blumodels.config import ConfigError, ModelConfig
from blumodels.hf import _read_safetensors, export_hf, load_into
from blumodels.llama.hf import from_hf, hf_config, to_hf
from blumodels.llama.model import build_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CASES = {
    "gqa-untied": dict(tie_embeddings=False),
    "mha-bias": dict(tie_embeddings=True, n_kv_heads=4, bias=True),
    "tied-llama3-rope": dict(tie_embeddings=True, rope_scaling="llama3", rope_factor=8.0, rope_original_max_len=16,
                             rope_theta=500000.0),
}


def _cfg(**kw):
    kw = {"n_kv_heads": 2, "bias": False, **kw}
    return ModelConfig(family="llama", n_layer=2, n_head=4, d_model=32, block_size=64, vocab_size=96, ffn_hidden=48,
                       ln_eps=1e-5, **kw)


def _ids():
    return np.random.default_rng(0).integers(0, 96, (2, 40))


def _ours(m, ids):
    logits, _ = m(bt.tensor(ids, dtype=bt.int64), bt.tensor(ids, dtype=bt.int64))
    return logits.numpy()[..., :96]


def _theirs(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor(ids)).logits.numpy()


@pytest.mark.parametrize("case", list(CASES))
def test_export_matches_transformers(case):
    m = build_model(_cfg(**CASES[case]), seed=1)
    state, config = to_hf(m)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    missing, unexpected = hf.load_state_dict({k: torch.tensor(v) for k, v in state.items()}, strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing)  # tied: HF ties it itself
    np.testing.assert_allclose(_ours(m, _ids()), _theirs(hf, _ids()), atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_import_matches_transformers(case):
    torch.manual_seed(0)
    config = hf_config(_cfg(**CASES[case]))
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    m = from_hf(hf.state_dict(), hf.config.to_dict())
    assert m.config.rope_scaling == CASES[case].get("rope_scaling", "none")
    np.testing.assert_allclose(_ours(m, _ids()), _theirs(hf, _ids()), atol=1e-4, rtol=0)


def test_model_directory_roundtrip_and_bf16_weights(tmp_path):
    m = build_model(_cfg(tie_embeddings=False), seed=2)
    export_hf(m, tmp_path / "a")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "a").eval()  # transformers reads our files
    np.testing.assert_allclose(_ours(m, _ids()), _theirs(hf, _ids()), atol=1e-4, rtol=0)
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "b")  # and we read theirs, bfloat16 included
    back = build_model(_cfg(tie_embeddings=False), seed=5)
    load_into(back, tmp_path / "b")
    w = _read_safetensors(next((tmp_path / "b").glob("*.safetensors")))["model.norm.weight"]
    assert w.dtype == np.float32
    np.testing.assert_allclose(back.norm.weight.numpy(), hf.model.norm.weight.detach().float().numpy())


def test_bad_configs_are_named():
    with pytest.raises(ConfigError, match="expected a LlamaForCausalLM config"):
        from_hf({}, {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    config = hf_config(_cfg())
    with pytest.raises(ConfigError, match="lacks .* weight"):
        from_hf({}, config)
    with pytest.raises(ConfigError, match="rope type 'yarn'"):
        from_hf({}, {**config, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}})


def _cuda_ok() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda_ok(), reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_model_matches_transformers(case):
    """The model on the GPU (fused add + RMSNorm, RoPE into attention's layout, GQA read in place, head dim 64 for
    the flash kernels) gives transformers' CPU logits and the CPU model's gradients (the CPU twin:
    test_export_matches_transformers)."""
    cfg = _cfg(**CASES[case])
    cfg.d_model, cfg.n_head, cfg.ffn_hidden = 256, 4, 96
    cpu = build_model(cfg, seed=1)
    state, config = to_hf(cpu)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    hf.load_state_dict({k: torch.tensor(v) for k, v in state.items()}, strict=False)
    gpu = build_model(cfg, seed=1).to("cuda")  # the same initial weights
    ids = _ids()
    x = bt.tensor(ids, dtype=bt.int64, device="cuda")
    logits, loss = gpu(x, x)
    np.testing.assert_allclose(logits.to("cpu").numpy()[..., :96], _theirs(hf, ids), atol=2e-4, rtol=0)
    loss.backward()
    _, ref = cpu(bt.tensor(ids, dtype=bt.int64), bt.tensor(ids, dtype=bt.int64))
    ref.backward()
    for (n, p), (_, q) in zip(gpu.named_parameters(), cpu.named_parameters()):
        np.testing.assert_allclose(p.grad.to("cpu").numpy(), q.grad.numpy(), atol=2e-4, rtol=2e-3, err_msg=n)


@pytest.mark.parametrize("tie", [True, False])
def test_padded_vocab_export_has_our_loss(tie):
    """vocab_size 96 pads to 128 (vocab_multiple 64): ``padded_vocab=True`` keeps the extra rows, so the softmax of
    the Hugging Face model runs over BluTrain's columns and the loss is ours; the plain export's is not."""
    m = build_model(_cfg(tie_embeddings=tie), seed=3)
    assert m.config.padded_vocab_size == 128
    ids = _ids()
    _, loss = m(bt.tensor(ids, dtype=bt.int64), bt.tensor(ids, dtype=bt.int64))

    def hf_loss(padded):
        state, config = to_hf(m, padded_vocab=padded)
        assert config["vocab_size"] == (128 if padded else 96) and state["model.embed_tokens.weight"].shape[0] == \
            config["vocab_size"]
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
        hf.load_state_dict({k: torch.tensor(v) for k, v in state.items()}, strict=False)
        with torch.no_grad():
            logits = hf(torch.tensor(ids)).logits
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                       torch.tensor(ids).reshape(-1)))

    assert abs(hf_loss(True) - float(loss.item())) < 1e-5
    assert abs(hf_loss(False) - float(loss.item())) > 1e-4


ROPE_CASES = {  # (head_dim, theta, positions, llama3 scaling or None): the shipped presets' shapes and odd ones
    "llama-125m": (64, 10000.0, 1024, None),
    "llama3-8b": (128, 500000.0, 8192, (8.0, 1.0, 4.0, 8192)),
    "llama-1b-long": (64, 500000.0, 16384, (32.0, 1.0, 4.0, 8192)),
    "odd-factors": (96, 1e6, 4096, (5.0, 1.5, 3.3, 512)),
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_tables_are_transformers(case):
    """The rotary tables equal LlamaRotaryEmbedding's to one rounding of cos/sin at every position: the same float32
    inverse frequencies, bit for bit (Llama 3 scaling in its op order), and float32 angles. Angles taken in float64
    instead differ from theirs by up to 3.6e-5 at position 1024 and 2.4e-4 at 8192, a different function that a
    checkpoint trained with theirs, or a PyTorch run beside ours, sees."""
    from blumodels.llama.model import inv_frequencies, rope_tables

    D, theta, T, l3 = ROPE_CASES[case]
    kw = {} if l3 is None else dict(rope_scaling="llama3", rope_factor=l3[0], rope_low_freq_factor=l3[1],
                                    rope_high_freq_factor=l3[2], rope_original_max_len=l3[3])
    cfg = ModelConfig(family="llama", n_layer=1, n_head=4, n_kv_heads=4, d_model=4 * D, block_size=T, vocab_size=64,
                      rope_theta=theta, **kw)
    hc = {k: v for k, v in hf_config(cfg).items() if k not in ("architectures", "model_type")}
    rot = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(transformers.LlamaConfig(**hc))
    np.testing.assert_array_equal(inv_frequencies(cfg), rot.inv_freq.numpy())
    cos, sin = rot(torch.zeros(1), torch.arange(T)[None])
    c, s = rope_tables(cfg, T)
    assert c.dtype == s.dtype == np.float32 and c.shape == (T, D // 2)
    np.testing.assert_allclose(c, cos[0, :, :D // 2].numpy(), rtol=0, atol=1.2e-7)
    np.testing.assert_allclose(s, sin[0, :, :D // 2].numpy(), rtol=0, atol=1.2e-7)
    np.testing.assert_array_equal(cos[0, :, D // 2:].numpy(), cos[0, :, :D // 2].numpy())  # rotate-half layout


LLAMA_RUN = {"family": "llama", "n_layer": 2, "n_head": 4, "n_kv_heads": 2, "d_model": 32, "block_size": 32,
             "bias": False, "ffn_dim_multiple": 16, "tie_embeddings": False, "rope_theta": 1000.0}


def test_cli_export_checkpoint_and_init_from(tmp_path, capsys):
    """Through `blutrain`: a trained llama's checkpoint exports (--checkpoint and --out alike) to a directory that
    LlamaForCausalLM loads with BluTrain's logits; --init-from that directory starts from those logits (the first
    step's loss is theirs on its batches); a directory of another rope_theta or n_kv_heads is refused by name
    before any work."""
    import json

    from blumodels.checkpoint.format import load_checkpoint
    from blumodels.cli import main
    from blumodels.config import from_dict
    from blumodels.data.loader import TokenLoader
    from blumodels.families import build_model as build_family
    from blumodels.state import restore_training_state
    from blumodels.trainer import Trainer
    from models_helpers import micro_data

    data = micro_data()
    train = {"steps": 3, "batch_tokens": 256, "micro_batch": 4, "seq_len": 32, "lr": 3e-3, "min_lr": 3e-4,
             "warmup_steps": 1, "eval_interval": 0, "checkpoint_interval": 3, "device": "cpu", "plot": False,
             "sample_tokens": 0, "seed": 7}
    cfg = from_dict({"model": LLAMA_RUN, "train": train, "data": {"dir": str(data)}})
    for run in ("run", "run2", "bad"):
        (tmp_path / run).mkdir()
        (tmp_path / run / "config.json").write_text(json.dumps(cfg.to_dict()))
    assert main(["train", "--out", str(tmp_path / "run"), "--quiet"]) == 0
    ckpt = sorted((tmp_path / "run" / "checkpoints").glob("step_*.rank0.safetensors"))[-1]
    capsys.readouterr()
    assert main(["export", "--hf", str(tmp_path / "hf"), "--checkpoint", str(ckpt)]) == 0
    said = capsys.readouterr().out
    assert "LlamaForCausalLM.from_pretrained" in said and "GPT2" not in said
    ref = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert (ref.config.num_key_value_heads, ref.config.vocab_size, ref.config.tie_word_embeddings) == (2, 512, False)

    tensors, meta = load_checkpoint(ckpt)
    ours = build_family(from_dict(meta["config"]).model, device="cpu")
    restore_training_state(tensors, meta, ours, restore_rng=False)
    ids = np.random.default_rng(3).integers(0, 512, (2, 32))
    logits = ours(bt.tensor(ids, dtype=bt.int64), bt.tensor(ids, dtype=bt.int64))[0].numpy()[..., :512]
    np.testing.assert_allclose(logits, _theirs(ref, ids), atol=1e-4, rtol=0)
    assert main(["export", "--hf", str(tmp_path / "hf_out"), "--out", str(tmp_path / "run")]) == 0  # newest = ckpt
    assert "LlamaForCausalLM.from_pretrained" in capsys.readouterr().out
    a, b = (_read_safetensors(tmp_path / d / "model.safetensors") for d in ("hf", "hf_out"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)

    init = from_dict({**cfg.to_dict(), "train": {**train, "init_from": str(tmp_path / "hf")}})
    tr = Trainer(init, tmp_path / "start", quiet=True)  # the model at step 0
    try:
        start = tr.model(bt.tensor(ids, dtype=bt.int64), bt.tensor(ids, dtype=bt.int64))[0].numpy()[..., :512]
    finally:
        tr.close()
    np.testing.assert_allclose(start, _theirs(ref, ids), atol=1e-4, rtol=0)
    assert main(["train", "--out", str(tmp_path / "run2"), "--quiet", "train.steps=1", "--init-from",
                 str(tmp_path / "hf")]) == 0
    first = json.loads((tmp_path / "run2" / "log.jsonl").read_text().splitlines()[0])
    loader = TokenLoader(data, "train", 4, 32)
    losses = []
    for _ in range(cfg.grad_accum):
        x, y = loader.next_batch()
        with torch.no_grad():
            out = ref(torch.tensor(x.numpy())).logits
        losses.append(float(torch.nn.functional.cross_entropy(out.reshape(-1, 512),
                                                              torch.tensor(y.numpy()).reshape(-1))))
    assert cfg.grad_accum == 2 and abs(first["loss"] - np.mean(losses)) < 1e-4

    for override, named in (("model.rope_theta=10000.0", "model.rope_theta=10000.0 but .* has 1000.0"),
                            ("model.n_kv_heads=4", "model.n_kv_heads=4 but .* has 2")):
        assert main(["train", "--out", str(tmp_path / "bad"), "--quiet", override, "--init-from",
                     str(tmp_path / "hf")]) == 2
        err = capsys.readouterr().err
        assert "train.init_from=" in err and __import__("re").search(named, err), err
    assert sorted(p.name for p in (tmp_path / "bad").iterdir()) == ["config.json"]  # nothing was started


@pytest.mark.parametrize("change, named", [
    (dict(n_kv_heads=4), r"model.n_kv_heads=4 but .* has 2"),
    (dict(n_kv_heads=0), r"model.n_kv_heads=0 \(= 4\) but .* has 2"),
    (dict(ffn_hidden=64), r"model.ffn_hidden=64 but .* has 48"),
    (dict(ffn_hidden=0, ffn_dim_multiple=32), r"model.ffn_hidden=0 \(= 96\) but .* has 48"),
    (dict(tie_embeddings=True), r"model.tie_embeddings=True but .* has False"),
    (dict(rope_theta=1e4), r"model.rope_theta=10000.0 but .* has 500000.0"),
    (dict(rope_scaling="none"), r"model.rope_scaling='none' but .* has 'llama3'"),
    (dict(rope_factor=4.0), r"model.rope_factor=4.0 but .* has 8.0"),
    (dict(rope_low_freq_factor=2.0), r"model.rope_low_freq_factor=2.0 but .* has 1.0"),
    (dict(rope_high_freq_factor=3.0), r"model.rope_high_freq_factor=3.0 but .* has 4.0"),
    (dict(rope_original_max_len=32), r"model.rope_original_max_len=32 but .* has 16"),
])
def test_init_from_refuses_other_weights_or_numerics(tmp_path, change, named):
    """Every key that defines a llama's weights or numerics is compared with the directory's, each mismatch named
    (config value, then the directory's) before any work; equal keys pass, ffn_hidden = 0 compared as resolved."""
    from blumodels.config import RunConfig
    from blumodels.hf import check_init_from

    def model(**kw):
        return ModelConfig(**{"family": "llama", "n_layer": 2, "n_head": 4, "n_kv_heads": 2, "d_model": 32,
                              "block_size": 64, "vocab_size": 96, "ffn_hidden": 48, "ln_eps": 1e-5, "bias": False,
                              "tie_embeddings": False, "rope_scaling": "llama3", "rope_factor": 8.0,
                              "rope_original_max_len": 16, "rope_theta": 500000.0, **kw})

    export_hf(build_model(model(), seed=1), tmp_path)
    check_init_from(tmp_path, RunConfig(model=model()))
    # int(0.5 * int(8 * 32 / 3)) = 42, rounded up to a multiple of 16: the directory's 48
    check_init_from(tmp_path, RunConfig(model=model(ffn_hidden=0, ffn_dim_multiplier=0.5, ffn_dim_multiple=16)))
    with pytest.raises(ConfigError, match=f"train.init_from=.* does not fit the model: {named}"):
        check_init_from(tmp_path, RunConfig(model=model(**change)))
