"""The whole GPT-2 training step (forward, backward, clip, AdamW) captured in one CUDA graph and replayed.

What changes from step to step lives in device memory and is updated INSIDE the graph: the step index
(which picks this step's learning rate from a device table of the whole schedule) and AdamW's step count
(bias corrections). The batch is copied into static input buffers before each replay; the loss and the
gradient norm land in static device buffers that the host reads only when it wants them (log time).
Gradients live in static views of one flat buffer per dtype, zeroed by ONE fill inside the graph; the
captured backward accumulates into them in place. Warm-up steps run eagerly first (they create the
optimizer state and every kernel/plan cache).

Precision 'bf16' captures the autocast step: forward + loss run inside ``bt.autocast`` in the body, so the
weight casts (fp32 master -> bf16) are recorded in the graph and redone by every replay from the freshly
updated masters; the autocast cast cache is cleared when the region exits inside the capture, so no CuPy
array from the capture is ever looked up again on the host.

Refused, with the reason: CPU device, gradient accumulation, optimizer-in-backward, world_size > 1,
activation checkpointing, dropout > 0 (the dropout RNG offset is a host counter baked into captured
launches: every replay would reuse one mask), nan_policy='skip' (the skip decision would need the host
inside the step), non-fused AdamW, and the 'xp' GEMM provider (CuPy's cuBLAS refuses stream capture).

``capture`` is pluggable: :class:`CudaCapture` (real) or any object with the same two methods, so the
step logic (static buffers, device schedule, host bookkeeping, no host reads) is tested on CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import blutensor as bt
import numpy as np

from blumodels.config import ConfigError

#: eager steps before the capture (the first creates AdamW's moments; later ones fill plan caches)
WARMUP_STEPS = 2


def check_config(cfg) -> None:
    """Raise ConfigError naming the key when ``train.cuda_graph`` cannot honour the rest of the config."""
    t, m = cfg.train, cfg.model
    if not t.cuda_graph:
        return
    why = "train.cuda_graph = true captures one whole optimisation step"
    if t.device == "cpu":
        raise ConfigError("train.cuda_graph = true needs a CUDA device (train.device = 'cpu'); set it false on CPU")
    if cfg.grad_accum > 1:
        raise ConfigError(f"{why}; gradient accumulation (grad_accum = {cfg.grad_accum}) is not supported: set "
                          f"train.batch_tokens = micro_batch*seq_len*world_size")
    if t.optimizer_in_backward:
        raise ConfigError(f"{why}; train.optimizer_in_backward is not supported with it: set one of them false")
    if t.world_size > 1:
        raise ConfigError(f"{why}; train.world_size > 1 is not supported (the gradient all-reduce is not captured)")
    if m.dropout > 0:
        raise ConfigError(f"train.cuda_graph = true needs model.dropout = 0 (got {m.dropout}): the dropout RNG "
                          f"offset is a host counter baked into the captured kernels, so every replay would "
                          f"reuse one mask")
    if t.nan_policy == "skip":
        raise ConfigError(f"{why}; train.nan_policy = 'skip' needs a host decision inside the step: use 'stop'")
    if not t.fused_adamw:
        raise ConfigError("train.cuda_graph = true needs train.fused_adamw = true (the fused AdamW kernel reads "
                          "lr and step from device memory)")
    if t.activation_checkpointing:
        raise ConfigError("train.cuda_graph = true is not supported with train.activation_checkpointing yet")


def check_runtime(device: str) -> None:
    """Refuse a resolved CPU device and a GEMM provider that cannot be captured."""
    if not str(device).startswith("cuda"):
        raise ConfigError(f"train.cuda_graph = true needs a CUDA device; the run resolved to {device!r}")
    from blutensor.gemm import XpGemm, get_gemm_provider

    if get_gemm_provider() is XpGemm:
        raise ConfigError("train.cuda_graph = true: the GEMM provider 'xp' (cupy.matmul) cannot be captured; "
                          "install blublas and use BLUTRAIN_GEMM=cublas or blublas")


class CudaCapture:
    """Real capture: the body is recorded into a bt.cuda.CUDAGraph (private pool, side stream)."""

    def __init__(self) -> None:
        self.graph = None

    def capture(self, body: Callable[[], None]) -> None:
        from blutensor.cuda_graph import CUDAGraph, graph

        self.graph = CUDAGraph()
        try:
            with graph(self.graph):
                body()
        except Exception as e:
            from blutensor.gemm import get_gemm_provider

            raise RuntimeError(
                f"capturing the training step into a CUDA graph failed: {type(e).__name__}: {e}. Something in the "
                f"step synchronised with the host or called a library that refuses capture (GEMM provider: "
                f"{getattr(get_gemm_provider(), 'PLUGIN_NAME', '?')}; CuPy's cuBLAS cannot be captured, and CuPy "
                f"sorts (embedding backward's argsort) synchronise on CuPy builds without cupy#9497); run with "
                f"train.cuda_graph = false, or see packages/blumodels/dev/gpu_check_graph.py (check c) to find it"
            ) from e

    def replay(self) -> None:
        self.graph.replay()


class EagerCapture:
    """CPU twin of :class:`CudaCapture`: 'capture' records the body, 'replay' runs it (the same code path)."""

    def __init__(self) -> None:
        self.body = None
        self.captures = 0

    def capture(self, body: Callable[[], None]) -> None:
        self.body = body
        self.captures += 1

    def replay(self) -> None:
        self.body()


def _f32(t):
    """A 0-d Tensor's value as a float32 array on its device (bf16 bits widened), without a host read."""
    d = t._data
    if t.dtype.name == "bfloat16" and d.dtype == np.uint16:
        from blutensor.backend import bf16_bits_to_f32

        return bf16_bits_to_f32(d, _xp(d))
    return d.astype(np.float32, copy=False)


def _xp(arr):
    return np if isinstance(arr, np.ndarray) else __import__("cupy")


def _static_grads(params, device):
    """Static gradient tensors for ``params``: views into one zeroed flat buffer per dtype (each view 256-byte
    aligned), so the captured step zeroes all gradients with one fill instead of one per parameter."""
    align = 64
    by_dtype: dict = {}
    for i, p in enumerate(params):
        by_dtype.setdefault(p.dtype, []).append(i)
    grads: list = [None] * len(params)
    bufs = []
    for dt, idx in by_dtype.items():
        sizes = [int(np.prod(params[i].shape, dtype=np.int64)) for i in idx]
        padded = [-(-n // align) * align for n in sizes]
        buf = bt.zeros(max(1, sum(padded)), dtype=dt, device=device)._data
        bufs.append(buf)
        off = 0
        for i, n, pn in zip(idx, sizes, padded):
            grads[i] = bt.Tensor._from_data(buf[off:off + n].reshape(params[i].shape), dt, params[i].device)
            off += pn
    return grads, bufs


class GraphedTrainStep:
    """One training step of ``model`` + ``optimizer`` (blutensor AdamW, one lr schedule for every group)
    captured once and replayed with a new batch.

    lr_schedule: the lr of every step index 0..len-1 (copied to the device once); grad_clip: 0 = off;
    autocast: a factory of the context manager forward + loss run in (e.g. ``lambda: bt.autocast("cuda")``).
    Call :meth:`capture` after at least one eager optimizer step, then :meth:`step` once per step.
    """

    def __init__(self, model, optimizer, lr_schedule: Sequence[float], grad_clip: float, batch_shape: tuple,
                 device: str, capture: Any = None, opt_step: Callable | None = None,
                 autocast: Callable[[], Any] | None = None) -> None:
        self.model, self.optimizer, self.grad_clip = model, optimizer, float(grad_clip)
        self.autocast = autocast  # forward + loss run inside autocast() when given (train.precision 'bf16')
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.device = device
        self.capturer = capture if capture is not None else CudaCapture()
        self.x = bt.zeros(*batch_shape, dtype=bt.int64, device=device)
        self.y = bt.zeros(*batch_shape, dtype=bt.int64, device=device)
        xp = _xp(self.x._data)
        self.xp = xp
        self.lr_table = xp.asarray(np.asarray(list(lr_schedule), dtype=np.float32))
        self.step_idx = xp.zeros(1, dtype=np.int64)  # index into lr_table of the step the next replay runs
        self.step_count = xp.zeros(1, dtype=np.float32)  # AdamW's step count (bias corrections)
        self.lr_dev = xp.zeros(1, dtype=np.float32)
        self.loss = xp.zeros((), dtype=np.float32)  # static outputs, read by the host only when wanted
        self.grad_norm = xp.zeros((), dtype=np.float32)
        self.next_step: int | None = None
        self._opt_step = opt_step or (self._host_opt_step if xp is np else self._fused_opt_step)
        self.grads, self._grad_bufs = _static_grads(self.params, device)  # views of flat buffers
        self._base_count = 0
        self._base_step = 0

    # ------------------------------------------------------------------ the captured body
    def _fused_opt_step(self, lr_dev, step_dev) -> None:
        from blutensor.cuda_ops.adamw import fused_step

        for g in self.optimizer.param_groups:
            fused_step(self.optimizer, g, lr_dev=lr_dev, step_dev=step_dev)

    def _host_opt_step(self, lr_dev, step_dev) -> None:
        """CPU twin of the fused step: blutensor's AdamW update with lr and step read from the 'device' arrays."""
        from blutensor.optim.adamw import adamw_update

        lr, n = float(lr_dev[0]), int(step_dev[0])
        for g in self.optimizer.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                st = self.optimizer.state[p]
                adamw_update(p, st["exp_avg"]._data, st["exp_avg_sq"]._data, n, lr, b1, b2, g["eps"],
                             g["weight_decay"])

    def _body(self) -> None:
        xp = self.xp
        xp.take(self.lr_table, self.step_idx, out=self.lr_dev)  # this step's lr, read on device
        self.step_count += 1
        for p, g in zip(self.params, self.grads):
            p.grad = g
        for buf in self._grad_bufs:
            buf.fill(0)  # zeroed inside the graph (one fill per flat buffer); backward accumulates in place
        if self.autocast is None:
            _, loss = self.model(self.x, self.y)
        else:  # like the eager Trainer: forward + loss autocast, backward outside
            with self.autocast():
                # every weight cast in one launch (CUDA), cached for the forward; their backward adds the bf16
                # weight gradients straight into the static fp32 grads (one kernel each, no widened copy)
                bt.amp.precast(self.params, accumulate=True)
                _, loss = self.model(self.x, self.y)
        loss.backward()
        if self.grad_clip > 0:
            gn = bt.optim.clip_grad_norm_(self.params, self.grad_clip)
            self.grad_norm[...] = _f32(gn)
        self._opt_step(self.lr_dev, self.step_count)
        self.loss[...] = _f32(loss)
        self.step_idx += 1

    # ------------------------------------------------------------------ capture and replay
    def capture(self, step: int) -> None:
        """Record the step whose index is ``step`` (it does not run); the optimizer state must exist."""
        missing = [i for i, p in enumerate(self.params) if p.requires_grad and p not in self.optimizer.state]
        if missing:
            raise RuntimeError(f"GraphedTrainStep.capture: parameters {missing[:5]} have no optimizer state yet; "
                               f"run at least one eager step first (its moments must not be created in the graph)")
        if step >= len(self.lr_table):
            raise ValueError(f"GraphedTrainStep.capture: step {step} is past the lr schedule ({len(self.lr_table)})")
        counts = {int(self.optimizer.state[p]["step"]) for p in self.params if p in self.optimizer.state}
        if len(counts) != 1:
            raise RuntimeError(f"GraphedTrainStep.capture: parameters have different AdamW step counts {counts}")
        host_count = counts.pop()
        xp = self.xp
        self.step_idx[...] = xp.asarray(np.array([step], dtype=np.int64))
        self.step_count[...] = xp.asarray(np.array([host_count], dtype=np.float32))
        if xp is not np:  # everything that copies host data to the device happens now, not in the capture
            from blutensor.cuda_ops import index_check
            from blutensor.cuda_ops.adamw import prepare_group
            from blutensor.cuda_ops.norm import _table

            index_check.flag_array()
            for p, g in zip(self.params, self.grads):
                p.grad = g
            # the multi-tensor tables the captured launches read: built now and held as long as the graph
            self._keep = [prepare_group(self.optimizer, grp) for grp in self.optimizer.param_groups]
            if self.grad_clip > 0:
                self._keep.append(_table([g._data for g in self.grads]))
            if self.autocast is not None:  # build the multi-tensor weight cast's table and load its kernel now
                from blutensor.cuda_ops import cast

                with self.autocast():
                    bt.amp.precast(self.params)  # the body's exact call, run once for real (casts dropped)
                self._keep.extend(cast._multi.values())  # the graph reads these tables: hold them
            # compile/load the few CuPy kernels only the captured body uses (no module loads while capturing)
            xp.take(self.lr_table, self.step_idx, out=self.lr_dev)
            self.step_count += 0
            self.step_idx += 0
            self.grad_norm[...] = self.loss
        self._base_count, self._base_step = host_count, step
        self.capturer.capture(self._body)
        self._set_counts(host_count)  # a real capture ran fused_step's host bookkeeping without a step
        self.next_step = step

    def step(self, x, y, step: int):
        """Copy the batch in and replay; returns (loss, grad_norm) as static device arrays (no host read)."""
        if self.next_step is None:
            raise RuntimeError("GraphedTrainStep.step before capture()")
        if step != self.next_step:
            raise RuntimeError(f"GraphedTrainStep.step: the graph is at step {self.next_step}, asked for {step} "
                               f"(steps must follow each other; capture again after a jump)")
        if step >= len(self.lr_table):
            raise ValueError(f"GraphedTrainStep.step: step {step} is past the lr schedule ({len(self.lr_table)})")
        for dst, src in ((self.x, x), (self.y, y)):
            s = getattr(src, "_data", src)
            if tuple(s.shape) != tuple(dst.shape):
                raise ValueError(f"GraphedTrainStep.step: batch shape {tuple(s.shape)} != captured {tuple(dst.shape)}")
            if _xp(s) is not self.xp:
                raise ValueError("GraphedTrainStep.step: the batch must already be on the step's device")
            dst._data[...] = s
        for p, g in zip(self.params, self.grads):
            p.grad = g  # the graph writes these arrays (someone may have called zero_grad in between)
        self.capturer.replay()
        # host step counts (state_dict, checkpoints) follow the device count
        self._set_counts(self._base_count + step - self._base_step + 1)
        for p in self.params:
            p._version.v += 1
        self.next_step = step + 1
        return self.loss, self.grad_norm

    def _set_counts(self, n: int) -> None:
        for p in self.params:
            st = self.optimizer.state.get(p)
            if st is not None:
                st["step"] = n


def schedule(cfg, total: int) -> list[float]:
    """The trainer's lr for every step index 0..total-1 (warmup + cosine; min_lr past train.steps, so the
    table runs 65536 steps past it for fit(steps=...) beyond the configured length)."""
    from blumodels.trainer import lr_at

    return [lr_at(s, cfg) for s in range(total)]


def graph_train_step(trainer) -> dict[str, Any]:
    """Trainer.train_step for train.cuda_graph = true: eager warm-up steps, capture, then replays."""
    import time

    from blumodels import metrics

    cfg, t = trainer.cfg, trainer.cfg.train
    s = trainer.step
    gs = getattr(trainer, "_graphed", None)
    if gs is None and getattr(trainer, "_graph_eager_left", None) is None:
        check_runtime(trainer.device)
        trainer._graph_eager_left = WARMUP_STEPS
    if gs is None and trainer._graph_eager_left > 0:
        trainer._graph_eager_left -= 1
        trainer._graph_eager = True
        try:
            return trainer.train_step()
        finally:
            trainer._graph_eager = False
    if gs is None:
        B, T = t.micro_batch, t.seq_len
        lrs = schedule(cfg, max(t.steps, s + 1) + 65536)
        gs = trainer._graphed = GraphedTrainStep(trainer.model, trainer.optimizer, lrs, t.grad_clip, (B, T),
                                                 trainer.device,
                                                 autocast=trainer._autocast if t.precision == "bf16" else None)
        trainer.optimizer.zero_grad()
        gs.capture(s)
    t0 = time.perf_counter()
    x, y = trainer.train_loader.next_batch()
    loss, gnorm = gs.step(x, y, s)
    loss_val = float(loss.item())  # the host reads the static loss once per step, after the replay
    gn = float(gnorm.item()) if t.grad_clip > 0 else None
    if str(trainer.device).startswith("cuda"):  # bad indices recorded on device (the loss read synced)
        from blutensor.cuda_ops import index_check

        index_check.raise_pending()
    if not math.isfinite(loss_val) or (gn is not None and not math.isfinite(gn)):
        from blumodels.trainer import NonFiniteError

        what = f"loss ({loss_val})" if not math.isfinite(loss_val) else "gradient norm"
        raise NonFiniteError(f"step {s}: non-finite {what}; stopping (train.cuda_graph runs nan_policy='stop'; "
                             f"the update of this step was already applied)")
    dt = time.perf_counter() - t0
    tokens = t.micro_batch * t.seq_len
    tps = tokens / dt if dt > 0 else 0.0
    return {"step": s, "loss": loss_val, "lr": schedule_lr(cfg, s),
            "grad_norm": gn, "tokens_per_s": tps,
            "mfu": metrics.mfu(trainer.flops_per_token, tps, trainer.peak),
            "mem_bytes": metrics.memory_bytes(trainer.device.split(":")[0]), "step_ms": dt * 1e3,
            "tokens": (s + 1) * tokens, "cuda_graph": True}


def schedule_lr(cfg, s: int) -> float:
    from blumodels.trainer import lr_at

    return lr_at(s, cfg)
