"""``bluprofile`` / ``blutrain profile``: run a few steps with the profiler on and write the table,
the Chrome trace, the event log and the memory timeline PNG into an output folder.

The step comes from a factory ``package.module:function`` called with ``--config`` (or nothing),
returning a zero-argument step function; ``--demo tiny|small|gpt2-124m`` uses the built-in GPT.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable


def _factory(spec: str) -> Callable:
    if ":" not in spec:
        raise SystemExit(f"bluprofile: --step must look like package.module:function, got {spec!r}")
    mod, fn = spec.split(":", 1)
    try:
        return getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"bluprofile: cannot load step factory {spec!r}: {e}") from None


def _int_at_least(lo: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v

    return parse


def _device(text: str) -> str:
    if text == "cpu" or text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")


def build_parser(prog: str = "bluprofile") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--step", help="factory package.module:function returning step_fn()")
    src.add_argument("--demo", choices=["tiny", "small", "gpt2-124m"], help="built-in GPT-2-shaped model")
    p.add_argument("--config", help="passed to the --step factory")
    p.add_argument("--device", type=_device, default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--steps", type=_int_at_least(1), default=3, help="profiled steps (default 3)")
    p.add_argument("--warmup", type=_int_at_least(0), default=1, help="unprofiled warmup steps (default 1)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--no-timing", action="store_true")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--nvtx", action="store_true", help="push NVTX ranges even without Nsight attached")
    p.add_argument("--no-nvtx", action="store_true", help="no NVTX ranges even under Nsight")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--top", type=_int_at_least(0), default=25, help="rows of the printed table")
    return p


def profile_main(argv: list[str] | None = None, prog: str = "bluprofile") -> int:
    """Entry point (``blutrain profile`` passes its own argv here); returns the exit status."""
    parser = build_parser(prog)
    a = parser.parse_args(argv)
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        parser.error(f"--out {a.out!r} exists and is not a folder")
    from bluprofiler.run import profile_steps

    if a.demo:
        from bluprofiler.demo import make_gpt_step
        from bluprofiler.timing import cupy_or_none

        dev = a.device or ("cuda" if cupy_or_none() is not None else "cpu")
        step, _ = make_gpt_step(a.demo, device=dev)
        meta = {"workload": f"demo:{a.demo}", "device_arg": dev}
    else:
        fac = _factory(a.step)
        step = fac(a.config) if a.config is not None else fac()
        if not callable(step):
            parser.error(f"--step {a.step}: the factory returned {type(step).__name__}, not a step function")
        meta = {"workload": a.step, "config": a.config}
    dev = None if a.device is None else ("cpu" if a.device == "cpu" else "cuda")
    nvtx = False if a.no_nvtx else (True if a.nvtx else None)
    s = profile_steps(step, a.steps, a.out, warmup=a.warmup, timing=not a.no_timing, memory=not a.no_memory,
                      nvtx=nvtx, device=dev, plot=not a.no_plot, meta=meta)
    with open(s["files"]["table"]) as f:
        text = f.read()
    lines = text.splitlines()
    print("\n".join(lines[: a.top + 3] + [ln for ln in lines[a.top + 3:] if ln.startswith(("sum", "memory", "  "))]))
    print(f"wrote {', '.join(s['files'].values())}")
    return 0


def main() -> None:
    sys.exit(profile_main())


if __name__ == "__main__":
    main()
