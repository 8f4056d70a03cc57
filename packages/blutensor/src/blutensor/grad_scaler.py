"""``GradScaler``: dynamic loss scaling for float16 training, with PyTorch's ``torch.amp.GradScaler``
semantics (also reachable as ``bt.amp.GradScaler`` and ``bt.cuda.amp.GradScaler``).

``scale(loss)`` multiplies by the current scale; ``unscale_(opt)`` divides the gradients by it in place and
records whether any is inf/NaN; ``step(opt)`` skips the update of an optimizer whose gradients overflowed;
``update()`` halves the scale after an overflow (``backoff_factor``) and doubles it (``growth_factor``)
after ``growth_interval`` clean steps. ``enabled=False`` makes every call a pass-through, so one training
loop serves fp16, bf16 and fp32 (as nanoGPT's train.py writes it)."""

from __future__ import annotations

import numbers

from blutensor.autograd.grad_mode import no_grad
from blutensor.errors import ArgumentError, DTypeError

_READY, _UNSCALED, _STEPPED = 0, 1, 2


class GradScaler:
    def __init__(self, device: str = "cuda", init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True):
        if not isinstance(enabled, bool):
            raise DTypeError(f"GradScaler: enabled must be a bool, got {type(enabled).__name__}")
        for name, v, ok in (("init_scale", init_scale, lambda x: x > 0), ("growth_factor", growth_factor,
                                                                         lambda x: x > 1.0),
                            ("backoff_factor", backoff_factor, lambda x: 0 < x < 1.0)):
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not ok(v):
                raise ArgumentError(f"GradScaler: invalid {name} {v!r} (init_scale > 0, growth_factor > 1, "
                                    f"0 < backoff_factor < 1)")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval <= 0:
            raise ArgumentError(f"GradScaler: growth_interval must be a positive int, got {growth_interval!r}")
        self.device, self._enabled = device, enabled
        self._scale, self._growth_factor, self._backoff_factor = float(init_scale), growth_factor, backoff_factor
        self._growth_interval, self._growth_tracker = growth_interval, 0
        self._per_optimizer: dict[int, dict] = {}

    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        return self._scale if self._enabled else 1.0

    def scale(self, outputs):
        """``outputs`` (a Tensor or a list/tuple of them) times the current scale."""
        if not self._enabled:
            return outputs
        from blutensor._tensor import Tensor

        if isinstance(outputs, Tensor):
            return outputs * self._scale
        if isinstance(outputs, list | tuple):
            return type(outputs)(self.scale(o) for o in outputs)
        raise DTypeError(f"GradScaler.scale: outputs must be a Tensor or a list/tuple of Tensors, got "
                         f"{type(outputs).__name__}")

    def _state(self, optimizer) -> dict:
        return self._per_optimizer.setdefault(id(optimizer), {"stage": _READY, "found_inf": None})

    @no_grad()
    def unscale_(self, optimizer) -> None:
        """Divide the optimizer's gradients by the scale (in place), e.g. before clip_grad_norm_."""
        if not self._enabled:
            return
        st = self._state(optimizer)
        if st["stage"] == _UNSCALED:
            raise RuntimeError("GradScaler.unscale_() has already been called on this optimizer since the last "
                               "update()")
        if st["stage"] == _STEPPED:
            raise RuntimeError("GradScaler.unscale_() is being called after step()")
        from blutensor.dtypes import float32
        from blutensor.ops._util import xp_of
        from blutensor.ops.elementwise import _convert
        from blutensor.optim.clip import _f32

        inv = 1.0 / self._scale
        found = None
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        for gr in grads:
            xp = xp_of(gr._data)
            vals = _f32(gr) * xp.asarray(inv, dtype=_f32(gr).dtype)
            bad = ~xp.isfinite(vals).all()
            found = bad if found is None else (found | bad)
            if gr.dtype.name in ("float32", "float64"):
                gr._data[...] = vals
            else:
                gr._data[...] = _convert(vals.astype(float32.np), float32, gr.dtype, xp)
            gr._version.v += 1
        st["found_inf"] = None if found is None else bool(found)  # one host read per optimizer and step
        st["stage"] = _UNSCALED

    def step(self, optimizer, *args, **kwargs):
        """``optimizer.step()`` unless its unscaled gradients hold an inf/NaN (then the step is skipped)."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("GradScaler.step: closure use is not currently supported if GradScaler is enabled")
        st = self._state(optimizer)
        if st["stage"] == _STEPPED:
            raise RuntimeError("GradScaler.step() has already been called since the last update()")
        if st["stage"] == _READY:
            self.unscale_(optimizer)
        if st["found_inf"] is None:
            raise RuntimeError("GradScaler.step: no inf checks were recorded for this optimizer (no parameter has a "
                               "gradient)")
        st["stage"] = _STEPPED
        return None if st["found_inf"] else optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | None = None) -> None:
        """Back off after an overflow, grow after ``growth_interval`` clean steps (or set ``new_scale``)."""
        if not self._enabled:
            return
        if new_scale is not None:
            self._scale = float(new_scale)
        else:
            states = [s for s in self._per_optimizer.values() if s["found_inf"] is not None]
            if not states:
                raise RuntimeError("GradScaler.update: no inf checks were recorded prior to update()")
            if any(s["found_inf"] for s in states):
                self._scale *= self._backoff_factor
                self._growth_tracker = 0
            else:
                self._growth_tracker += 1
                if self._growth_tracker == self._growth_interval:
                    self._scale *= self._growth_factor
                    self._growth_tracker = 0
        self._per_optimizer.clear()

    def state_dict(self) -> dict:
        if not self._enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self._growth_factor, "backoff_factor": self._backoff_factor,
                "growth_interval": self._growth_interval, "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state_dict: dict) -> None:
        if not self._enabled:
            return
        if not isinstance(state_dict, dict) or "scale" not in state_dict:
            raise ArgumentError("GradScaler.load_state_dict: the state dict is empty (saved from a disabled "
                                "GradScaler?) or not from GradScaler.state_dict()")
        self._scale = float(state_dict["scale"])
        self._growth_factor = state_dict["growth_factor"]
        self._backoff_factor = state_dict["backoff_factor"]
        self._growth_interval = state_dict["growth_interval"]
        self._growth_tracker = state_dict["_growth_tracker"]
