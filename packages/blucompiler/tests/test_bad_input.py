"""Bad input to compile() gets an error naming the option/argument at fault, before the step runs."""

from __future__ import annotations

import blucompiler
import blutensor as bt
import numpy as np
import pytest
from blucompiler import CompileError


def _x(v=1.0, n=3, dtype=np.float32):
    return bt.tensor(np.full(n, v, dtype))


def _f(a):
    return (a * 2).sum()


@pytest.mark.parametrize(("kw", "exc", "frag"), [
    ({"backend": "tpu"}, ValueError, "unknown backend 'tpu'; expected one of 'auto', 'c', 'cuda', 'numpy'"),
    ({"backend": None}, ValueError, "unknown backend None"),
    ({"force_eager": ["mull"]}, ValueError, "force_eager names unknown op 'mull' \\(did you mean 'mul'"),
    ({"force_eager": "mul"}, TypeError, "force_eager must be a list of op names, got the string 'mul'"),
    ({"force_eager": 3}, TypeError, "force_eager must be a list of op names, got int 3"),
    ({"force_eager": [len]}, TypeError, "force_eager entries must be op names \\(str\\), got builtin_function"),
    ({"cuda_graph": "yes"}, TypeError, "cuda_graph must be True or False, got 'yes'"),
])
def test_bad_options_are_refused_at_compile(kw, exc, frag):
    with pytest.raises(exc, match=frag):
        blucompiler.compile(_f, **kw)


def test_bad_options_through_bt_compile():
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        bt.compile(_f, options={"backend": "tpu"})
    with pytest.raises(ValueError, match="unknown op 'layernorm'"):
        bt.compile(_f, options={"force_eager": ("layernorm",)})


def test_known_force_eager_op_is_accepted():
    f = blucompiler.compile(_f, backend="numpy", force_eager=("mul",))
    assert f(_x(2.0)).item() == 12.0
    assert "force_eager" in f.report()["fallback_reasons"]["mul"]


def test_non_callable_is_refused():
    with pytest.raises(TypeError, match="expected a function to compile, got int 3"):
        blucompiler.compile(3)


def test_dump_path_that_is_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("")
    with pytest.raises(CompileError, match=f"dump='{f}' cannot be used as the MLIR dump folder"):
        blucompiler.compile(_f, backend="numpy", dump=str(f))


def test_env_dump_that_is_a_file_fails_before_the_step_runs(tmp_path, monkeypatch):
    f = tmp_path / "afile"
    f.write_text("")
    monkeypatch.setenv("BLU_COMPILER_DUMP", str(f))
    calls = []

    def step(a):
        calls.append(1)
        return (a * 2).sum()

    c = blucompiler.compile(step, backend="numpy")
    with pytest.raises(CompileError, match=r"\$BLU_COMPILER_DUMP='.*afile' cannot be used as the MLIR dump folder"):
        c(_x())
    assert calls == []  # nothing ran (an optimizer step would not be half-done)


def test_dump_folder_is_written(tmp_path):
    c = blucompiler.compile(_f, backend="numpy", dump=str(tmp_path / "d"))
    assert c(_x()).item() == 6.0
    assert (tmp_path / "d" / "00-traced.mlir").is_file()


def test_shape_and_dtype_changes_give_right_numbers():
    g = blucompiler.compile(_f, backend="numpy")
    assert g(_x(1.0, 3)).item() == 6.0
    assert g(_x(1.0, 5)).item() == 10.0
    assert g(_x(1.5, 5, np.float64)).item() == 15.0
    assert g(_x(3.0, 5)).item() == 30.0
    assert g.report()["retraces"][:2] == ["argument 0: shape (3,) -> (5,)", "argument 0: dtype float32 -> float64"]


def test_container_argument_holding_other_tensors_traces_again():
    """A list/dict argument mutated in place used to replay its old tensors (a silently wrong result)."""
    g = blucompiler.compile(lambda lst: (lst[0] * 2).sum(), backend="numpy")
    lst = [_x(1.0)]
    assert g(lst).item() == 6.0
    lst[0] = _x(5.0)
    assert g(lst).item() == 30.0
    d = {"x": _x(1.0)}
    h = blucompiler.compile(lambda d: (d["x"] * 2).sum(), backend="numpy")
    assert h(d).item() == 6.0
    d["x"] = _x(3.0, 4)
    assert h(d).item() == 24.0
    assert "the dict now holds other tensors" in h.report()["retraces"][0]
    d["x"] = _x(4.0, 4)
    assert h(d).item() == 32.0


def test_step_returning_non_tensors():
    h = blucompiler.compile(lambda a: {"loss": (a * 2).sum(), "n": 3, "tag": "x"}, backend="numpy")
    for k in (1.0, 2.0, 3.0):
        r = h(_x(k))
        assert r["loss"].item() == 6.0 * k and r["n"] == 3 and r["tag"] == "x"


def test_c_backend_without_a_compiler_falls_back_and_says_so(monkeypatch):
    import shutil

    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    c = blucompiler.compile(lambda a: (a * 2 + 1).sum(), backend="c")
    with pytest.warns(RuntimeWarning, match="backend 'c': no C compiler \\(cc/gcc not found\\)"):
        vals = [c(_x(k)).item() for k in (1.0, 2.0, 3.0)]
    assert vals == [9.0, 15.0, 21.0]
    rep = c.report()
    assert rep["backend"] == "numpy" and "no C compiler" in rep["backend_note"]


def test_cc_env_pointing_nowhere_warns_and_stays_correct(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("BLU_COMPILER_CACHE", str(tmp_path))
    from blucompiler import lower_c

    monkeypatch.setattr(lower_c, "_loaded", {})
    c = blucompiler.compile(lambda a: (a * 3 - 1).sum(), backend="auto")
    with pytest.warns(RuntimeWarning, match="\\$CC='/nonexistent/cc' not found"):
        vals = [c(_x(k)).item() for k in (1.0, 2.0, 3.0)]
    assert vals == [6.0, 15.0, 24.0]
    assert "FileNotFoundError" in c.report()["kernels"]["compile_error"]
