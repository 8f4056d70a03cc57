"""The README's first command on the CPU, timed by phase: ``blutrain train --preset tiny`` (300 steps, evals,
checkpoints, the loss plot and the sample), each run a fresh process as a user starts it.

    .venv/bin/python benchmarks/cpu_first_command.py --runs 3 --out benchmarks/results/cpu_first_command.json

Per run and phase: wall seconds and process CPU seconds (``time.process_time``: all threads of the process, less
disturbed by other users of a shared machine than the wall clock) for the imports, the Trainer's set-up (data
check, model build, compiled-kernel load), the 300 training steps, the evaluations, the checkpoint saves, the
loss plot and the sample; the run's first and last validation loss (the work is the same: the last must stay
~4.96); and the load average before and after (the contention note). ``--python`` runs the command under another
interpreter or source tree (a before/after comparison: ``PYTHONPATH=<other tree's package srcs>``), with
``--label`` naming it in the JSON; runs of several labels alternate when ``--compare`` gives a second tree.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PHASES = {  # label: (module, object, attribute)
    "trainer_setup": ("blumodels.trainer", "Trainer", "__init__"),
    "steps": ("blumodels.trainer", "Trainer", "train_step"),
    "evaluate": ("blumodels.trainer", "Trainer", "evaluate"),
    "checkpoint_save": ("blumodels.trainer", "Trainer", "save_checkpoint"),
    "plot": ("blumodels.plot", None, "plot_losses"),
    "sample": ("blumodels.trainer", "Trainer", "sample"),
}


def child(out_dir: str) -> None:
    """One run of the command in this process, its phases timed; prints one JSON line."""
    import functools
    import importlib

    t0, p0 = time.perf_counter(), time.process_time()
    import blumodels.cli as cli
    import blumodels.plot  # noqa: F401  (imported for its wrapper below)

    acc = {"imports": [time.perf_counter() - t0, time.process_time() - p0, 1]}
    for label, (mod, obj, attr) in PHASES.items():
        owner = importlib.import_module(mod)
        owner = getattr(owner, obj) if obj else owner
        f = getattr(owner, attr)

        def timed(*a, _f=f, _label=label, **k):
            t, p = time.perf_counter(), time.process_time()
            try:
                return _f(*a, **k)
            finally:
                e = acc.setdefault(_label, [0.0, 0.0, 0])
                e[0] += time.perf_counter() - t
                e[1] += time.process_time() - p
                e[2] += 1

        setattr(owner, attr, functools.wraps(f)(timed))
    rc = cli.main(["train", "--preset", "tiny", "--device", "cpu", "--out", out_dir, "--overwrite"])
    total = [time.perf_counter() - t0, time.process_time() - p0]
    summary = json.loads((Path(out_dir) / "summary.json").read_text())
    print("BENCH " + json.dumps({
        "rc": rc, "total_wall_s": round(total[0], 2), "total_cpu_s": round(total[1], 2),
        "phases": {k: {"wall_s": round(w, 3), "cpu_s": round(c, 3), "calls": n} for k, (w, c, n) in acc.items()},
        "first_val_loss": summary["first_val_loss"], "last_val_loss": summary["last_val_loss"],
        "fit_elapsed_s": round(summary["elapsed_s"], 2)}), flush=True)


def one_run(python: str, env: dict, out_dir: str) -> dict:
    la0 = os.getloadavg()
    r = subprocess.run([python, __file__, "--child", out_dir], capture_output=True, text=True, env=env)
    line = next((x for x in r.stdout.splitlines() if x.startswith("BENCH ")), None)
    if r.returncode != 0 or line is None:
        raise RuntimeError(f"the run failed (exit {r.returncode}): {r.stderr.strip()[-800:]}")
    rec = json.loads(line[len("BENCH "):])
    rec["loadavg_before_after"] = [round(la0[0], 2), round(os.getloadavg()[0], 2)]
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here (else print it)")
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--compare", type=Path, default=None,
                    help="another source tree (its packages/*/src go first on PYTHONPATH): runs alternate with it")
    ap.add_argument("--compare-label", default="other tree")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child)
        return
    if a.runs < 1:
        ap.error(f"--runs must be >= 1, got {a.runs}")
    sides = [(a.label, dict(os.environ))]
    if a.compare is not None:
        srcs = sorted(str(p) for p in (a.compare / "packages").glob("*/src"))
        if not srcs:
            ap.error(f"--compare {a.compare}: no packages/*/src there")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(srcs + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        sides.append((a.compare_label, env))
    rows: dict = {label: [] for label, _ in sides}
    with tempfile.TemporaryDirectory(prefix="blu_first_cmd_") as tmp:
        for i in range(a.runs):
            for label, env in (sides if i % 2 == 0 else sides[::-1]):  # alternate which side goes first
                rec = one_run(sys.executable, env, str(Path(tmp) / label.replace(" ", "_")))
                rows[label].append(rec)
                print(f"[{label}] run {i + 1}: total {rec['total_wall_s']} s wall / {rec['total_cpu_s']} s cpu, "
                      f"steps {rec['phases']['steps']['wall_s']} s / {rec['phases']['steps']['cpu_s']} s, "
                      f"val {rec['first_val_loss']:.3f} -> {rec['last_val_loss']:.3f}, "
                      f"load {rec['loadavg_before_after']}",
                      flush=True)
    doc = {
        "command": "blutrain train --preset tiny --device cpu (fresh process per run; "
                   "benchmarks/cpu_first_command.py)",
        "what": "wall and process-CPU seconds per phase of the README's first command",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "runs": rows,
    }
    text = json.dumps(doc, indent=2) + "\n"
    if a.out:
        a.out.write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
