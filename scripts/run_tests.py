"""Run the tests of one package, of the cross-package suite, or of everything.

    python scripts/run_tests.py all|integration|<package>[,<package>...] [--jobs N] [pytest args...]

Each package's tests run in their own pytest process (their conftest files and rootdirs stay apart);
the exit status is non-zero if any run failed. ``BLUTRAIN_TEST_BACKEND=cuda`` runs only the
GPU-marked tests (the hatch matrix's ``backend`` axis). ``--jobs N`` (or ``BLUTRAIN_TEST_JOBS``) runs up to N
targets at once, each with its output held and printed whole when it ends; the default is one at a time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
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


def parse_jobs(args: list[str]) -> tuple[int, list[str]]:
    """Take ``--jobs N`` / ``--jobs=N`` out of the pytest arguments; fall back to BLUTRAIN_TEST_JOBS, then 1."""
    jobs, rest, i = os.environ.get("BLUTRAIN_TEST_JOBS", "1"), [], 0
    while i < len(args):
        if args[i] == "--jobs":
            if i + 1 >= len(args):
                sys.exit("--jobs needs a number")
            jobs, i = args[i + 1], i + 2
            continue
        if args[i].startswith("--jobs="):
            jobs = args[i].split("=", 1)[1]
        else:
            rest.append(args[i])
        i += 1
    if not jobs.isdigit() or int(jobs) < 1:
        sys.exit(f"--jobs (or BLUTRAIN_TEST_JOBS) must be a positive integer, got {jobs!r}")
    return int(jobs), rest


def main() -> int:
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    jobs, extra = parse_jobs(sys.argv[2:])
    if os.environ.get("BLUTRAIN_TEST_BACKEND") == "cuda":
        extra = ["-m", "cuda", *extra]
    summary: dict[str, str] = {}
    pending = []
    for name, path in targets(which):
        if not path.exists() or not any(path.rglob("test_*.py")):
            summary[name] = f"{name:13s} no tests"
            continue
        pending.append((name, [sys.executable, "-m", "pytest", str(path), "-q", "-p", "no:cacheprovider", *extra]))
    order = [name for name, _ in targets(which)]
    running: list[tuple[str, subprocess.Popen, float, object]] = []
    failed = []

    def finish(name: str, proc: subprocess.Popen, t0: float, log: object) -> None:
        rc = proc.wait()
        if log is not None:
            log.seek(0)
            sys.stdout.write(log.read().decode(errors="replace"))
            log.close()
        ok = rc in (0, 5)  # 5: every test deselected by -m
        summary[name] = f"{name:13s} {'ok' if ok else f'FAILED (exit {rc})'} in {time.time() - t0:.0f}s"
        if not ok:
            failed.append(name)
        print(f"=== {summary[name]}", flush=True)

    while pending or running:
        while pending and len(running) < jobs:
            name, cmd = pending.pop(0)
            print(f"\n=== {name}: {' '.join(cmd[2:])}", flush=True)
            log = tempfile.TemporaryFile() if jobs > 1 else None
            out = log if log is not None else None
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT if out else None)
            running.append((name, proc, time.time(), log))
        if jobs == 1:
            finish(*running.pop(0))
            continue
        time.sleep(0.2)
        for item in [r for r in running if r[1].poll() is not None]:
            running.remove(item)
            print(f"\n=== {item[0]} output", flush=True)
            finish(*item)
    print("\n=== summary\n" + "\n".join(summary[n] for n in order if n in summary), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
