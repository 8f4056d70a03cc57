"""Registers, spills and stack of every entry of a blutensor kernel file as ptxas reports them, without a GPU:
NVRTC compiles the file (as the loader assembles it) to SASS for the given architecture with ``-Xptxas=-v``.
A warp-specialised Hopper kernel reports its launch-time register count (``__launch_bounds__``); spills there
are spills of the consumer code, whose budget setmaxnreg raises at run time.

    python packages/blutensor/dev/ptxas_report.py sdpa_wgmma.cu [--arch sm_90a] [--only REGEX]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def report(file: str, arch: str) -> list[dict]:
    """One row per entry: name, registers, spill store / load bytes, stack frame bytes."""
    from nvrtc_check import nvrtc_log

    ok, text = nvrtc_log(file, arch, (b"-Xptxas=-v",))
    if not ok:
        raise RuntimeError(f"{file} does not compile for {arch}:\n{text}")
    rows = []
    for block in re.split(r"(?=ptxas info\s*: Compiling entry function)", text):
        name = re.search(r"Compiling entry function '(\w+)'", block)
        regs = re.search(r"Used (\d+) registers", block)
        if not name or not regs:
            continue
        spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", block)
        stack, st, ld = (int(x) for x in spill.groups()) if spill else (0, 0, 0)
        rows.append(dict(entry=name.group(1), registers=int(regs.group(1)), spill_stores=st, spill_loads=ld,
                         stack=stack))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", help="a kernel file of blutensor/backends/cupy/kernels, e.g. sdpa_wgmma.cu")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--only", default="", help="entries matching this regular expression")
    a = ap.parse_args()
    rows = [r for r in report(a.file, a.arch) if re.search(a.only, r["entry"])]
    for r in sorted(rows, key=lambda r: r["entry"]):
        flag = "  SPILLS" if r["spill_stores"] or r["spill_loads"] else ""
        print(f"{r['entry']:52s} {r['registers']:4d} regs  stack {r['stack']:4d}  spill st/ld "
              f"{r['spill_stores']}/{r['spill_loads']}{flag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
