"""Checkpoint save/load latency of GPT-2 124M..1.5B: BluTrain's CheckpointManager beside torch.save/torch.load
and PyTorch DCP (torch.distributed.checkpoint, sync and async_save, in a one-process gloo group), on the same
tensors in one run, and the step stall of an async save.

    .venv/bin/python benchmarks/checkpoint_bench.py --device cpu --sizes 124m --repeats 3 \\
        --out benchmarks/results/checkpoint_cpu.json
    python benchmarks/checkpoint_bench.py --device cuda --sizes 124m,350m,774m,1.5b --repeats 1 \\
        --out benchmarks/results/checkpoint_h200.json

The GPU run is sized to take about five minutes on one H200 and at most two checkpoints of a size on the disk at
a time (1.5B + AdamW is 18.7 GB): every repeat's files are removed as soon as they are measured, the CUDA stall
step is short (``--cuda-batch`` 1 x ``--cuda-seq`` 512 tokens, 4 steps before and after, at most 12 in flight),
and the JSON is rewritten after every size, so a run cut short keeps the sizes that finished.

What is saved is what the Trainer saves: ``blumodels.state.training_state`` of a GPT-2 preset (its parameters
and both AdamW moments, after one optimizer step) with its metadata. Methods, per size (median of
``--repeats``, each into a fresh directory, files dropped from the page cache before every load):

- ``blutrain_sync``: ``training_state(..., copy=False)`` (as the Trainer calls it) + ``CheckpointManager.save``
  (async off): write (each 16 MiB chunk SHA-256-hashed as it is written, on the I/O threads), fsync, rename,
  re-read and verify every chunk, receipt and commit record; returns when durable.
- ``blutrain_async``: the same with ``async_save=True`` (the Trainer's ``train.async_checkpoint``): returns after
  ``training_state`` and the snapshot into the manager's reused host buffers (on CUDA ``training_state``
  hands over the device Tensors and the snapshot is a device-to-host copy into pinned buffers queued on the
  current stream); durable at ``wait()``.
- ``blutrain_async_direct``: the parameters and moments handed to the manager as the live Tensors.
- ``blutrain_load``: ``CheckpointManager.load`` (read + verify) and ``restore_training_state`` into the model.
- ``torch_save`` / ``torch_load``: ``torch.save`` of the same tensors as torch tensors (on the device for CUDA)
  to one file; durable after fsync of the file and its directory; ``torch.load(weights_only=True)``.
- ``dcp_sync`` / ``dcp_async`` / ``dcp_load``: ``dcp.save`` (FileSystemWriter fsyncs), ``dcp.async_save``
  (returns after staging to CPU memory; durable at ``future.result()``), ``dcp.load`` in place.

``return_s`` is the time until training may continue (the snapshot buffers are reserved once before the first save:
``CheckpointManager.reserve``, as the Trainer does after its first step; ``reserve_s``), ``durable_s`` until the
bytes are fsynced (and, for BluTrain, verified and committed); ``GBps`` = bytes / durable_s (loads: bytes / load
time).

Step stall: ``--stall-steps`` training-like steps without a save before and as many after, and the same steps
while an async save is in flight (from the moment the save returns until it is durable, or its first
``--stall-max-steps``; at least 3). CPU: a float32 GEMM loop sized to ~100 ms on one unloaded core (this process
runs NumPy on one thread, as a CPU rank does; the writer thread has the other cores). CUDA: the Trainer's GPT-2 step
(``blumodels.step.TrainStep``: forward, backward, fused AdamW, captured in CUDA graphs as ``train.cuda_graph``
does) of the model being checkpointed at ``--cuda-batch`` x ``--cuda-seq`` tokens (fp32).
``stall`` = median step time in flight / median without (before and after) - 1 (target <= 0.05); measured for
``--stall-sizes`` (default: every size on CPU, the largest on CUDA, to keep the GPU run short).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # the "training" thread is one core, as a CPU rank's
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

#: --methods groups: BluTrain sync save + load, BluTrain async saves, torch.save + load, DCP sync/async + load
METHOD_GROUPS = ("blutrain", "async", "torch", "dcp")
SIZES = {"tiny": "tiny", "124m": "gpt2-124m", "350m": "gpt2-350m", "774m": "gpt2-774m", "1.5b": "gpt2-1.5b",
         "2.4b": "gpt2-2.4b"}


def evict(path: Path) -> None:
    """Drop a file's (or a directory's files') pages from the page cache, so a load reads the disk."""
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


class Side:
    """One GPT-2 preset with its AdamW state on the chosen device, and the work loop for the stall test."""

    def __init__(self, size: str, device: str, batch: int, seq: int) -> None:
        import blutensor as bt
        from blumodels.config import load_preset
        from blumodels.families import build_model, count_params
        from blumodels.trainer import make_optimizer

        self.bt, self.device, self.batch, self.seq = bt, device, batch, seq
        self.cfg = load_preset(SIZES[size])
        self.cfg.model.dropout = 0.0
        if not self.cfg.model.vocab_size:  # "tiny" takes its vocabulary from the data: the built-in BPE's
            self.cfg.model.vocab_size = 1024
        self.n_params = count_params(self.cfg.model)
        t0 = time.perf_counter()
        with _fast_cpu_init(bt, device):
            self.model = build_model(self.cfg.model, device=device, seed=0)
        self.opt = make_optimizer(self.model, self.cfg, device)
        for p in self.model.parameters():  # one AdamW step fills both moments, as after any training step
            p.grad = bt.zeros_like(p)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sync()
        self.build_s = time.perf_counter() - t0

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            self.bt.cuda.synchronize()

    def state(self) -> tuple[dict[str, np.ndarray], dict]:
        """What the Trainer hands its CheckpointManager: ``training_state(..., copy=False)``."""
        from blumodels.state import training_state

        return training_state(self.model, self.opt, 1, None, self.cfg.to_dict(), copy=False)

    def raw(self) -> dict[str, Any]:
        """The same tensors as ``state()`` (names included), as the live Tensors."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        out: dict[str, Any] = {f"model.{n}": p.detach() for n, p in self.model.named_parameters()}
        for p, st in self.opt.state.items():
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"optim.{k}.{names[id(p)]}"] = st[k]
        return out

    # ---------------------------------------------------------------- the step of the stall test
    def make_step(self) -> tuple[Callable[[], None], str]:
        if self.device.startswith("cuda"):
            bt, T = self.bt, self.seq
            rng = np.random.default_rng(0)
            x = bt.tensor(rng.integers(0, 50257, (self.batch, T)), device=self.device)
            y = bt.tensor(rng.integers(0, 50257, (self.batch, T)), device=self.device)

            from blumodels.graph_step import CapturedStep, runtime_refusal
            from blumodels.step import TrainStep

            # the step the Trainer runs on CUDA: its one TrainStep (fused AdamW), captured into CUDA graphs
            lr = float(self.cfg.train.lr)
            st = TrainStep(self.model, self.opt, list(self.model.parameters()), device=self.device,
                           lr_schedule=[lr] * 100_000, fused=True)
            st.seek(0)
            why = runtime_refusal(self.device)
            for _ in range(2):  # eager warm-up steps, as the Trainer runs before capturing
                st.run(lambda: (x, y), lr)
                st.read()
            runner: Any = st
            if why is None:
                runner = CapturedStep(st, (self.batch, T))
                runner.capture()

            def step() -> None:
                runner.run(lambda: (x, y), lr)
                st.read()  # the Trainer's one host read per step (waits for the GPU)

            how = "captured in CUDA graphs" if why is None else f"eager ({why})"
            return step, f"the Trainer's GPT-2 step (forward, backward, fused AdamW) {how}, B={self.batch} T={T}"
        n = 256
        a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
        while True:  # grow the GEMM to >= 25 ms (the best of 3: a loaded machine only slows it), then repeat it
            dt = min(timed(lambda m=a: m @ m)[0] for _ in range(3))
            if dt >= 0.025 or n >= 8192:
                break
            n = int(n * 1.26)
            a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
        reps = max(1, round(0.1 / dt))

        def step() -> None:
            for _ in range(reps):
                a @ a

        return step, f"{reps} x float32 GEMM {n}x{n}x{n} ({reps * dt * 1e3:.0f} ms unloaded, 1 thread)"


class _fast_cpu_init:
    """On CPU, draw the initial weights with NumPy's generator instead of blutensor's counter-based one (about
    30 s per 124M parameters on one core): what is measured is the checkpoint's bytes and layout, not their
    values. CUDA builds use blutensor's own initialisation."""

    def __init__(self, bt: Any, device: str) -> None:
        self.bt, self.on = bt, not device.startswith("cuda")
        self.rng = np.random.default_rng(0)

    def __enter__(self) -> None:
        if not self.on:
            return
        init, bt, rng = self.bt.nn.init, self.bt, self.rng
        self.saved = init.normal_

        def normal_(t: Any, mean: float = 0.0, std: float = 1.0, generator: Any = None) -> Any:
            with bt.no_grad():
                return t.copy_(bt.from_numpy((rng.standard_normal(tuple(t.shape), dtype=np.float32) * std
                                              + mean).astype(np.float32, copy=False)))

        init.normal_ = normal_

    def __exit__(self, *exc: object) -> None:
        if self.on:
            self.bt.nn.init.normal_ = self.saved


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    r = fn()
    return time.perf_counter() - t0, r


def med(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


def stall(step: Callable[[], None], start: Callable[[], Any], busy: Callable[[Any], bool],
          finish: Callable[[Any], None], n: int, most: int) -> dict:
    """Median step time without a save, and while an async save (``start``) is in flight (its first ``most``
    steps)."""
    step()  # warm
    base = [timed(step)[0] for _ in range(n)]
    return_s, handle = timed(start)
    during, t0 = [], time.perf_counter()
    while busy(handle) or len(during) < 3:
        during.append(timed(step)[0])
        if len(during) >= most:
            break
    inflight_s = time.perf_counter() - t0
    whole = not busy(handle)
    finish(handle)
    after = [timed(step)[0] for _ in range(n)]
    plain = base + after  # steps before and after the flight: a machine whose load drifts moves both
    return {"base_step_ms": round(med(plain) * 1e3, 2), "before_step_ms": round(med(base) * 1e3, 2),
            "after_step_ms": round(med(after) * 1e3, 2), "inflight_step_ms": round(med(during) * 1e3, 2),
            "inflight_steps": len(during),
            "save_return_s": round(return_s, 4), "inflight_s": round(inflight_s, 3),
            "whole_flight": whole,
            "stall": round(med(during) / med(plain) - 1, 4)}


def io_threads() -> int:
    from blumodels.checkpoint.chunkio import io_threads as threads

    return threads()


def run_size(size: str, args: argparse.Namespace, root: Path) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp
    from blumodels.checkpoint.manager import CheckpointManager, to_host
    from blumodels.state import restore_training_state

    side = Side(size, args.device, args.cuda_batch, args.cuda_seq)
    print(f"[{size}] {side.n_params / 1e6:.0f}M parameters built in {side.build_s:.1f}s", flush=True)
    tdev = "cuda" if args.device.startswith("cuda") else "cpu"
    tensors, meta = side.state()
    nbytes = sum(a.nbytes for a in tensors.values())
    tsd = {k: torch.from_numpy(np.ascontiguousarray(to_host(v))).to(tdev) for k, v in tensors.items()}
    del tensors
    gc.collect()
    res: dict[str, Any] = {"size": size, "preset": SIZES[size], "params": side.n_params, "tensors": len(tsd),
                           "bytes": nbytes, "build_s": round(side.build_s, 1)}
    rows: dict[str, dict[str, list[float]]] = {}

    def add(method: str, **kv: float) -> None:
        for k, v in kv.items():
            rows.setdefault(method, {}).setdefault(k, []).append(v)

    def fresh(name: str) -> Path:
        d = root / f"{size}-{name}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        return d

    managers: list[CheckpointManager] = []

    def async_managers() -> tuple[CheckpointManager, CheckpointManager]:
        """The async managers, made (and their snapshot buffers reserved) on first use: a run of the sync groups
        alone holds no pinned copies of the state."""
        if not managers:
            amgr = CheckpointManager(fresh("blutrain-async"), keep=1, async_save=True)
            # on CUDA the direct path gets its own manager: its snapshot buffers are pinned (the Trainer path's
            # are the host arrays' plain copies); on CPU both are plain host memory and one set is enough
            dmgr = amgr if tdev == "cpu" else CheckpointManager(fresh("blutrain-direct"), keep=1, async_save=True)
            # the Trainer reserves its snapshot buffers once, after the first step: a one-time cost, reported apart
            res["reserve_s"] = round(amgr.reserve(side.state()[0]), 4)
            if dmgr is not amgr:
                res["reserve_direct_s"] = round(dmgr.reserve(side.raw()), 4)
            managers.extend([amgr] if dmgr is amgr else [amgr, dmgr])
        return managers[0], managers[-1]

    def close_managers() -> None:
        for m in managers:
            m.close()
            shutil.rmtree(m.directory, ignore_errors=True)

    for rep in range(args.repeats):
        if "blutrain" in args.methods:
            # --- BluTrain, sync
            d = fresh("blutrain-sync")
            mgr = CheckpointManager(d, keep=1, async_save=False)
            t0 = time.perf_counter()
            tensors, meta = side.state()
            mgr.save(1, tensors, meta)
            dt = time.perf_counter() - t0
            del tensors
            add("blutrain_sync", return_s=dt, durable_s=dt)
            evict(d)
            t0 = time.perf_counter()
            _, loaded, lmeta = mgr.load(1)
            t_load = time.perf_counter() - t0
            restore_training_state(loaded, lmeta, side.model, side.opt)
            side.sync()
            t_restore = time.perf_counter() - t0 - t_load
            add("blutrain_load", load_s=t_load, restore_s=t_restore, total_s=t_load + t_restore)
            del loaded
            shutil.rmtree(d)
            gc.collect()
        if "async" in args.methods:
            # --- BluTrain, async (the Trainer's path: training_state, then the manager's snapshot)
            amgr, dmgr = async_managers()
            t0 = time.perf_counter()
            tensors, meta = side.state()
            amgr.save(2 * rep + 1, tensors, meta)
            t_ret = time.perf_counter() - t0
            amgr.wait()
            add("blutrain_async", return_s=t_ret, durable_s=time.perf_counter() - t0)
            amgr.remove_all()  # the disk holds one checkpoint of this size at a time
            del tensors
            gc.collect()
            # --- BluTrain, async with the Tensors handed over directly
            t0 = time.perf_counter()
            dmgr.save(2 * rep + 2, side.raw(), meta)
            t_ret = time.perf_counter() - t0
            dmgr.wait()
            add("blutrain_async_direct", return_s=t_ret, durable_s=time.perf_counter() - t0)
            dmgr.remove_all()
        if "torch" in args.methods:
            # --- torch.save / torch.load
            d = fresh("torch")
            f = d / "state.pt"
            t0 = time.perf_counter()
            torch.save(tsd, f)
            t_ret = time.perf_counter() - t0
            fsync_path(f)
            fsync_path(d)
            add("torch_save", return_s=t_ret, durable_s=time.perf_counter() - t0)
            evict(f)
            t0 = time.perf_counter()
            back = torch.load(f, map_location=tdev, weights_only=True)
            if tdev == "cuda":
                torch.cuda.synchronize()
            t_load = time.perf_counter() - t0
            add("torch_load", load_s=t_load, total_s=t_load)
            del back
            shutil.rmtree(d)
            gc.collect()
        if "dcp" in args.methods:
            # --- DCP sync / async / load
            d = fresh("dcp-sync")
            t0 = time.perf_counter()
            dcp.save(tsd, checkpoint_id=str(d))
            dt = time.perf_counter() - t0
            add("dcp_sync", return_s=dt, durable_s=dt)
            evict(d)
            target = {k: torch.empty_like(v) for k, v in tsd.items()}
            t0 = time.perf_counter()
            dcp.load(target, checkpoint_id=str(d))
            if tdev == "cuda":
                torch.cuda.synchronize()
            t_load = time.perf_counter() - t0
            add("dcp_load", load_s=t_load, total_s=t_load)
            del target
            shutil.rmtree(d)
            d = fresh("dcp-async")
            t0 = time.perf_counter()
            fut = dcp.async_save(tsd, checkpoint_id=str(d))
            t_ret = time.perf_counter() - t0
            _result(fut)
            add("dcp_async", return_s=t_ret, durable_s=time.perf_counter() - t0)
            shutil.rmtree(d)
            gc.collect()
        print(f"[{size}] repeat {rep + 1}/{args.repeats} done", flush=True)
    methods = {}
    for m, kv in rows.items():
        r = {k: med(v) for k, v in kv.items()}
        t = r.get("durable_s", r.get("total_s"))
        r["GBps"] = round(nbytes / t / 1e9, 3) if t else None
        r["samples"] = {k: [round(x, 4) for x in v] for k, v in kv.items()}
        methods[m] = r
    res["methods"] = methods

    # --- step stall of an async save in flight
    if size not in args.stall_sizes:
        close_managers()
        res["stall"] = {}
        return res
    amgr, dmgr = async_managers()
    step, what = side.make_step()
    res["stall_step"] = what
    state_holder: dict[str, Any] = {}

    def blu_start() -> CheckpointManager:
        tensors, meta = side.state()
        amgr.save(1000 + len(state_holder), tensors, meta)
        state_holder[len(state_holder)] = None
        return amgr

    def blu_direct_start() -> CheckpointManager:
        dmgr.save(2000 + len(state_holder), side.raw(), meta)
        state_holder[len(state_holder)] = None
        return dmgr

    def dcp_start() -> Any:
        d = fresh(f"dcp-stall{len(state_holder)}")
        state_holder[len(state_holder)] = d
        return d, dcp.async_save(tsd, checkpoint_id=str(d))

    def blu_finish(m: CheckpointManager) -> None:
        m.wait()
        m.remove_all()  # each stall run's checkpoint goes once it is durable: one on the disk at a time

    def dcp_finish(h: tuple[Path, Any]) -> None:
        _result(h[1])
        shutil.rmtree(h[0], ignore_errors=True)

    stalls = {}
    for name, start, busy, finish in (
            ("blutrain_async", blu_start, lambda m: m.in_flight, blu_finish),
            ("blutrain_async_direct", blu_direct_start, lambda m: m.in_flight, blu_finish),
            ("dcp_async", dcp_start, lambda h: not _done(h[1]), dcp_finish)):
        runs = [stall(step, start, busy, finish, args.stall_steps, args.stall_max_steps)
                for _ in range(args.stall_repeats)]
        best = sorted(runs, key=lambda r: r["stall"])[len(runs) // 2]  # the median run
        stalls[name] = {**best, "stall_runs": [r["stall"] for r in runs]}
        print(f"[{size}] {name}: stall {best['stall']:+.3f} ({best['inflight_steps']} steps in flight)", flush=True)
    res["stall"] = stalls
    close_managers()
    for d in [v for v in state_holder.values() if v is not None]:
        shutil.rmtree(d, ignore_errors=True)
    return res


def _result(fut: Any) -> None:
    f = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse (staging + upload) or a Future
    f.result()


def _done(fut: Any) -> bool:
    return getattr(fut, "upload_completion", fut).done()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--sizes", default="124m", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--out", required=True, help="JSON result file")
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: the system's temp dir)")
    p.add_argument("--methods", default=",".join(METHOD_GROUPS),
                   help=f"comma-separated groups of methods to run, of {', '.join(METHOD_GROUPS)} (a large size can "
                        "be split over runs); the stall runs whenever the size is among --stall-sizes")
    p.add_argument("--repeats", type=int, default=None, help="repeats per method (default: cpu 3, cuda 1)")
    p.add_argument("--stall-steps", type=int, default=None,
                   help="steps without a save before and after each stall run (default: cpu 8, cuda 4)")
    p.add_argument("--stall-repeats", type=int, default=None, help="stall runs per method (default: cpu 3, cuda 1)")
    p.add_argument("--stall-max-steps", type=int, default=None,
                   help="at most this many steps measured in flight (default: cpu 160, the whole save; cuda 12)")
    p.add_argument("--stall-sizes", default=None,
                   help="sizes whose step stall is measured (default: cpu every size, cuda the largest one; "
                        "'none': no stall runs)")
    p.add_argument("--cuda-batch", type=int, default=1, help="micro-batch of the CUDA stall step")
    p.add_argument("--cuda-seq", type=int, default=512,
                   help="tokens per sequence of the CUDA stall step (a short step keeps the GPU run within minutes)")
    args = p.parse_args(argv)
    args.methods = [g.strip() for g in args.methods.split(",") if g.strip()]
    if not args.methods or [g for g in args.methods if g not in METHOD_GROUPS]:
        p.error(f"--methods: {args.methods} (choose from {', '.join(METHOD_GROUPS)})")
    sizes = [s.strip().lower() for s in args.sizes.split(",") if s.strip()]
    bad = [s for s in sizes if s not in SIZES]
    if bad or not sizes:
        p.error(f"--sizes: unknown size(s) {bad} (choose from {', '.join(SIZES)})")
    cpu = args.device == "cpu"
    stall_sizes = [x.strip().lower() for x in (args.stall_sizes or "").split(",") if x.strip()]
    if stall_sizes == ["none"]:
        args.stall_sizes = []
    elif [x for x in stall_sizes if x not in sizes]:
        p.error(f"--stall-sizes: {[x for x in stall_sizes if x not in sizes]} not among --sizes {sizes}")
    else:
        args.stall_sizes = stall_sizes or (sizes if cpu else sizes[-1:])
    for name, default in (("repeats", 3 if cpu else 1), ("stall_repeats", 3 if cpu else 1),
                          ("stall_max_steps", 160 if cpu else 12), ("stall_steps", 8 if cpu else 4)):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if min(args.repeats, args.stall_steps, args.stall_repeats, args.cuda_batch, args.cuda_seq) < 1 or \
            args.stall_max_steps < 3:
        p.error("--repeats, --stall-steps, --stall-repeats, --cuda-batch and --cuda-seq must be >= 1, "
                "--stall-max-steps >= 3")
    if args.cuda_seq > 1024:
        p.error(f"--cuda-seq {args.cuda_seq}: GPT-2's context is 1024 tokens")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not cpu:
        import blutensor as bt

        if not bt.cuda.is_available():
            p.error("--device cuda: no CUDA GPU visible to blutensor (CuPy)")
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():  # DCP in a one-process gloo group
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    result: dict[str, Any] = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix() if argv is None else "benchmarks/"
                                         "checkpoint_bench.py", *(sys.argv[1:] if argv is None else argv)]),
        "what": "checkpoint save/load of GPT-2 + AdamW state (blumodels.state.training_state): BluTrain "
                "CheckpointManager vs torch.save/torch.load vs PyTorch DCP (sync, async_save), same tensors, "
                "one run; seconds are medians of the repeats; stall = in-flight step / plain step - 1",
        "device": args.device, "repeats": args.repeats, "stall_steps": args.stall_steps,
        "io_threads": io_threads(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "affinity": len(os.sched_getaffinity(0)), "python": platform.python_version(),
                    "torch": torch.__version__, "numpy": np.__version__,
                    "loadavg_start": os.getloadavg()[0]},
        "sizes": [],
    }
    try:
        for s in sizes:
            result["sizes"].append(run_size(s, args, root))
            result["machine"]["loadavg_end"] = os.getloadavg()[0]
            out.write_text(json.dumps(result, indent=1) + "\n")  # after every size: a partial run keeps its rows
            gc.collect()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()
    _print_table(result)
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _print_table(result: dict) -> None:
    print(f"{'size':>6} {'method':>22} {'return_s':>9} {'durable_s':>9} {'load_s':>8} {'GB/s':>7}")
    for r in result["sizes"]:
        for m, v in r["methods"].items():
            print(f"{r['size']:>6} {m:>22} {v.get('return_s', ''):>9} {v.get('durable_s', ''):>9} "
                  f"{v.get('total_s', ''):>8} {v['GBps']:>7}")
        for m, v in r.get("stall", {}).items():
            print(f"{r['size']:>6} {'stall ' + m:>22} {v['stall']:+.3f} ({v['base_step_ms']} -> "
                  f"{v['inflight_step_ms']} ms, {v['inflight_steps']} steps)")


if __name__ == "__main__":
    sys.exit(main())
