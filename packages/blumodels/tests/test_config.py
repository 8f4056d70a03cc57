"""Config: TOML loading, every validation error names its field, overrides, presets."""

import pytest
from blumodels.config import (
    ConfigError,
    apply_overrides,
    from_dict,
    load_config,
    load_preset,
    parse_overrides,
    preset_names,
)


def _write(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_load_toml_and_types(tmp_path):
    cfg = load_config(_write(tmp_path, "[model]\nn_layer = 2\nd_model = 64\nn_head = 4\n"
                                       "[train]\nlr = 1\nsteps = 10\nbatch_tokens = 2048\nmicro_batch = 2\n"
                                       "seq_len = 1024\n"))
    assert cfg.model.n_layer == 2 and cfg.model.head_dim == 16
    assert isinstance(cfg.train.lr, float) and cfg.train.lr == 1.0
    assert cfg.grad_accum == 1


def test_unknown_key_names_field(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.n_layers"):
        load_config(_write(tmp_path, "[model]\nn_layers = 2\n"))


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match=r"\[optim\]"):
        load_config(_write(tmp_path, "[optim]\nlr = 2\n"))


@pytest.mark.parametrize("section,key", [("model", "d_model"), ("model", "n_layer"), ("train", "micro_batch"),
                                         ("train", "steps"), ("train", "lr"), ("data", "vocab_size")])
def test_negative_size_names_field(section, key):
    with pytest.raises(ConfigError, match=rf"{section}\.{key}"):
        from_dict({section: {key: -1}})


def test_global_batch_not_divisible():
    with pytest.raises(ConfigError, match=r"train\.batch_tokens=1000 is not divisible"):
        from_dict({"train": {"batch_tokens": 1000, "micro_batch": 2, "seq_len": 16}})
    with pytest.raises(ConfigError, match="world_size"):
        from_dict({"train": {"batch_tokens": 64, "micro_batch": 2, "seq_len": 16, "world_size": 3}})


def test_heads_must_divide_d_model():
    with pytest.raises(ConfigError, match=r"model\.n_head=5 does not divide model\.d_model=64"):
        from_dict({"model": {"n_head": 5, "d_model": 64}})


def test_wrong_type_names_field():
    with pytest.raises(ConfigError, match=r"model\.n_layer must be an integer"):
        from_dict({"model": {"n_layer": "two"}})
    with pytest.raises(ConfigError, match=r"train\.nan_policy"):
        from_dict({"train": {"nan_policy": "ignore"}})
    with pytest.raises(ConfigError, match=r"train\.seq_len=2048 exceeds model\.block_size=1024"):
        from_dict({"train": {"seq_len": 2048, "batch_tokens": 2048, "micro_batch": 1}})


def test_invalid_toml_names_file(tmp_path):
    p = _write(tmp_path, "[model\n")
    with pytest.raises(ConfigError, match="c.toml"):
        load_config(p)


def test_overrides():
    cfg = load_preset("tiny")
    new = apply_overrides(cfg, ["train.lr=3e-4", "model.n_layer=2", "train.nan_policy=skip"])
    assert new.train.lr == 3e-4 and new.model.n_layer == 2 and new.train.nan_policy == "skip"
    assert cfg.model.n_layer == 4  # the original is untouched
    with pytest.raises(ConfigError, match=r"train\.lrate"):
        apply_overrides(cfg, ["train.lrate=1"])
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_overrides(["lr=3"])
    with pytest.raises(ConfigError, match=r"model\.n_head=3 does not divide"):
        apply_overrides(cfg, ["model.n_head=3"])


def test_presets_load_and_match_table():
    names = preset_names()
    for n in ("tiny", "gpt2-124m", "gpt2-350m", "gpt2-774m", "gpt2-1.5b", "gpt2-2.4b"):
        assert n in names
        load_preset(n)
    c = load_preset("gpt2-124m")
    m, t = c.model, c.train
    assert (m.d_model, m.n_layer, m.n_head, m.block_size, m.vocab_size, m.padded_vocab_size) == \
        (768, 12, 12, 1024, 50257, 50304)
    assert (t.batch_tokens, t.lr, t.min_lr, t.warmup_steps, t.steps) == (524288, 6e-4, 6e-5, 715, 19073)
    assert (t.beta1, t.beta2, t.eps, t.weight_decay, t.grad_clip) == (0.9, 0.95, 1e-8, 0.1, 1.0)
    big = load_preset("gpt2-2.4b")
    assert (big.model.d_model, big.model.n_layer, big.model.n_head, big.train.micro_batch, big.train.seq_len) == \
        (3072, 20, 24, 2, 1024)
    with pytest.raises(ConfigError, match="unknown preset 'gpt5'"):
        load_preset("gpt5")


def test_precision_names_are_the_execution_policys_one_list(monkeypatch):
    """train.precision / train.fp32_gemm accept exactly the policy's CHOICES (blutensor.policy), and refuse the rest
    naming them; the old module constant reads the same list."""
    import blumodels.config as config
    import blutensor as bt

    assert config.precisions() == config.PRECISIONS == bt.policy.CHOICES["precision"]
    assert config.fp32_gemms() == bt.policy.CHOICES["fp32_gemm"]
    for p in bt.policy.PRECISIONS:
        assert from_dict({"train": {"precision": p}}).train.precision == p
    with pytest.raises(ConfigError, match=r"train\.precision must be 'fp32', 'tf32' or 'bf16', got 'bf61'; did you "
                                          r"mean 'bf16'"):
        from_dict({"train": {"precision": "bf61"}})
    with pytest.raises(ConfigError, match=r"train\.fp32_gemm must be 'strict' or '3xtf32'"):
        from_dict({"train": {"fp32_gemm": "fast"}})
    monkeypatch.setattr(bt.policy, "PRECISIONS", ("fp32", "tf32", "bf16", "fp8"))  # one list: a new name is seen
    assert "fp8" in config.precisions()
    with pytest.raises(ConfigError, match=r"must be 'fp32', 'tf32', 'bf16' or 'fp8'"):
        from_dict({"train": {"precision": "fp16"}})
