"""Run the tests of one package, of the cross-package suite, or of everything.

    python scripts/run_tests.py all|integration|<package>[,<package>...] [pytest args...]

Each package's tests run in their own pytest process (their conftest files and rootdirs stay apart);
the exit status is non-zero if any run failed. ``BLUTRAIN_TEST_BACKEND=cuda`` runs only the
GPU-marked tests (the hatch matrix's ``backend`` axis).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["blutensor", "blublas", "bluallocator", "dtms", "blucompiler", "bluprofiler", "blumodels"]


def targets(which: str) -> list[tuple[str, Path]]:
    if "," in which:
        return [t for w in which.split(",") if w for t in targets(w)]
    if which == "all":
        return [(p, ROOT / "packages" / p / "tests") for p in PACKAGES] + [("integration", ROOT / "tests")]
    if which == "integration":
        return [("integration", ROOT / "tests")]
    if which not in PACKAGES:
        sys.exit(f"unknown test target {which!r}; choose all, integration or one of {', '.join(PACKAGES)}")
    return [(which, ROOT / "packages" / which / "tests")]


def main() -> int:
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    extra = sys.argv[2:]
    if os.environ.get("BLUTRAIN_TEST_BACKEND") == "cuda":
        extra = ["-m", "cuda", *extra]
    failed, summary = [], []
    for name, path in targets(which):
        if not path.exists() or not any(path.rglob("test_*.py")):
            summary.append(f"{name:13s} no tests")
            continue
        t0 = time.time()
        cmd = [sys.executable, "-m", "pytest", str(path), "-q", "-p", "no:cacheprovider", *extra]
        print(f"\n=== {name}: {' '.join(cmd[2:])}", flush=True)
        rc = subprocess.call(cmd, cwd=ROOT)
        ok = rc in (0, 5) if name != "all" else rc == 0  # 5: every test deselected by -m
        summary.append(f"{name:13s} {'ok' if ok else f'FAILED (exit {rc})'} in {time.time() - t0:.0f}s")
        if not ok:
            failed.append(name)
    print("\n=== summary\n" + "\n".join(summary), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
