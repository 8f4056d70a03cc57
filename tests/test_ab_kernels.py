"""benchmarks/kernels/ab_kernels.py: each revision's kernel files are in place while its timing runs, the rounds
interleave the revisions, the working tree's files come back afterwards, and the summary takes medians."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("ab_kernels", ROOT / "benchmarks/kernels/ab_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


STUB = """
import json, sys, pathlib
out = pathlib.Path(sys.argv[sys.argv.index("--out") + 1])
k = pathlib.Path(sys.argv[1])
v = float(k.read_text())
log = out.parent / "order.txt"
log.write_text((log.read_text() if log.exists() else "") + out.name + "\\n")
out.write_text(json.dumps({"rows": [{"shape": "s", "impl": "ours", "fwd_ms": v, "bwd_ms": 2 * v}]}))
"""


def test_prepare_run_summary_round_trip(tmp_path, monkeypatch):
    ab = _load()
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if git.returncode != 0:  # a source tree without its history
        return
    d = tmp_path / "ab"
    ab.prepare(d, ["HEAD", "."], ab.KERNELS, ["README.md"])
    meta = json.loads((d / "revs.json").read_text())
    rev, tree = meta["revs"]
    assert tree == "worktree" and meta["files"] == ["README.md"]
    assert (d / tree / "files" / "0").read_bytes() == (ROOT / "README.md").read_bytes()
    assert (d / tree / "sdpa_wgmma.cu").read_bytes() == (ROOT / ab.KERNELS / "sdpa_wgmma.cu").read_bytes()
    src = ROOT / ab.KERNELS / "sdpa_wgmma.cu"
    assert (d / rev / "sdpa_wgmma.cu").read_bytes() == subprocess.run(
        ["git", "show", f"{rev}:{ab.KERNELS}/sdpa_wgmma.cu"], cwd=ROOT, capture_output=True, check=True).stdout
    # two synthetic revisions over a scratch kernel folder: the stub reads the file that is in place
    kdir = tmp_path / "kernels"
    kdir.mkdir()
    (kdir / "k.cu").write_text("9")
    for name, val in (("a", "1"), ("b", "3")):
        (d / name).mkdir()
        (d / name / "k.cu").write_text(val)
    (d / "revs.json").write_text(json.dumps({"kernels": str(kdir), "revs": ["a", "b"]}))
    monkeypatch.setattr(ab, "ROOT", Path("/"))
    stub = tmp_path / "stub.py"
    stub.write_text(STUB)
    out = tmp_path / "out"
    assert ab.run(d, out, 2, [str(kdir / "k.cu")], stub) == 0
    assert (out / "order.txt").read_text().split() == ["a.0.json", "b.0.json", "a.1.json", "b.1.json"]
    assert (kdir / "k.cu").read_text() == "9"  # the tree's file is back
    doc = json.loads((out / "summary.json").read_text())
    assert doc == {"a": {"s | ours": {"fwd_ms": 1.0, "bwd_ms": 2.0}}, "b": {"s | ours": {"fwd_ms": 3.0, "bwd_ms": 6.0}}}
    assert src.is_file()


def test_run_refuses_an_unprepared_folder(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks/kernels/ab_kernels.py"), "run", str(tmp_path),
                        str(tmp_path / "out")], capture_output=True, text=True)
    assert p.returncode == 2 and "holds no prepared revisions" in p.stderr


def test_run_passes_what_follows_the_separator_to_the_timing_script(tmp_path):
    """Options after ``--`` reach the timing script untouched (``--rounds`` before it stays ab_kernels'), and a
    file switched with the kernels is each revision's while its run goes and the tree's afterwards."""
    kdir, d = tmp_path / "kernels", tmp_path / "ab"
    kdir.mkdir()
    host = tmp_path / "host.py"
    host.write_text("tree")
    for name in ("a", "b"):
        (d / name / "files").mkdir(parents=True)
        (d / name / "k.cu").write_text(name)
        (d / name / "files" / "0").write_text("host-" + name)
    (d / "revs.json").write_text(json.dumps({"kernels": str(kdir), "files": [str(host)], "revs": ["a", "b"]}))
    stub = tmp_path / "stub.py"
    stub.write_text(f"""
import json, sys, pathlib
out = pathlib.Path(sys.argv[sys.argv.index("--out") + 1])
seen = [sys.argv[1:sys.argv.index("--out")], pathlib.Path({str(host)!r}).read_text()]
out.write_text(json.dumps({{"seen": seen, "rows": []}}))
""")
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks/kernels/ab_kernels.py"), "run", str(d),
                        str(tmp_path / "out"), "--rounds", "1", "--bench", str(stub), "--", "--shape", "gpt2",
                        "--rounds", "7"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    for name in ("a", "b"):
        seen = json.loads((tmp_path / "out" / f"{name}.0.json").read_text())["seen"]
        assert seen == [["--shape", "gpt2", "--rounds", "7"], "host-" + name]
    assert host.read_text() == "tree" and not (tmp_path / "out" / "a.1.json").exists()
