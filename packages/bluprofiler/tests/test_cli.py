"""profile_steps / profile_main / sinks through the plugin host."""

from __future__ import annotations

import importlib.util
import json

import blutensor as bt
import pytest
from bluprofiler.cli import profile_main
from bluprofiler.run import profile_steps

HAS_MPL = importlib.util.find_spec("matplotlib") is not None


def make_step(config=None):
    """A step factory for --step (config: the hidden width)."""
    w = bt.randn(16, int(config or 8), requires_grad=True)

    def step():
        loss = bt.sum(bt.tanh(bt.matmul(bt.randn(4, 16), w)))
        loss.backward()
        w.grad = None
        return loss.item()

    return step


def test_profile_steps_writes_everything(tmp_path):
    s = profile_steps(make_step(), 3, tmp_path, warmup=1, device="cpu")
    assert s["n_steps"] == 3 and len(s["step_ms_each"]) == 3 and len(s["losses"]) == 3
    for f in ("summary.txt", "summary.json", "trace.json", "events.jsonl") + (("memory.png",) if HAS_MPL else ()):
        assert (tmp_path / f).stat().st_size > 0, f
    rows = {r["name"]: r for r in s["rows"]}
    assert rows["matmul.forward"]["calls"] == 3 and rows["tanh.backward"]["calls"] == 3
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    kinds = [json.loads(ln)["type"] for ln in lines]
    assert kinds.count("op") == sum(r["calls"] for r in s["rows"]) + 3  # op spans + 3 step regions
    assert "mem" in kinds
    if HAS_MPL:
        assert (tmp_path / "memory.png").read_bytes()[:4] == b"\x89PNG"
    else:
        assert s["files"]["memory-png"].startswith("skipped: bluprofiler's memory plot needs matplotlib")
    with pytest.raises(ValueError, match="n_steps"):
        profile_steps(make_step(), 0, tmp_path)


def test_profile_main_with_factory_and_demo(tmp_path, capsys):
    assert profile_main(["--step", "test_cli:make_step", "--config", "12", "--steps", "2", "--device", "cpu",
                         "--out", str(tmp_path / "a"), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "matmul.forward" in out and "wrote" in out
    assert not (tmp_path / "a" / "memory.png").exists()
    assert profile_main(["--demo", "tiny", "--steps", "1", "--device", "cpu", "--out", str(tmp_path / "b")]) == 0
    s = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert s["workload"] == "demo:tiny"
    trace = json.loads((tmp_path / "b" / "trace.json").read_text())
    regions = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "region"}
    assert regions == {"step", "forward", "backward", "optimizer"}
    with pytest.raises(SystemExit):
        profile_main(["--step", "nocolon", "--out", str(tmp_path)])


def test_sinks_registered_through_the_plugin_host():
    from blutensor.ext import reset_host

    host = reset_host()
    reg = host.registry("profiler_sink")
    assert {"chrome-trace", "table", "jsonl"} <= set(reg.names())
    from bluprofiler.sinks import get_sink

    assert get_sink("jsonl").PLUGIN_NAME == "jsonl"


def test_events_jsonl_rebuilds_the_result(tmp_path):
    from bluprofiler.plot import main as plot_main
    from bluprofiler.sinks import load_jsonl

    s = profile_steps(make_step(), 2, tmp_path, device="cpu", plot=False)
    res = load_jsonl(tmp_path / "events.jsonl")
    assert [r["calls"] for r in res.summary()] == [r["calls"] for r in s["rows"]]
    assert res.peak_memory()["peak_bytes"] == s["memory"]["peak_bytes"]
    assert res.step_ms() == pytest.approx(s["step_ms"], rel=1e-6)
    if HAS_MPL:
        assert plot_main([str(tmp_path)]) == 0 and (tmp_path / "memory.png").exists()


def test_plot_cli_help_and_missing_folder(tmp_path, capsys):
    """`python -m bluprofiler.plot --help` prints usage (it used to take '--help' for the folder and crash);
    a folder without events.jsonl is named in a one-line error, exit status 2."""
    from bluprofiler.plot import main as plot_main

    with pytest.raises(SystemExit) as e:
        plot_main(["--help"])
    assert e.value.code == 0 and "out_dir" in capsys.readouterr().out
    assert plot_main([str(tmp_path / "nothing")]) == 2
    assert "nothing/events.jsonl does not exist" in capsys.readouterr().out
