"""Trainer: bit-exact resume, checkpoint fallback, NaN policy, logs and plots (CPU, micro config)."""

import json

import numpy as np
import pytest
from blumodels.config import ConfigError
from blumodels.trainer import NonFiniteError, Trainer
from models_helpers import micro_config, micro_data


def _losses(out):
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "log.jsonl").read_text().splitlines())]


def _params(tr):
    return {n: p.numpy().copy() for n, p in tr.model.named_parameters()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 8-step run with dropout (so the RNG state matters) and gradient accumulation."""
    out = tmp_path_factory.mktemp("ref")
    tr = Trainer(_cfg(), out, quiet=True)
    tr.fit()
    tr.close()
    return out, _losses(out), _params(tr)


def _cfg(**kw):
    cfg = micro_config(**kw)
    cfg.model.dropout = 0.1
    return cfg


def test_log_records_and_artifacts(reference):
    out, losses, _ = reference
    recs = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(8))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "mem_bytes"):
        assert all(key in r for r in recs), key
    assert recs[0]["mfu"] is None  # CPU: no peak FLOP/s known
    assert recs[0]["lr"] == pytest.approx(3e-3 / 2)  # warmup step 1 of 2
    assert "val_loss" in recs[0] and "val_loss" in recs[4] and "val_loss" in recs[7]
    assert sorted(p.name for p in (out / "checkpoints").glob("*.safetensors")) == \
        ["step_00000004.rank0.safetensors", "step_00000008.rank0.safetensors"]
    s = json.loads((out / "summary.json").read_text())
    assert s["steps"] == 8 and s["last_val_loss"] < s["first_val_loss"]


@pytest.mark.parametrize("async_save", [False, True])
def test_resume_is_bit_exact(reference, tmp_path, async_save):
    _, ref_losses, ref_params = reference
    a = Trainer(_cfg(async_checkpoint=async_save), tmp_path, quiet=True)
    a.fit(steps=5)  # stops mid-interval; fit saves a final checkpoint at step 5
    a.close()
    del a
    b = Trainer(_cfg(), tmp_path, resume=True, quiet=True)  # new objects, restored state
    assert b.step == 5 and b.resumed_from.endswith("step_00000005.rank0.safetensors")
    b.fit()
    b.close()
    assert _losses(tmp_path) == ref_losses  # == : bit-exact, including steps 0-4 kept from the first run
    for n, p in _params(b).items():
        assert np.array_equal(p, ref_params[n]), n


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_checkpoint_falls_back(reference, tmp_path, damage):
    _, ref_losses, ref_params = reference
    a = Trainer(_cfg(checkpoint_interval=3), tmp_path, quiet=True)
    a.fit(steps=7)  # checkpoints at 3, 6 and 7 (end)
    a.close()
    newest = tmp_path / "checkpoints" / "step_00000007.rank0.safetensors"
    data = newest.read_bytes()
    if damage == "truncate":
        newest.write_bytes(data[: len(data) // 2])
    else:
        i = len(data) - 100
        newest.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:])
    b = Trainer(_cfg(checkpoint_interval=3), tmp_path, resume=True, quiet=True)
    assert b.step == 6 and b.resumed_from.endswith("step_00000006.rank0.safetensors")
    b.fit()
    b.close()
    assert _losses(tmp_path) == ref_losses
    for n, p in _params(b).items():
        assert np.array_equal(p, ref_params[n]), n


def test_resume_without_checkpoint_starts_at_zero(tmp_path):
    tr = Trainer(micro_config(steps=1), tmp_path, resume=True, quiet=True)
    assert tr.step == 0
    tr.close()


def _poison_grad(tr, name, when):
    """Make ``name``'s gradient NaN on the steps in ``when`` (a post-accumulate-grad hook)."""
    p = dict(tr.model.named_parameters())[name]

    def hook(t):
        if tr.step in when:
            t.grad._data[...] = np.nan

    p.register_post_accumulate_grad_hook(hook)


def test_nan_stop_names_step_and_tensor(tmp_path):
    tr = Trainer(micro_config(), tmp_path, quiet=True)
    _poison_grad(tr, "blocks.1.mlp.c_fc.weight", {2})
    with pytest.raises(NonFiniteError, match=r"step 2: non-finite grad of blocks\.1\.mlp\.c_fc\.weight"):
        tr.fit()
    tr.close()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_nan_loss_stop_names_loss(tmp_path):
    tr = Trainer(micro_config(), tmp_path, quiet=True)
    tr.model.ln_f.weight._data[0] = np.inf
    with pytest.raises(NonFiniteError, match=r"step 0: non-finite loss"):
        tr.fit()
    tr.close()


def test_nan_skip_drops_step(tmp_path):
    tr = Trainer(micro_config(nan_policy="skip", steps=4), tmp_path, quiet=True)
    _poison_grad(tr, "wpe.weight", {1})
    recs = []
    for _ in range(4):
        p0 = _params(tr)
        rec = tr.train_step()
        recs.append(rec)
        changed = any(not np.array_equal(p0[n], p) for n, p in _params(tr).items())
        assert changed == (tr.step != 1)
        tr.step += 1
    assert recs[1].get("skipped") is True and "skipped" not in recs[2]
    assert all(np.isfinite(p).all() for p in _params(tr).values())
    tr.close()


def test_auto_prepare_when_data_missing(tmp_path):
    cfg = micro_config(steps=2, eval_interval=0)
    cfg.data.dir = ""
    cfg.data.max_bytes = 100_000
    cfg.data.vocab_size = 300
    cfg.data.tokenizer = "bpe"
    cfg.model.vocab_size = 0
    tr = Trainer(cfg, tmp_path, quiet=True)
    assert (tmp_path / "data" / "meta.json").is_file()
    assert tr.model.config.vocab_size == 300 and tr.model.wte.weight.shape[0] == 320
    tr.fit()
    tr.close()
    assert len(_losses(tmp_path)) == 2


def test_model_vocab_smaller_than_data_is_an_error(tmp_path):
    from blumodels.config import ConfigError

    cfg = micro_config()
    cfg.model.vocab_size = 100
    with pytest.raises(ConfigError, match=r"model\.vocab_size=100 is smaller than the data's vocabulary \(512"):
        Trainer(cfg, tmp_path, quiet=True)


def test_data_fixture_is_real_text():
    meta = json.loads((micro_data() / "meta.json").read_text())
    assert meta["vocab_size"] == 512 and meta["train_tokens"] > 10_000


def test_new_run_in_old_directory_starts_clean(tmp_path):
    tr = Trainer(micro_config(steps=4, eval_interval=0), tmp_path, quiet=True)
    tr.fit()
    tr.close()
    first = _losses(tmp_path)
    with pytest.raises(ConfigError, match=r"holds an earlier run's checkpoints \(1 on this rank, newest "
                                          r"step_00000004.rank0.safetensors\): pass --resume .* or --overwrite"):
        Trainer(micro_config(steps=2, eval_interval=0), tmp_path, quiet=True)  # would delete them: refused
    assert _losses(tmp_path) == first  # nothing was touched
    with pytest.raises(ConfigError, match="contradict"):
        Trainer(micro_config(steps=2, eval_interval=0), tmp_path, resume=True, overwrite=True, quiet=True)
    tr = Trainer(micro_config(steps=2, eval_interval=0), tmp_path, quiet=True, overwrite=True)  # a new run
    assert tr.step == 0 and not tr.ckpt.list()
    tr.fit()
    tr.close()
    assert _losses(tmp_path) == first[:2]  # same seed, same data: the same first two steps, nothing appended
    assert [p.name for p in tr.ckpt.list()] == ["step_00000002.rank0.safetensors"]


def test_progress_bar_only_when_asked(tmp_path, capsys):
    """tqdm bar (elapsed<remaining, rate) when asked; validation lines are printed above it, not overwritten;
    plain lines with elapsed time and ETA otherwise."""
    tr = Trainer(micro_config(steps=3, eval_interval=2), tmp_path / "a", progress=True)
    tr.fit()
    tr.close()
    out = capsys.readouterr().out
    assert "\rtrain:" in out and "3/3 [" in out and "step/s" in out and "<00:00" in out
    val_lines = [ln for ln in out.split("\n") if " val " in ln]
    assert len(val_lines) == 2 and all(ln.split("\r")[-1].startswith("step ") for ln in val_lines)
    tr = Trainer(micro_config(steps=2, eval_interval=0), tmp_path / "b", progress=False)
    tr.fit()
    tr.close()
    out = capsys.readouterr().out
    assert "\r" not in out and "step 2/2 loss" in out and "elapsed" in out and "ETA" in out


def test_deterministic_key_sets_the_switch(tmp_path):
    """train.deterministic turns blutensor's deterministic-algorithms switch on inside the run's methods (and off
    for the default); the process outside the Trainer is left as it was."""
    import blutensor as bt
    from blumodels.config import ConfigError, from_dict

    try:
        tr = Trainer(micro_config(steps=1, deterministic=True), tmp_path / "a", quiet=True)
        assert tr.policy.deterministic and not bt.are_deterministic_algorithms_enabled()
        with tr.policy.use():
            assert bt.are_deterministic_algorithms_enabled()
        tr.close()
        tr = Trainer(micro_config(steps=1), tmp_path / "b", quiet=True)
        assert not tr.policy.deterministic
        with tr.policy.use():
            assert not bt.are_deterministic_algorithms_enabled()
        tr.close()
        with pytest.raises(ConfigError, match=r"train\.deterministic"):
            from_dict({"train": {"deterministic": "sometimes"}})
    finally:
        bt.use_deterministic_algorithms(False)


def test_threads_key_sets_the_cpu_threads(tmp_path):
    """train.threads reaches bt.set_num_threads; 0 keeps blutensor's default; a negative count is refused by name."""
    import blutensor as bt
    from blumodels.config import ConfigError, from_dict

    before = bt.get_num_threads()
    try:
        tr = Trainer(micro_config(steps=1, threads=1), tmp_path / "a", quiet=True)
        assert bt.get_num_threads() == 1
        tr.close()
        bt.set_num_threads(3)  # as a launcher would: train.threads = 0 keeps it
        tr = Trainer(micro_config(steps=1), tmp_path / "b", quiet=True)
        assert bt.get_num_threads() == 3
        tr.close()
        with pytest.raises(ConfigError, match=r"train\.threads"):
            from_dict({"train": {"threads": -2}}).validate()
    finally:
        bt.set_num_threads(before)
