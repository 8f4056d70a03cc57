"""Seeded fuzzing of what users hand the Trainer: config files and overrides, and checkpoint files. Every case
ends in a named error (ConfigError / CheckpointError) or a valid result inside the documented bounds, never
another exception (a traceback) or an endless run; the whole file runs in seconds."""

import json
import random
import struct
import time

import numpy as np
import pytest
from blumodels import cli
from blumodels.checkpoint.format import CheckpointError, load_checkpoint, save_checkpoint
from blumodels.config import UPPER_BOUNDS, ConfigError, RunConfig, apply_overrides, load_config
from blumodels.limits import check_fits

KEYS = {sec: list(UPPER_BOUNDS[sec]) + extra for sec, extra in (
    ("model", ["family", "dropout", "bias"]),
    ("train", ["nan_policy", "precision", "device", "sample_prompt", "async_checkpoint", "beta1"]),
    ("data", ["dir", "tokenizer", "corpus", "val_fraction"]))}
NASTY = [0, -1, 1, 2, 3, 7, 64, 1e30, -1e30, 1e9, 2**64 + 1, 2**63, 10**400, 0.5, float("nan"), float("inf"),
         True, "x", "", "1e400", "18446744073709551617", "nan", "-0", "a" * 5000, [1, 2], {"a": 1}, None]


def _toml_value(v):
    if v is None:
        return '"none"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if v != v else ("inf" if v == float("inf") else "-inf" if v == -float("inf") else repr(v))
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return "{ a = 1 }"


def _random_toml(rng):
    kind = rng.random()
    if kind < 0.05:
        return "x = " + "{ a = " * 600 + "1" + " }" * 600  # 600-deep inline tables
    if kind < 0.10:
        return "[model]\nn_layer = [" * 3 + "\x00\xff"
    lines = []
    for sec in rng.sample(list(KEYS), rng.randint(1, 3)):
        lines.append(f"[{sec if rng.random() > 0.05 else sec + 'x'}]")
        for key in rng.sample(KEYS[sec], rng.randint(1, 4)):
            lines.append(f"{key if rng.random() > 0.05 else key + '_'} = {_toml_value(rng.choice(NASTY))}")
    return "\n".join(lines) + "\n"


def _check_valid(cfg: RunConfig):
    for sec, bounds in UPPER_BOUNDS.items():
        for k, hi in bounds.items():
            v = getattr(getattr(cfg, sec), k)
            assert 0 <= v <= hi, (sec, k, v)
    check_fits(cfg, "cpu")


def test_fuzzed_configs_give_a_named_error_or_a_bounded_config(tmp_path):
    rng = random.Random(1234)
    t0 = time.monotonic()
    outcomes = {"error": 0, "valid": 0}
    for i in range(300):
        p = tmp_path / f"c{i}.toml"
        p.write_bytes(_random_toml(rng).encode("utf-8", "surrogateescape"))
        try:
            cfg = load_config(p)
            if rng.random() < 0.5:
                sec = rng.choice(list(KEYS))
                cfg = apply_overrides(cfg, [f"{sec}.{rng.choice(KEYS[sec])}={rng.choice(NASTY)}"])
            _check_valid(cfg)
            outcomes["valid"] += 1
        except ConfigError as e:
            assert "Traceback" not in str(e) and len(str(e)) < 2000
            outcomes["error"] += 1
    assert outcomes["error"] > 100 and time.monotonic() - t0 < 20


@pytest.mark.parametrize("argv,code,msg", [
    (["train", "--preset", ""], 2, "unknown preset ''"),
    (["train", "--config", ""], 2, "config file name is empty"),
    (["train", "--preset", "tiny", "model.n_layer=1e30"], 2,
     "model.n_layer=10000000...(31 digits) is past its bound of 4096"),
    (["train", "--preset", "tiny", "train.eval_steps=1e9"], 2, "train.eval_steps=1000000000 is past its bound"),
    (["train", "--preset", "tiny", "train.sample_tokens=1000000000"], 2, "train.sample_tokens"),
    (["train", "--preset", "tiny", "train.seed=18446744073709551617"], 2, "train.seed=18446744073709551617"),
    (["train", "--preset", "tiny", "data.dir=" + "d" * 5000], 2, "data.dir is 5000 characters long"),
    (["train", "--preset", "tiny", "model.block_size=2000000", "model.d_model=65536", "model.n_head=64",
      "--device", "cpu"], 2, "this run needs at least"),
])
def test_cli_gives_one_line_and_exit_2(tmp_path, capsys, argv, code, msg):
    rc = cli.main(argv + (["--out", str(tmp_path / "run")] if "--out" not in argv else []))
    err = capsys.readouterr().err
    assert rc == code and msg in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_fuzzed_cli_gives_one_line_or_a_bounded_config(tmp_path, capsys, monkeypatch):
    """150 seeded `blutrain train` command lines (flags with hostile values, random config files, overrides): each
    ends in exit 2 with one error line (argparse's usage line before it) or reaches the Trainer with a config inside
    every bound; the Trainer is replaced by a recorder, so nothing trains."""
    import blumodels.trainer

    class Reached(Exception):
        pass

    def fake_trainer(cfg, out, **kw):
        _check_valid(cfg)
        raise Reached

    monkeypatch.setattr(blumodels.trainer, "Trainer", fake_trainer)
    rng = random.Random(99)
    values = [str(v) for v in NASTY if not isinstance(v, list | dict)] + ["tiny", "gpt2-124m", "cpu", "cuda:7"]
    outcomes = {"refused": 0, "valid": 0}
    t0 = time.monotonic()
    for i in range(150):
        argv = ["train", "--out", str(tmp_path / f"r{i}")]
        for _ in range(rng.randint(1, 4)):
            r = rng.random()
            if r < 0.2:
                argv += ["--preset", rng.choice(["tiny", "", "nope", "gpt2-124m", "a" * 300])]
            elif r < 0.35:
                argv += [rng.choice(["--steps", "--stop-at"]), rng.choice(values)]
            elif r < 0.45:
                argv += ["--device", rng.choice(values)]
            elif r < 0.6:
                c = tmp_path / f"c{i}.toml"
                c.write_bytes(_random_toml(rng).encode("utf-8", "surrogateescape"))
                argv += ["--config", str(c)]
            else:
                sec = rng.choice(list(KEYS))
                argv.append(f"{sec}.{rng.choice(KEYS[sec])}={_toml_value(rng.choice(NASTY)).strip(chr(34))}")
        try:
            rc = cli.main(argv)
        except Reached:
            outcomes["valid"] += 1
            continue
        except SystemExit as e:  # argparse: usage, then one error line
            rc = e.code
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if x.strip() and not x.startswith(("usage:", " "))]
        assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (argv, err[-2000:])
        outcomes["refused"] += 1
    assert outcomes["refused"] > 50 and outcomes["valid"] >= 5 and time.monotonic() - t0 < 30, outcomes


def test_deep_toml_is_a_config_error(tmp_path):
    p = tmp_path / "deep.toml"
    p.write_text("x = " + "{ a = " * 2000 + "1" + " }" * 2000)
    with pytest.raises(ConfigError, match="nested too deeply|invalid TOML"):
        load_config(p)


# ------------------------------------------------------------------ checkpoint files
def _valid(tmp_path):
    rng = np.random.default_rng(0)
    p = tmp_path / "c.safetensors"
    save_checkpoint(p, {"a": rng.standard_normal((4, 3)).astype(np.float32), "b": np.arange(5),
                        "c": np.zeros(3, np.float16)}, {"step": 3})
    return p, p.read_bytes()


def _rewrite_header(raw, fn):
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8:8 + n])
    head = fn(head)
    h = (head if isinstance(head, str) else json.dumps(head)).encode()
    h += b" " * (-(len(h) + 8) % 8)
    return struct.pack("<Q", len(h)) + h + raw[8 + n:]


HEADER_ATTACKS = {
    "deep": lambda h: json.dumps(h)[:-1] + ', "x": ' + "[" * 5000 + "]" * 5000 + "}",
    "overflow": lambda h: {**h, "a": {**h["a"], "shape": [2**62, 2**62]}},
    "overlap": lambda h: {**h, "b": {**h["b"], "data_offsets": [h["a"]["data_offsets"][0],
                                                               h["a"]["data_offsets"][0] + 40]}},
    "gap": lambda h: {k: v for k, v in h.items() if k != "c"},
    "negative": lambda h: {**h, "a": {**h["a"], "shape": [-4, -3]}},
    "bool_shape": lambda h: {**h, "a": {**h["a"], "shape": [True, 3]}},
    "float_offsets": lambda h: {**h, "a": {**h["a"], "data_offsets": [0.0, 48.5]}},
    "bad_dtype": lambda h: {**h, "a": {**h["a"], "dtype": "C64"}},
    "extra_key": lambda h: {**h, "a": {**h["a"], "evil": 1}},
    "not_dict": lambda h: {**h, "a": [1, 2, 3]},
}


@pytest.mark.parametrize("attack", sorted(HEADER_ATTACKS))
def test_hostile_checkpoint_headers_are_named_errors(tmp_path, attack):
    p, raw = _valid(tmp_path)
    p.write_bytes(_rewrite_header(raw, HEADER_ATTACKS[attack]))
    with pytest.raises(CheckpointError, match=str(p).replace(".", r"\.")):
        load_checkpoint(p)


def test_random_checkpoint_mutations_are_named_errors(tmp_path):
    p, raw = _valid(tmp_path)
    rng = random.Random(7)
    t0 = time.monotonic()
    for _ in range(300):
        b = bytearray(raw)
        how = rng.random()
        if how < 0.4:
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        elif how < 0.6:
            b = b[:rng.randrange(len(b))]
        elif how < 0.8:
            i = rng.randrange(len(b))
            b = b[:i] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))) + b[i:]
        else:
            b[:8] = struct.pack("<Q", rng.choice([0, 1, 7, 2**40, 2**63, len(b), len(b) - 8]))
        p.write_bytes(bytes(b))
        try:
            tensors, meta = load_checkpoint(p)
        except CheckpointError:
            continue
        assert bytes(b) == raw or meta["step"] == 3  # only a no-op mutation (or a padding byte) loads
    assert time.monotonic() - t0 < 20


# ------------------------------------------------------------------ data directories
def test_fuzzed_data_directories_give_named_errors(tmp_path):
    import shutil

    from blumodels.cli import _input_errors
    from blumodels.data.shards import list_shards
    from blumodels.trainer import Trainer
    from models_helpers import micro_config, micro_data

    named = (ConfigError, *_input_errors())
    rng = random.Random(11)
    src = micro_data()
    t0 = time.monotonic()
    for i in range(40):
        d = tmp_path / f"d{i}"
        shutil.copytree(src, d)
        how = rng.randrange(5)
        shards = list_shards(d, "train") + list_shards(d, "val")
        if how == 0:  # meta.json damaged or of another shape
            meta = json.loads((d / "meta.json").read_text())
            key = rng.choice(list(meta))
            meta[key] = rng.choice(NASTY[:-3])
            (d / "meta.json").write_text(json.dumps(meta, default=str))
        elif how == 1:  # a shard's bytes flipped
            p = rng.choice(shards)
            b = bytearray(p.read_bytes())
            for _ in range(rng.randint(1, 3)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            p.write_bytes(bytes(b))
        elif how == 2:  # a shard truncated
            p = rng.choice(shards)
            p.write_bytes(p.read_bytes()[:rng.randrange(p.stat().st_size)])
        elif how == 3:  # the tokenizer damaged
            (d / "tokenizer.json").write_bytes(bytes(rng.randrange(256) for _ in range(rng.randint(0, 64))))
        else:  # a shard removed
            rng.choice(shards).unlink()
        try:
            Trainer(micro_config(d, steps=2, sample_tokens=4 if how == 3 else 0), tmp_path / f"r{i}",
                    quiet=True).close()
        except named as e:
            assert "Traceback" not in str(e) and len(str(e)) < 2000
    assert time.monotonic() - t0 < 30
