"""Time the kernel sources of several revisions side by side on one GPU, interleaved (A B A B ...), so that a kernel
change is judged against its predecessor under the same clocks, power cap and temperature (on the H200 the
attention kernels' times drift by a few percent from call to call, as much as a small change moves them).

    python3 benchmarks/kernels/ab_kernels.py prepare .ab REV [REV ...]        # with git: each REV's kernel files
    python3 benchmarks/kernels/ab_kernels.py prepare .ab HEAD . --file packages/blutensor/.../sdpa_wgmma.py
    python3 benchmarks/kernels/ab_kernels.py run .ab OUT_DIR [--rounds 2] -- --shape gpt2 --shape long --rows bf16
    python3 benchmarks/kernels/ab_kernels.py summary OUT_DIR

``prepare`` copies blutensor's ``kernels/`` (``--kernels`` for another folder) as each revision has it into
``DIR/<rev>/`` (``.`` is the working tree as it is, named ``worktree``; ``--file PATH`` adds a file outside the
folder, e.g. the host module whose launches a kernel change alters, kept under ``DIR/<rev>/files/``; ``.ab/`` is
ignored by git: carry it to a GPU machine with the wheels). ``run`` puts each revision's
files in place in turn, runs ``benchmarks/kernels/bench_attention.py`` with the arguments after ``--`` into
``OUT_DIR/<rev>.<round>.json``, restores the working tree's files, and prints ``summary``: per revision, shape and
row, the median over rounds of the graph-timed forward, backward and forward + backward (ms), also written to
``OUT_DIR/summary.json``. The loader caches compiled kernels by source hash, so revisions do not mix.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNELS = "packages/blutensor/src/blutensor/backends/cupy/kernels"
TIMES = ("fwd_ms", "bwd_ms", "fwdbwd_ms")


def _show(rev: str, path: str) -> bytes:
    return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, check=True).stdout


def prepare(d: Path, revs: list[str], kernels: str, files: list[str]) -> None:
    order = []
    for rev in revs:
        if rev == ".":
            short = "worktree"
            names = sorted(p.name for p in (ROOT / kernels).iterdir() if p.is_file())
            read = lambda path: (ROOT / path).read_bytes()  # noqa: E731
        else:
            full = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=ROOT,
                                  capture_output=True, text=True)
            if full.returncode != 0:
                raise SystemExit(f"ab_kernels: {rev!r} is not a revision of this repository")
            short = full.stdout.strip()[:10]
            names = subprocess.run(["git", "ls-tree", "--name-only", f"{short}:{kernels}"], cwd=ROOT,
                                   capture_output=True, text=True, check=True).stdout.split()
            read = lambda path, _r=short: _show(_r, path)  # noqa: E731
        out = d / short
        if out.exists():
            shutil.rmtree(out)
        (out / "files").mkdir(parents=True)
        for name in names:
            (out / name).write_bytes(read(f"{kernels}/{name}"))
        for i, path in enumerate(files):
            (out / "files" / f"{i}").write_bytes(read(path))
        order.append(short)
        print(f"{rev} -> {out} ({len(names)} kernel files, {len(files)} other)")
    (d / "revs.json").write_text(json.dumps({"kernels": kernels, "files": files, "revs": order}, indent=1))


def run(d: Path, out: Path, rounds: int, bench_args: list[str], bench: Path) -> int:
    meta = json.loads((d / "revs.json").read_text())
    kdir = ROOT / meta["kernels"]
    files = [ROOT / f for f in meta.get("files", [])]
    backup = {p: p.read_bytes() for p in kdir.iterdir() if p.is_file()}
    backup.update({p: p.read_bytes() for p in files})
    out.mkdir(parents=True, exist_ok=True)
    rc = 0
    try:
        for r in range(rounds):
            for rev in meta["revs"]:
                for p in (d / rev).iterdir():
                    if p.is_file():
                        shutil.copyfile(p, kdir / p.name)
                for i, dst in enumerate(files):
                    shutil.copyfile(d / rev / "files" / f"{i}", dst)
                cmd = [sys.executable, str(bench), *bench_args, "--out", str(out / f"{rev}.{r}.json")]
                res = subprocess.run(cmd, cwd=ROOT)
                print(f"== {rev} round {r}: rc {res.returncode}", flush=True)
                rc = rc or res.returncode
    finally:
        for path, data in backup.items():
            path.write_bytes(data)
    summary(out, meta["revs"])
    return rc


def summary(out: Path, revs: list[str] | None = None) -> dict:
    runs: dict = {}
    for f in sorted(out.glob("*.*.json")):
        rev = f.name.split(".")[0]
        for row in json.loads(f.read_text()).get("rows", []):
            key = (row.get("shape"), row.get("impl"))
            for t in TIMES:
                if isinstance(row.get(t), (int, float)):
                    runs.setdefault(rev, {}).setdefault(key, {}).setdefault(t, []).append(row[t])
    revs = revs or sorted(runs)
    doc = {rev: {f"{s} | {i}": {t: statistics.median(v) for t, v in ts.items()} for (s, i), ts in runs[rev].items()}
           for rev in revs if rev in runs}
    for rev, rows in doc.items():
        print(f"--- {rev}")
        for key, ts in rows.items():
            print(f"   {key:44s} " + "  ".join(f"{t} {ts[t]:8.3f}" for t in TIMES if t in ts))
    (out / "summary.json").write_text(json.dumps(doc, indent=1))
    return doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="each revision's kernel files into DIR/<rev>/ (needs git)")
    p.add_argument("dir", type=Path)
    p.add_argument("revs", nargs="+")
    p.add_argument("--kernels", default=KERNELS, help="the kernel folder, relative to the repository root")
    p.add_argument("--file", action="append", default=[], help="another file to switch with the kernels (repeatable)")
    p = sub.add_parser("run", help="interleaved bench_attention.py runs of the prepared revisions (GPU)")
    p.add_argument("dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--bench", type=Path, default=ROOT / "benchmarks/kernels/bench_attention.py",
                   help="the timing script (takes --out OUT.json and writes rows as bench_attention.py does)")
    p = sub.add_parser("summary", help="medians per revision of an OUT_DIR of runs")
    p.add_argument("out", type=Path)
    argv = sys.argv[1:]
    # everything after the first "--" goes to the timing script untouched (argparse would take its options)
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    bench_args = argv[cut + 1:]
    if a.cmd != "run" and bench_args:
        ap.error(f"'{a.cmd}' takes no timing-script arguments after --")
    if a.cmd == "prepare":
        prepare(a.dir, a.revs, a.kernels, a.file)
        return 0
    if a.cmd == "run":
        if a.rounds < 1:
            ap.error(f"--rounds must be >= 1, got {a.rounds}")
        if not (a.dir / "revs.json").is_file():
            ap.error(f"{a.dir} holds no prepared revisions (run 'prepare' first)")
        return run(a.dir, a.out, a.rounds, bench_args, a.bench)
    summary(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
