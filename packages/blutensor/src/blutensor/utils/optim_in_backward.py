"""The optimizer step fused into backward: each parameter is updated, and its gradient freed, as
soon as its gradient is ready, so at most a few gradients are alive at once (memory-lean training).

Incompatible by construction with gradient accumulation (the step happens in every backward) and
with global-norm clipping (the norm needs every gradient first): callers must refuse those configs.

With :meth:`OptimizerInBackward.set_device_scalars` the per-parameter AdamW updates read the learning rate and
the update count from arrays on the parameters' device instead of the host (on CUDA one launch of the
per-tensor AdamW kernel each), so a backward captured into a CUDA graph replays each step's values.
"""

from __future__ import annotations

import numpy as np

from blutensor.autograd.grad_mode import no_grad


class OptimizerInBackward:
    """Wrap ``optimizer``: ``register()`` hooks every parameter; ``step()``/``zero_grad()`` are no-ops.

    The per-parameter update uses the optimizer's own rule on a one-parameter view of its group,
    so AdamW's results equal a normal ``optimizer.step()`` exactly.
    """

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self._groups = {}
        self._handles = []
        self.updates = 0
        self._lr = self._step = None  # device scalars, once set_device_scalars was called
        for g in optimizer.param_groups:
            for p in g["params"]:
                self._groups[id(p)] = g
                self._handles.append(p.register_post_accumulate_grad_hook(self._ready))

    @property
    def state(self) -> dict:
        """The wrapped optimizer's per-parameter state (assignable, e.g. when restoring a checkpoint)."""
        return self.optimizer.state

    @state.setter
    def state(self, value: dict) -> None:
        self.optimizer.state = value

    def set_device_scalars(self, lr, step) -> None:
        """Read the learning rate from ``lr`` and AdamW's update count (its bias corrections) from ``step`` in
        every per-parameter update from now on, instead of the group's ``lr`` and each parameter's host count.

        Both are 1-element arrays on the parameters' device (CuPy float32 on CUDA; NumPy float32 or float64 on
        the CPU, where float64 keeps the host optimizer's lr exactly). The caller writes ``lr`` and advances
        ``step`` by one before each backward; nothing in the update reads them on the host, so a backward
        captured into a CUDA graph replays with new values. The host ``state[p]["step"]`` counts still advance
        on every eager update (state_dict); a graph replay leaves them to the caller. AdamW only (no amsgrad,
        no maximize): its update has the device-scalar kernel.
        """
        from blutensor.errors import ArgumentError, DTypeError
        from blutensor.optim.adamw import AdamW

        if not isinstance(self.optimizer, AdamW):
            raise ArgumentError(f"OptimizerInBackward.set_device_scalars: only AdamW reads lr and step count on the "
                                f"device, the wrapped optimizer is {type(self.optimizer).__name__}")
        for i, g in enumerate(self.param_groups):
            for key in ("amsgrad", "maximize"):
                if g.get(key):
                    raise ArgumentError(f"OptimizerInBackward.set_device_scalars: param group {i} sets {key}=True "
                                        f"(only plain AdamW has the device-scalar update)")
        host = None
        for name, x, kinds in (("lr", lr, (np.float32, np.float64)), ("step", step, (np.float32,))):
            on_host = isinstance(x, np.ndarray)
            if not (on_host or type(x).__module__.startswith("cupy")) or x.size != 1 or x.dtype not in kinds:
                want = "float32" if name == "step" else "float32 (float64 on the CPU)"
                raise DTypeError(f"OptimizerInBackward.set_device_scalars: {name} must be a 1-element {want} "
                                 f"array, got {type(x).__name__} {getattr(x, 'dtype', '')} size "
                                 f"{getattr(x, 'size', '?')}")
            if name == "lr" and not on_host and x.dtype != np.float32:
                raise DTypeError("OptimizerInBackward.set_device_scalars: a CUDA lr must be float32 (the kernel "
                                 f"reads float32), got {x.dtype}")
            if host is not None and host != on_host:
                raise DTypeError("OptimizerInBackward.set_device_scalars: lr and step must live on the same device")
            host = on_host
        for g in self.param_groups:
            for p in g["params"]:
                if isinstance(p._data, np.ndarray) != host:
                    raise DTypeError(f"OptimizerInBackward.set_device_scalars: the scalars are on "
                                     f"{'the host' if host else 'CUDA'} but a parameter of shape "
                                     f"{tuple(p.shape)} is on {p.device}")
        self._lr, self._step = lr, step

    @no_grad()
    def _ready(self, p) -> None:
        g = self._groups[id(p)]
        if self._lr is not None:
            self._device_update(p, g)
        else:
            saved = g["params"]
            g["params"] = [p]
            try:
                self.optimizer.step()
            finally:
                g["params"] = saved
        p.grad = None  # free it now: this is the point of the exercise
        self.updates += 1

    def _device_update(self, p, g) -> None:
        """AdamW of ``p`` with lr and update count read from the device scalars (PyTorch's update order)."""
        from blutensor.creation import zeros_like

        st = self.optimizer.state.get(p)
        if st is None:
            f32 = "float32" if p.dtype.name == "bfloat16" else None
            st = self.optimizer.state[p] = {"step": 0, "exp_avg": zeros_like(p, dtype=f32),
                                            "exp_avg_sq": zeros_like(p, dtype=f32)}
        st["step"] += 1  # host bookkeeping only: the update reads the device count
        (b1, b2), eps, wd = g["betas"], g["eps"], g["weight_decay"]
        m, v = st["exp_avg"]._data, st["exp_avg_sq"]._data
        if isinstance(p._data, np.ndarray):  # the host is the device: the same update as AdamW.step
            from blutensor.optim.adamw import adamw_update

            adamw_update(p, m, v, int(self._step[0]), float(self._lr[0]), b1, b2, eps, wd)
        else:
            from blutensor.backends.cupy.adamw import adamw_tensor_

            adamw_tensor_(p._data, p.grad._data, m, v, self._lr, self._step, b1, b2, eps, wd)
        p._version.v += 1

    def step(self) -> None:
        """Nothing to do: every parameter was updated during backward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: gradients are freed as soon as they are used."""

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.optimizer.load_state_dict(sd)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
