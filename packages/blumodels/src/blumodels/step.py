"""The training step: the one definition of forward, backward, clipping, the NaN policy and the optimizer update.

The Trainer runs this code in every mode: eagerly (CPU; CUDA with ``train.cuda_graph = false``), captured into
CUDA graphs and replayed (graph_step.py wraps these phases, it does not copy them), and compiled
(``train.compile = true``: ``bt.compile`` traces the same micro-step). The phases:

* :meth:`TrainStep.begin`: zero the gradients, reset the device loss sum, read this step's learning rate from a
  device table of the whole schedule (the device step index picks it);
* :meth:`TrainStep.micro`: forward (bf16 autocast when asked) and backward of one micro-batch; the loss is
  added to the device loss sum; under DDP the gradients are reduced only when ``sync`` (the last micro-step);
  each micro-step's backward starts from its own loss (gradient 1), so the buffers hold gradient sums;
* :meth:`TrainStep.finish`: the sums made means (one scale by ``1 / accum``), the global gradient norm
  (clipping it when ``train.grad_clip > 0``), a device flag set when the loss or the norm is not finite, and the
  optimizer update, which that flag skips ON THE DEVICE (the fused AdamW kernel reads it), so ``nan_policy``
  holds in a captured step without a host decision.

Nothing in these phases reads device memory on the host: the host reads the loss, the norm and the flag once,
after the step (:meth:`TrainStep.read`), for the log record and the NaN policy's verdict.

Gradients live in static views of one flat buffer per dtype (:func:`flat_grads`), zeroed by one fill per
buffer and accumulated in place: a captured step finds the same arrays at every replay, and an eager step costs
no gradient allocations. Optimizer-in-backward keeps no gradients (it frees each one as soon as it is used);
:meth:`TrainStep.begin` writes the lr and the update count its per-parameter updates read on the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import blutensor as bt
import numpy as np


def _xp(arr):
    return np if isinstance(arr, np.ndarray | np.generic) else __import__("cupy")


def f32(t):
    """A 0-d Tensor's value as a float32 array on its device (bf16 bits widened), without a host read."""
    d = t._data
    if t.dtype.name == "bfloat16" and d.dtype == np.uint16:
        from blutensor.ext import bf16_bits_to_f32

        return bf16_bits_to_f32(d, _xp(d))
    return d.astype(np.float32, copy=False)


def flat_grads(params, device) -> tuple[list, list]:
    """Gradient tensors for ``params``: views into one zeroed flat buffer per dtype (each view 256-byte aligned),
    so a step zeroes every gradient with one fill per buffer; returns (grads, flat buffers)."""
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


@dataclass
class StepResult:
    """What the host reads after a step: the mean micro-step loss (this rank), the gradient norm (None with
    optimizer-in-backward) and whether the step found a non-finite loss or gradient (its update was skipped)."""

    loss: float
    grad_norm: float | None
    nonfinite: bool


class TrainStep:
    """One optimisation step of ``module`` (the model, or its DDP wrapper) with ``optimizer``.

    ``lr_schedule``: the learning rate of every step index (copied to the device once); ``accum``: micro-steps
    per step; ``autocast``: a factory of the context forward + loss run in (bf16), or None; ``no_sync(skip)``:
    the context that suppresses DDP's reduction during the first ``accum - 1`` micro-steps; ``fused``: update
    through the fused multi-tensor AdamW kernel (CUDA; lr, step count and the skip flag read on the device);
    ``optimizer_in_backward``: the optimizer (a ``blutensor.utils.OptimizerInBackward``) steps inside backward (no
    static gradients, no update here); on the CPU, and on CUDA with ``fused``, its per-parameter AdamW updates
    read lr and update count from the device arrays :meth:`begin` writes, so that step can be captured.
    ``norm(params, max_norm)``: the global gradient norm (clipping to ``max_norm``; inf = no clipping) where the
    gradients are sharded (a [parallel] mesh); ``static_grads=False``: gradients as the wrapped module leaves
    them, dropped by ``optimizer.zero_grad()`` at the start of each step. ``device_rng``: dropout draws read and
    advance the default generator's counter in device memory (the masks a captured step replays change every
    step; they equal the host counter's masks).
    """

    def __init__(self, module, optimizer, params: Sequence, *, device: str, lr_schedule: Sequence[float],
                 accum: int = 1, grad_clip: float = 0.0, autocast: Callable[[], Any] | None = None,
                 no_sync: Callable[[bool], Any] | None = None, fused: bool = False,
                 optimizer_in_backward: bool = False, norm: Callable[[list, float], Any] | None = None,
                 static_grads: bool = True, device_rng: bool = False) -> None:
        self.module, self.optimizer = module, optimizer
        self.params = list(params)
        self.device, self.accum, self.grad_clip = device, int(accum), float(grad_clip)
        self.autocast, self.fused, self.oib = autocast, bool(fused), bool(optimizer_in_backward)
        self._no_sync = no_sync
        self.precast_accumulate = False  # set by the captured step: bf16 cast backward adds into .grad
        #: bf16 weight copies kept across steps (CUDA, autocast, fused AdamW): AdamW writes them as it updates the
        #: weights, precast uses them as the weight casts (made on the first micro-step)
        self.weight_copies = None
        probe = bt.zeros(1, device=device)._data
        xp = self.xp = _xp(probe)
        self.lr_table = xp.asarray(np.asarray(list(lr_schedule), dtype=np.float32))
        self.step_idx = xp.zeros(1, dtype=np.int64)  # the step the next begin() reads the lr of
        self.lr_dev = xp.zeros(1, dtype=np.float32)
        self.step_count = xp.zeros(1, dtype=np.float32)  # AdamW's count of applied updates (fused path)
        self.loss_sum = xp.zeros((), dtype=np.float32)
        # the loss sum as a tensor: micro() adds to it with a tensor op, so a tracer (bt.compile) records it
        self._loss_acc = bt.Tensor._from_data(self.loss_sum, bt.float32, bt.device(device))
        self.grad_norm = xp.zeros((), dtype=np.float32)
        self.found_inf = xp.zeros(1, dtype=np.float32)
        self._norm = norm
        self.device_rng = bool(device_rng)
        self._oib_lr = None
        if self.oib and (self.fused or xp is np):
            # the per-parameter updates inside backward read lr and update count from these arrays (a captured
            # backward replays each step's values); on the host the lr stays float64, the value the host
            # optimizers use, so the results equal plain training's bit for bit
            if not hasattr(optimizer, "set_device_scalars"):
                raise TypeError(f"TrainStep(optimizer_in_backward=True) needs a blutensor.utils.OptimizerInBackward, "
                                f"got {type(optimizer).__name__}")
            self._oib_lr_table = np.asarray(list(lr_schedule), dtype=np.float64) if xp is np else self.lr_table
            self._oib_lr = np.zeros(1, dtype=np.float64) if xp is np else self.lr_dev
            optimizer.set_device_scalars(lr=self._oib_lr, step=self.step_count)
        use_flat = static_grads and not self.oib
        self.grads, self.grad_bufs = flat_grads(self.params, device) if use_flat else ([], [])
        # each flat buffer as one tensor of its dtype (flat_grads makes one a dtype, in first-use order)
        dts = list(dict.fromkeys(p.dtype for p in self.params))
        self._flat = [bt.Tensor._from_data(b, dt, bt.device(device)) for b, dt in zip(self.grad_bufs, dts)]
        self.applied = 0  # updates applied so far (the host AdamW step counts follow it on the fused path)
        if self.fused and not self.oib and xp is not np:
            self._allocate_state()

    def _allocate_state(self) -> None:
        """Make the step's long-lived device buffers now, before any activation exists: AdamW's moments (as its
        first update would: zeros, step 0) and the bf16 weight copies. Made lazily, they would be carved out of
        the first step's freed activation blocks, pinning those segments in the caching allocator, so the memory
        the warm-up steps used could not be given back before the captured graphs take their own."""
        opt = self.optimizer
        if isinstance(opt, bt.optim.AdamW) and not any(g.get("amsgrad") for g in opt.param_groups):
            opt.init_state()
        self._copies()

    @property
    def oib_on_device(self) -> bool:
        """Optimizer-in-backward whose per-parameter updates read lr and update count on the device (capturable)."""
        return self._oib_lr is not None

    # ------------------------------------------------------------------ position
    def seek(self, step: int) -> None:
        """Put the device step index at ``step`` and the update count at the optimizer's (start or resume)."""
        if not 0 <= step < len(self.lr_table):
            raise ValueError(f"TrainStep: step {step} is outside the lr schedule (0..{len(self.lr_table) - 1})")
        xp = self.xp
        self.step_idx[...] = xp.asarray(np.array([step], dtype=np.int64))
        counts = {int(st["step"]) for st in self.optimizer.state.values() if isinstance(st, dict) and "step" in st}
        if len(counts) > 1:
            raise RuntimeError(f"TrainStep: parameters have different AdamW step counts {sorted(counts)}")
        self.applied = counts.pop() if counts else 0
        self.step_count[...] = xp.asarray(np.array([self.applied], dtype=np.float32))
        gen = bt.random.default_generator
        if self.device_rng:  # the device counter starts at the host one (a fresh start or a restored checkpoint)
            gen.use_device_offset(xp)
        else:
            gen.use_host_offset()

    def release(self) -> None:
        """Leave the default generator drawing at its host counter again (the run is over)."""
        if self.device_rng:
            bt.random.default_generator.use_host_offset()

    def bind_grads(self) -> None:
        """Point every parameter's ``.grad`` at its static gradient (someone may have called zero_grad)."""
        for p, g in zip(self.params, self.grads):
            p.grad = g

    # ------------------------------------------------------------------ the phases (no host reads)
    def begin(self, lr: float) -> None:
        """Zero the gradients and the loss sum; this step's lr on the host (``lr``, for host optimizers and the
        log) and on the device (read from the schedule table at the device step index)."""
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        if self.grads:
            self.bind_grads()
            for buf in self.grad_bufs:
                buf.fill(0)
        elif not self.oib:
            self.optimizer.zero_grad()
        self.loss_sum.fill(0)
        self.xp.take(self.lr_table, self.step_idx, out=self.lr_dev)
        if self._oib_lr is not None:  # the updates of this backward: its lr, and one more applied update
            if self._oib_lr is not self.lr_dev:
                self.xp.take(self._oib_lr_table, self.step_idx, out=self._oib_lr)
            self.step_count += 1

    def micro(self, x, y, sync: bool = True) -> None:
        """Forward and backward of one micro-batch; the loss is added to the device loss sum."""
        ctx = self._no_sync(not sync) if self._no_sync is not None else _null()
        with ctx:
            if self.autocast is None:
                _, loss = self.module(x, y)
            else:  # forward + loss autocast, backward outside (as PyTorch's recipe)
                with self.autocast():
                    # every weight cast in one launch (CUDA), cached for the forward; with the fused AdamW the
                    # casts are the bf16 copies its kernel wrote (no launch at all while they are current)
                    bt.amp.precast(self.params, accumulate=self.precast_accumulate, copies=self._copies())
                    _, loss = self.module(x, y)
            # the micro-step's own loss, unscaled: its gradient into the loss is exactly 1, so the fused
            # cross-entropy's backward (whose forward already wrote the logits' gradient) has nothing to do; the
            # sum over micro-steps becomes their mean in finish() (one scale of the gradient buffers a step)
            loss.backward()
        with bt.no_grad():
            self._loss_acc.add_(loss.detach().float())

    def finish(self) -> None:
        """Gradient norm (clipped when asked), the non-finite flag, the update (skipped on the device when the
        flag is set), and the device step index advanced."""
        xp = self.xp
        if not self.oib and self.accum > 1:
            self._mean_grads()
        if not self.oib and self._norm is not None:  # host collectives of a mesh: never captured
            gn = self._norm(self.params, self.grad_clip if self.grad_clip > 0 else float("inf"))
            self.grad_norm[...] = self.xp.asarray(np.float32(gn))
        elif not self.oib:
            if self.grad_clip > 0:
                gn = bt.optim.clip_grad_norm_(self.params, self.grad_clip)
            else:
                gn = bt.optim.get_total_norm([p.grad for p in self.params if p.grad is not None])
            self.grad_norm[...] = f32(gn)
        ok = xp.isfinite(self.loss_sum) & xp.isfinite(self.grad_norm)
        self.found_inf[...] = xp.logical_not(ok).astype(np.float32)
        if not self.oib:
            self._update()
        self.step_idx += 1

    def _mean_grads(self) -> None:
        """The accumulated gradients (sums over the micro-steps) divided by ``accum``: one in-place scale of each
        flat buffer, or of each parameter's gradient where the gradients are not flat (sharded or replaced)."""
        inv = 1.0 / self.accum
        with bt.no_grad():
            if self.grads:
                for flat in self._flat:
                    flat.mul_(inv)
                return
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(inv)

    def _copies(self):
        """The step's :class:`bt.amp.WeightCopies` (made on first use), or None: only for the fused AdamW on CUDA
        under autocast, over the float32 parameters that AdamW updates."""
        if self.weight_copies is None and self.fused and self.autocast is not None and self.xp is not np:
            ps = [p for p in self.params if p.requires_grad and p.dtype is bt.float32 and p.device.type == "cuda"
                  and p._data.flags.c_contiguous]
            if ps and len({p.device for p in ps}) == 1:
                self.weight_copies = bt.amp.WeightCopies(ps)
        return self.weight_copies

    def _update(self) -> None:
        if self.fused:
            from blutensor.ext import fused_adamw_step

            self.step_count += 1 - self.found_inf  # AdamW's bias corrections count applied updates only
            for g in self.optimizer.param_groups:
                fused_adamw_step(self.optimizer, g, lr_dev=self.lr_dev, step_dev=self.step_count,
                                 found_inf=self.found_inf, copies=self.weight_copies)
        elif not bool(self.found_inf[0]):  # host optimizers decide on the host (never captured)
            self.optimizer.step()

    # ------------------------------------------------------------------ the host's one read
    def read(self) -> StepResult:
        """The step's loss (mean over micro-steps), gradient norm and verdict; keeps the host AdamW step counts
        equal to the device's on the fused path (a skipped update does not count)."""
        loss = float(self.loss_sum) / self.accum
        gn = None if self.oib else float(self.grad_norm)
        bad = bool(self.found_inf[0])
        if self.fused or self._oib_lr is not None:  # (optimizer-in-backward applied its updates in backward)
            self.applied += 0 if bad and not self.oib else 1
            for p in self.params:
                st = self.optimizer.state.get(p)
                if st is not None:
                    st["step"] = self.applied
        return StepResult(loss, gn, bad)

    def run(self, batches: Callable[[], tuple], lr: float, micro: Callable[..., None] | None = None) -> None:
        """The whole step eagerly: ``batches()`` gives each micro-step's (x, y). ``micro`` stands in for
        :meth:`micro` (same arguments: x, y, sync), e.g. the compiler plugin's traced micro-step."""
        micro = self.micro if micro is None else micro
        self.begin(lr)
        for i in range(self.accum):
            x, y = batches()
            micro(x, y, i == self.accum - 1)
        self.finish()


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
