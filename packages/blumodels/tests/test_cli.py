"""The `blutrain` CLI: train/resume/sample/eval on the micro config, plugins table, config errors."""

import json

import pytest
from blumodels.cli import main, plugin_rows
from models_helpers import micro_data

MICRO = ["model.n_layer=2", "model.n_head=2", "model.d_model=32", "model.block_size=32", "train.seq_len=32",
         "train.micro_batch=4", "train.batch_tokens=128", "train.eval_interval=3", "train.eval_steps=2",
         "train.checkpoint_interval=3", "train.sample_tokens=8", "train.warmup_steps=1", "train.plot=true"]


def _log(out):
    return [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]


def test_train_resume_sample_eval(tmp_path, capsys):
    out = tmp_path / "run"
    data = str(micro_data())
    assert main(["train", "--preset", "tiny", "--device", "cpu", "--steps", "4", "--out", str(out),
                 "--data", data, *MICRO]) == 0
    text = capsys.readouterr().out
    assert "sample:" in text and "4 steps in" in text
    recs = _log(out)
    assert [r["step"] for r in recs] == [0, 1, 2, 3] and all("loss" in r for r in recs)
    assert (out / "loss.png").stat().st_size > 1000
    assert (out / "checkpoints" / "step_00000004.rank0.safetensors").is_file()
    # resume to 6 steps: config comes back from the run directory
    assert main(["train", "--out", str(out), "--resume", "--steps", "6", "--quiet"]) == 0
    assert [r["step"] for r in _log(out)] == list(range(6))
    assert main(["sample", "--out", str(out), "--tokens", "5", "--prompt", "def "]) == 0
    first = capsys.readouterr().out
    assert first.startswith("def ")
    assert main(["sample", "--out", str(out), "--tokens", "5", "--prompt", "def ", "--cuda-graph", "false"]) == 0
    assert capsys.readouterr().out == first  # the eager decode step: the same tokens
    assert main(["sample", "--out", str(out), "--tokens", "5", "--cuda-graph", "true"]) == 2
    assert "--cuda-graph true cannot capture the decode step: the model is on 'cpu'" in capsys.readouterr().err
    assert main(["eval", "--out", str(out), "--batches", "2"]) == 0
    ev = json.loads(capsys.readouterr().out)
    assert ev["step"] == 6 and ev["val_loss"] > 0


def test_plugins_table_lists_gpt2(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["KIND", "NAME", "PACKAGE", "VERSION"]
    rows = plugin_rows()
    assert ("model", "gpt2", "blumodels", "0.1.0") in rows
    assert any(r[0] == "kernel" and r[2] == "blutensor" for r in rows)
    assert any(ln.split()[:3] == ["model", "gpt2", "blumodels"] for ln in out)


def test_presets_listing(capsys):
    assert main(["presets"]) == 0
    text = capsys.readouterr().out
    assert "gpt2-124m" in text and "124.5M" in text and "tiny" in text and "0.9M" in text


def test_config_error_exit_code(tmp_path, capsys):
    assert main(["train", "--preset", "tiny", "--out", str(tmp_path), "model.n_head=3"]) == 2
    assert "model.n_head=3 does not divide model.d_model=128" in capsys.readouterr().err
    assert main(["train", "--preset", "tiny", "--out", str(tmp_path), "train.bogus=1"]) == 2
    assert "train.bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["nonsense"])


def test_device_auto_resolves_to_cpu_here():
    import blutensor as bt
    from blumodels.trainer import resolve_device

    assert resolve_device("auto") == ("cuda" if bt.cuda.is_available() else "cpu")
    if not bt.cuda.is_available():
        from blumodels.config import ConfigError

        with pytest.raises(ConfigError, match="no CUDA GPU"):
            resolve_device("cuda")


def test_model_family_plugin_builds_gpt2():
    from blumodels.config import ModelConfig
    from blumodels.gpt2 import GPT2
    from blutensor.ext import get_host

    fam = get_host().registry("model").get("gpt2")
    assert "tiny" in fam.presets() and "gpt2-124m" in fam.presets()
    m = fam.build(ModelConfig(n_layer=1, n_head=2, d_model=16, block_size=8, vocab_size=65), seed=0)
    assert isinstance(m, GPT2) and m.wte.weight.shape[0] == 128


def test_step_end_hook_receives_metrics(tmp_path):
    import pluggy
    from blumodels.trainer import Trainer
    from blutensor.ext import get_host
    from models_helpers import micro_config

    seen = []

    class Recorder:
        @pluggy.HookimplMarker("blutrain")
        def blutrain_on_step_end(self, step, metrics):
            seen.append((step, metrics["loss"]))

        @pluggy.HookimplMarker("blutrain")
        def blutrain_on_checkpoint_saved(self, path, step):
            seen.append(("saved", step))

    rec = Recorder()
    host = get_host()
    host.pm.register(rec)
    try:
        tr = Trainer(micro_config(steps=2, eval_interval=0, checkpoint_interval=0), tmp_path, quiet=True)
        tr.fit()
        tr.close()
    finally:
        host.pm.unregister(rec)
    assert [s for s in seen if s[0] != "saved"] == [(r["step"], r["loss"]) for r in tr.history]
    assert ("saved", 2) in seen


def test_cpu_runs_use_one_blas_thread_unless_told(monkeypatch):
    import argparse
    import sys

    from blumodels.cli import BLAS_THREAD_VARS, limit_cpu_blas_threads

    for v in BLAS_THREAD_VARS:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.delitem(sys.modules, "numpy")  # pretend NumPy is not loaded yet (restored afterwards)
    args = argparse.Namespace(cmd="train", device="cpu")
    assert limit_cpu_blas_threads(args) and __import__("os").environ["OPENBLAS_NUM_THREADS"] == "1"
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    assert not limit_cpu_blas_threads(args)
    monkeypatch.delenv("OPENBLAS_NUM_THREADS")
    assert not limit_cpu_blas_threads(argparse.Namespace(cmd="plugins"))
    assert limit_cpu_blas_threads(argparse.Namespace(cmd="profile", device="cpu"))  # profiles what train runs
    monkeypatch.delenv("OPENBLAS_NUM_THREADS")
    assert not limit_cpu_blas_threads(argparse.Namespace(cmd="train", device="cuda"))
    import blutensor as bt

    # --device auto on a machine without a GPU (CuPy installed or not): one thread too
    assert limit_cpu_blas_threads(argparse.Namespace(cmd="train", device=None)) == (not bt.cuda.is_available())


def test_prepare_command(tmp_path, capsys):
    src = tmp_path / "notes.txt"
    src.write_text("A small text file about token shards and checkpoints. " * 200)
    out = tmp_path / "data"
    assert main(["prepare", "--out", str(out), "--source", str(src), "--tokenizer", "bpe", "--vocab-size", "300",
                 "--max-bytes", "50000"]) == 0
    meta = json.loads(capsys.readouterr().out)
    assert meta["vocab_size"] == 300 and (out / "meta.json").is_file() and meta["train_tokens"] > 0


def test_profile_command_writes_table_trace_and_png(tmp_path, capsys):
    pytest.importorskip("bluprofiler")
    out = tmp_path / "prof"
    assert main(["profile", "--preset", "tiny", "--device", "cpu", "--steps", "1", "--out", str(out),
                 "--data", str(micro_data()), *MICRO]) == 0
    text = capsys.readouterr().out
    assert "linear.forward" in text and "linear.backward" in text
    trace = json.loads((out / "profile" / "trace.json").read_text())
    assert any(e.get("name") == "linear.forward" for e in trace["traceEvents"])
    assert (out / "profile" / "summary.txt").is_file()
    assert (out / "profile" / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_presets_in_size_order_with_parameter_counts(capsys):
    from blumodels.config import load_preset, preset_names
    from blumodels.gpt2 import count_params

    assert main(["presets"]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines()[1:]]
    names = [r[0] for r in rows]

    def n(name):
        c = load_preset(name)
        c.model.vocab_size = c.model.vocab_size or c.data.vocab_size
        return count_params(c.model)

    assert sorted(names) == sorted(preset_names())
    assert names == sorted(names, key=n) and names != sorted(names)  # 'gpt2-1.5b' would sort before '124m'
    assert rows[names.index("gpt2-1.5b")][-1] == "1.56B"


def test_overrides_anywhere_on_the_command_line():
    from blumodels.cli import parse_args

    a = parse_args(["train", "train.lr=1e-3", "--steps", "2", "model.n_layer=2", "--out", "r", "data.seed=3"])
    assert a.overrides == ["train.lr=1e-3", "model.n_layer=2", "data.seed=3"] and a.steps == 2 and a.out == "r"
    a = parse_args(["sample", "--prompt", "x.y=z", "--out", "r", "train.top_k=5"])
    assert a.prompt == "x.y=z" and a.overrides == ["train.top_k=5"]  # an option's value stays the option's
    with pytest.raises(SystemExit):
        parse_args(["train", "train.lr=1", "--nope"])
    with pytest.raises(SystemExit):
        parse_args(["prepare", "--out", "d", "train.lr=1"])


def test_prepare_command_on_parquet(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = [f"Row {i}: a document about shards, tokens and checkpoints. " * (3 + i % 5) for i in range(60)]
    pq.write_table(pa.table({"url": [f"u{i}" for i in range(60)], "body": texts}), tmp_path / "t.parquet")
    out = tmp_path / "data"
    assert main(["prepare", "--out", str(out), "--source", str(tmp_path / "t.parquet"), "--text-field", "body",
                 "--corpus", "none", "--tokenizer", "bpe", "--vocab-size", "300", "--format", "llmc"]) == 0
    meta = json.loads(capsys.readouterr().out)
    assert meta["train_documents"] + meta["val_documents"] == 60 and meta["shard_format"] == "llmc"
    assert main(["prepare", "--out", str(tmp_path / "e"), "--source", str(tmp_path / "t.parquet"),
                 "--corpus", "none"]) == 1
    assert "no column 'text' (columns: url, body)" in capsys.readouterr().err
