"""Compare the machine code (SASS) of every CUDA kernel between a git revision and the working tree, offline.

When no GPU is at hand, a kernel refactor can still be shown to change nothing: if every ``extern "C"`` function
compiles to the same SASS, the GPU runs exactly what was measured before. Each ``.cu`` file of blutensor and
blublas is compiled the way the loaders see it (local quoted includes inlined), with nvcc ``-cubin`` for sm_90
(sm_90a for the wgmma files), disassembled with cuobjdump, and compared function by function (addresses and
column padding ignored).

    python dev/sass_diff.py 8e893f6            # REV vs the working tree
    python dev/sass_diff.py 8e893f6 --verbose  # also the first differing lines of each function
    python dev/sass_diff.py 7b63950^ --against 7b63950 --files gemm_bf16.cu,gemm_tf32.cu --out OUT.json

Needs nvcc (CUDA 12.8+), cuobjdump and nvdisasm on PATH (or CUOBJDUMP=...; the pip wheels
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm carry both). Exit status 1 when a function differs.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNEL_DIRS = ("packages/blutensor/src/blutensor/backends/cupy/kernels", "packages/blublas/src/blublas/kernels")
#: where a kernel directory was at earlier revisions (blutensor's CUDA kernels moved under its cupy backend)
FORMER_DIRS = {"packages/blutensor/src/blutensor/backends/cupy/kernels": ("packages/blutensor/src/blutensor/kernels",)}
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.M)
_FUNC = re.compile(r"\s*Function : (\S+)")


def inline(path: Path, seen: set[str] | None = None) -> str:
    """``path`` with its local quoted includes inlined, each header once (what both kernel loaders do)."""
    seen = set() if seen is None else seen

    def repl(m: re.Match) -> str:
        name = m.group(1)
        if name in seen:
            return ""
        seen.add(name)
        return inline(path.parent / name, seen)

    return _INCLUDE.sub(repl, path.read_text())


def sass(src: str, arch: str, work: Path, cuobjdump: str) -> dict[str, list[str]]:
    """Function name -> normalised SASS lines of ``src`` compiled for ``arch``."""
    cu, cubin = work / "k.cu", work / "k.cubin"
    cu.write_text(src)
    subprocess.run(["nvcc", "-cubin", f"-arch={arch}", "-std=c++17", "-o", str(cubin), str(cu)], check=True,
                   capture_output=True, text=True)
    out = subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    funcs: dict[str, list[str]] = {}
    cur = None
    for ln in out.splitlines():
        m = _FUNC.match(ln)
        if m:
            cur = funcs.setdefault(m.group(1), [])
        elif cur is not None and ln.strip():
            cur.append(re.sub(r"\s+", " ", re.sub(r"/\*[0-9a-f]{4,}\*/", "", ln)).strip())
    return funcs


def extract_rev(rev: str, tmp: Path, into: str = "old") -> dict[str, str]:
    """The kernel directories at ``rev`` under ``tmp/into``: git archive piped into tar, no shell, and ``rev``
    checked to name a commit first (so an argument such as ``; rm -rf ~`` or ``--output=x`` is only a bad rev).
    Returns each of KERNEL_DIRS -> the path it had at ``rev`` (FORMER_DIRS for a revision before a move)."""
    ok = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", "--end-of-options",
                         f"{rev}^{{commit}}"], capture_output=True, text=True)
    if ok.returncode != 0:
        raise SystemExit(f"sass_diff: {rev!r} is not a commit of {ROOT}")
    commit = ok.stdout.strip()
    (tmp / into).mkdir()
    at_rev = {}
    for kdir in KERNEL_DIRS:
        for cand in (kdir, *FORMER_DIRS.get(kdir, ())):
            if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}:{cand}"],
                              capture_output=True).returncode == 0:
                at_rev[kdir] = cand
                break
        else:
            raise SystemExit(f"sass_diff: {commit} has no {kdir} (nor an earlier place of it)")
    archive = subprocess.Popen(["git", "-C", str(ROOT), "archive", commit, "--", *at_rev.values()],
                               stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(tmp / into)], stdin=archive.stdout, check=True)
    archive.stdout.close()
    if archive.wait() != 0:
        raise SystemExit(f"sass_diff: git archive of {commit} failed")
    return at_rev


def commit_of(rev: str) -> str:
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "--verify", "--quiet", "--end-of-options",
                          f"{rev}^{{commit}}"], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"sass_diff: {rev!r} is not a commit of {ROOT}")
    return out.stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rev", help="git revision to compare against the working tree (or --against)")
    ap.add_argument("--against", default=None, help="a second revision to compare REV with instead of the working tree")
    ap.add_argument("--files", default="", help="comma-separated .cu file names to compare (default: every one)")
    ap.add_argument("--out", default=None, help="JSON file for the per-file counts")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    cuobjdump = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if shutil.which("nvcc") is None or cuobjdump is None or shutil.which("nvdisasm") is None:
        print("sass_diff: needs nvcc, cuobjdump and nvdisasm on PATH (pip install nvidia-cuda-nvcc "
              "nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)", file=sys.stderr)
        return 2
    only = {f.strip() for f in a.files.split(",") if f.strip()}
    differ = 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        at_rev = extract_rev(a.rev, Path(tmp))
        new_root, at_new = ROOT, {k: k for k in KERNEL_DIRS}
        if a.against is not None:
            at_new, new_root = extract_rev(a.against, Path(tmp), "new"), Path(tmp) / "new"
        names = set()
        for kdir in KERNEL_DIRS:
            for new_cu in sorted((new_root / at_new[kdir]).glob("*.cu")):
                names.add(new_cu.name)
                if only and new_cu.name not in only:
                    continue
                old_cu = old / at_rev[kdir] / new_cu.name
                if not old_cu.exists():
                    print(f"{new_cu.name}: new file")
                    rows.append({"file": new_cu.name, "new_file": True})
                    continue
                arch = "sm_90a" if "wgmma" in new_cu.name else "sm_90"
                A = sass(inline(old_cu), arch, Path(tmp), cuobjdump)
                B = sass(inline(new_cu), arch, Path(tmp), cuobjdump)
                common = sorted(set(A) & set(B))
                bad = [f for f in common if A[f] != B[f]]
                differ += len(bad)
                extra = f"; new: {sorted(set(B) - set(A))}" if set(B) - set(A) else ""
                gone = f"; gone: {sorted(set(A) - set(B))}" if set(A) - set(B) else ""
                print(f"{new_cu.name}: {len(common) - len(bad)}/{len(common)} identical{extra}{gone}"
                      + (f"; DIFFER: {bad}" if bad else ""))
                rows.append({"file": new_cu.name, "arch": arch, "functions": len(common),
                             "identical": len(common) - len(bad), "differ": bad,
                             "new": sorted(set(B) - set(A)), "gone": sorted(set(A) - set(B))})
                if a.verbose:
                    for f in bad:
                        print("\n".join(list(difflib.unified_diff(A[f], B[f], f, f, lineterm="", n=0))[:20]))
        missing = sorted(only - names)
        if missing:
            raise SystemExit(f"sass_diff: --files {missing} are not kernel files")
    if a.out:
        import json

        cmd = ["python", "dev/sass_diff.py", *sys.argv[1:]]
        if "--out" in cmd:
            cmd[cmd.index("--out") + 1] = "OUT.json"
        res = {"command": " ".join(cmd), "rev": commit_of(a.rev),
               "against": commit_of(a.against) if a.against else "the working tree",
               "what": "sm_90 / sm_90a SASS of every extern \"C\" function, compiled by nvcc from the inlined .cu "
                       "at both revisions, compared function by function (addresses and padding ignored)",
               "nvcc": subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip()
               .splitlines()[-1],
               "files": rows, "functions": sum(r.get("functions", 0) for r in rows),
               "identical": sum(r.get("identical", 0) for r in rows)}
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
