"""Bad input to the profiler API and CLIs gets an error naming the argument, file and line at fault."""

from __future__ import annotations

import json

import blutensor as bt
import numpy as np
import pytest
from bluprofiler import ProfilerError, compare, load_dump, profile, profile_steps, record_function
from bluprofiler.precision import PrecisionError
from bluprofiler.sinks import load_jsonl


def _step():
    return (bt.tensor(np.ones(3, np.float32)) * 2).sum().item()


@pytest.mark.parametrize(("kw", "exc", "frag"), [
    ({"n_steps": 0}, ValueError, "n_steps must be >= 1, got 0"),
    ({"n_steps": "3"}, TypeError, "n_steps must be an int, got str '3'"),
    ({"n_steps": 1.5}, TypeError, "n_steps must be an int, got float 1.5"),
    ({"warmup": -1}, ValueError, "warmup must be >= 0, got -1"),
    ({"sinks": "table"}, TypeError, "sinks must be a list of sink names, got the string 'table'"),
    ({"sinks": ("tabel",)}, Exception, "no profiler_sink plugin named 'tabel'"),
    ({"step_fn": 3}, TypeError, "step_fn must be a callable, got int"),
])
def test_profile_steps_bad_arguments_fail_before_any_step(tmp_path, kw, exc, frag):
    calls = []

    def step():
        calls.append(1)
        return _step()

    args = {"step_fn": step, "n_steps": 1, "out_dir": tmp_path / "o", "plot": False, **kw}
    with pytest.raises(exc, match=frag):
        profile_steps(**args)
    assert calls == []


def test_profile_steps_out_dir_is_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("")
    with pytest.raises(NotADirectoryError, match="out_dir '.*afile' exists and is not a folder"):
        profile_steps(_step, 1, f, plot=False)


def test_nested_session_is_refused_and_reentry_works():
    with profile(), pytest.raises(ProfilerError, match="already active; sessions do not nest"):
        with profile():
            pass
    p = profile()
    for _ in range(2):
        with p:
            _step()
    assert p.result.events


@pytest.mark.parametrize("name", [3, None, b"fwd"])
def test_record_function_non_string_name(name):
    with pytest.raises(TypeError, match=f"record_function: name must be a str, got {type(name).__name__}"):
        with record_function(name):
            pass
    with profile() as p, pytest.raises(TypeError, match="must be a str"):
        with p.region(name):
            pass


def _write(path, text):
    path.write_text(text)
    return path


def test_load_jsonl_missing_and_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="load_jsonl: .*nope.jsonl does not exist"):
        load_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="is a folder, not an events.jsonl file"):
        load_jsonl(tmp_path)


@pytest.mark.parametrize(("text", "frag"), [
    ("", "no session header line"),
    ('{"type": "session", "t1": 1}\n{"type": "op", "na', r"events.jsonl:2: not a JSON line \(Unterminated string"),
    ("hello world\n", r"events.jsonl:1: not a JSON line \(Expecting value"),
    ('{"type": "session", "t1": 1}\n{"foo": 1}\n', "events.jsonl:2: expected a JSON object with a 'type' field"),
    ("[1, 2]\n", "events.jsonl:1: expected a JSON object with a 'type' field"),
    ('{"type": "session", "t1": 1}\n', "events.jsonl:1: the session header lacks 'wall0_ns'"),
    ('{"type": "op", "name": "mul"}\n', "events.jsonl:1: 'op' event lacks the field 'phase'"),
])
def test_load_jsonl_bad_content_names_file_and_line(tmp_path, text, frag):
    with pytest.raises(ValueError, match=frag):
        load_jsonl(_write(tmp_path / "events.jsonl", text))


def test_load_jsonl_round_trip_still_works(tmp_path):
    s = profile_steps(_step, 1, tmp_path, plot=False, device="cpu")
    res = load_jsonl(s["files"]["jsonl"])
    assert {e.name for e in res.events} >= {"step", "mul", "sum"} and res.device == "cpu"
    assert "jsonl" in json.loads((tmp_path / "summary.json").read_text())["files"]


def test_load_dump_bad_files(tmp_path):
    np.savez(tmp_path / "t.npz", a=np.ones(3))
    raw = (tmp_path / "t.npz").read_bytes()
    cases = {"empty.npz": b"", "trunc.npz": raw[:100], "bad.safetensors": b"garbage"}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(PrecisionError, match=f"load_dump: .*{name} \\({len(data)} bytes\\) is not a readable"):
            load_dump(tmp_path / name)
    with pytest.raises(PrecisionError, match="does not exist"):
        load_dump(tmp_path / "missing.npz")
    with pytest.raises(PrecisionError, match="is not a file"):
        (tmp_path / "d.npz").mkdir()
        load_dump(tmp_path / "d.npz")
    assert list(load_dump(tmp_path / "t.npz")) == ["a"]


def test_compare_bad_arguments():
    a = {"a": np.ones(3)}
    with pytest.raises(PrecisionError, match="rtol must be a number >= 0, got -1"):
        compare(a, a, rtol=-1)
    with pytest.raises(PrecisionError, match="atol must be a number >= 0, got nan"):
        compare(a, a, atol=float("nan"))
    with pytest.raises(PrecisionError, match="keys='\\[' is not a regular expression"):
        compare(a, a, keys="[")
    with pytest.raises(PrecisionError, match="no common keys"):
        compare(a, {"b": np.ones(3)})
    r = compare(a, {"a": np.ones(4)})
    assert not r.ok and "shape (3,) vs reference (4,)" in r.report()


@pytest.mark.parametrize(("argv", "frag"), [
    ([], "the following arguments are required: ours, reference"),
    (["{d}/x.npz", "{d}/y.npz"], "load_dump: .*x.npz does not exist"),
    (["{d}/e.npz", "{d}/t.npz"], "e.npz \\(0 bytes\\) is not a readable npz dump"),
    (["{d}/t.npz", "{d}/t.npz", "--keys", "["], "keys='\\[' is not a regular expression"),
    (["{d}/t.npz", "{d}/t.npz", "--adapter", "gpt2:bogus"], "source must be 'reference', 'hf' or 'nanogpt'"),
    (["{d}/t.npz", "{d}/t.npz", "--rtol", "-1"], "rtol must be a number >= 0"),
])
def test_compare_cli_usage_errors(tmp_path, capsys, argv, frag):
    from bluprofiler.compare import main

    np.savez(tmp_path / "t.npz", a=np.ones(3))
    (tmp_path / "e.npz").write_bytes(b"")
    with pytest.raises(SystemExit) as e:
        main([s.format(d=tmp_path) for s in argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err
    import re

    assert re.search(frag, err), err


def test_plot_cli_bad_events_file(tmp_path, capsys):
    from bluprofiler.plot import main

    _write(tmp_path / "events.jsonl", '{"type": "session"}\n{"type": "op", "na')
    assert main([str(tmp_path)]) == 2
    assert "events.jsonl:2: not a JSON line" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "frag"), [
    (["--demo", "tiny"], "the following arguments are required: --out"),
    (["--demo", "tiny", "--out", "{d}/o", "--steps", "0"], "argument --steps: must be >= 1, got 0"),
    (["--demo", "tiny", "--out", "{d}/o", "--steps", "x"], "argument --steps: expected an integer, got 'x'"),
    (["--demo", "tiny", "--out", "{d}/o", "--warmup", "-2"], "argument --warmup: must be >= 0, got -2"),
    (["--demo", "tiny", "--out", "{d}/o", "--device", "tpu"], "argument --device: expected cpu, cuda or cuda:N"),
    (["--demo", "tiny", "--out", "{d}/afile"], "--out '.*afile' exists and is not a folder"),
    (["--step", "os:getcwd", "--out", "{d}/o"], "--step os:getcwd: the factory returned str, not a step function"),
])
def test_bluprofile_cli_usage_errors(tmp_path, capsys, argv, frag):
    import re

    from bluprofiler.cli import profile_main

    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit) as e:
        profile_main([s.format(d=tmp_path) for s in argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and re.search(frag, err), err
    assert not (tmp_path / "o").exists()
