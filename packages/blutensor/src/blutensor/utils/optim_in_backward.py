"""The optimizer step fused into backward: each parameter is updated, and its gradient freed, as
soon as its gradient is ready, so at most a few gradients are alive at once (memory-lean training).

Incompatible by construction with gradient accumulation (the step happens in every backward) and
with global-norm clipping (the norm needs every gradient first): callers must refuse those configs.
"""

from __future__ import annotations

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

    @no_grad()
    def _ready(self, p) -> None:
        g = self._groups[id(p)]
        saved = g["params"]
        g["params"] = [p]
        try:
            self.optimizer.step()
        finally:
            g["params"] = saved
        p.grad = None  # free it now: this is the point of the exercise
        self.updates += 1

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
