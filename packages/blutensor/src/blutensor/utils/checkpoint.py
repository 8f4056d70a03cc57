"""Activation checkpointing: run a block without keeping its activations, recompute them in backward.

The forward runs under ``no_grad`` and keeps only the block's inputs; the backward replays the block
with the graph (restoring the RNG state so dropout masks repeat exactly) and back-propagates through
it. Results and gradients equal the plain run bit for bit; the cost is one extra forward per block.
"""

from __future__ import annotations

from blutensor import amp
from blutensor._tensor import Tensor
from blutensor.autograd import Function
from blutensor.autograd.grad_mode import enable_grad, is_grad_enabled
from blutensor.random import default_generator, get_rng_state, set_rng_state


class _Checkpoint(Function):
    @staticmethod
    def forward(ctx, fn, n_params: int, *args):
        ctx.fn, ctx.rng, ctx.amp = fn, get_rng_state(), amp.state()
        dev = default_generator.device_offset  # a captured step's device counter: the recompute replays it too
        ctx.dev = None if dev is None else dev.copy()
        ctx.inputs = [a.detach() if isinstance(a, Tensor) else a for a in args[n_params:]]
        ctx.params = args[:n_params]
        return fn(*ctx.inputs)

    @staticmethod
    def backward(ctx, g):
        now = get_rng_state()
        set_rng_state(ctx.rng)
        dev = default_generator.device_offset
        now_dev = None
        if dev is not None and ctx.dev is not None:
            now_dev = dev.copy()
            dev[...] = ctx.dev
        try:
            with enable_grad(), amp.restore(ctx.amp):  # recompute in the forward's precision (autocast)
                xs = [x.detach().requires_grad_(x.requires_grad or x.dtype.is_floating_point)
                      if isinstance(x, Tensor) else x for x in ctx.inputs]
                before = [p.grad for p in ctx.params]
                for p in ctx.params:
                    p.grad = None
                y = ctx.fn(*xs)
                y.backward(g)
                pgrads = [p.grad for p in ctx.params]
                for p, b in zip(ctx.params, before):
                    p.grad = b  # the outer engine accumulates the returned gradients (and fires hooks)
        finally:
            set_rng_state(now)
            if now_dev is not None:
                dev[...] = now_dev
        return (None, None, *pgrads, *[x.grad if isinstance(x, Tensor) else None for x in xs])


def checkpoint(fn, *args, params=None):
    """``fn(*args)`` without saving its activations; ``params`` defaults to ``fn.parameters()``.

    The block's parameters are passed through the recorded op, so their gradients reach the
    engine as ordinary inputs: gradient accumulation and "gradient ready" hooks work unchanged.
    """
    if not callable(fn):
        from blutensor.errors import DTypeError

        raise DTypeError(f"checkpoint: fn must be callable (a function or Module), got {type(fn).__name__}")
    if not is_grad_enabled():
        return fn(*args)
    if params is None:
        params = list(fn.parameters()) if hasattr(fn, "parameters") else []
    params = [p for p in params if p.requires_grad]
    return _Checkpoint.apply(fn, len(params), *params, *args)


def checkpoint_modules(model, pattern: str = "blocks.*") -> list[str]:
    """Recompute every submodule whose dotted name matches ``pattern`` in backward (from outside the
    model: each matching module's ``forward`` is wrapped). Returns the names wrapped."""
    import fnmatch

    done = []
    for name, mod in model.named_modules():
        if name and fnmatch.fnmatchcase(name, pattern) and name.count(".") == pattern.count("."):
            inner = type(mod).forward.__get__(mod)
            params = [p for p in mod.parameters() if p.requires_grad]
            object.__setattr__(mod, "forward", lambda *a, _f=inner, _p=params: checkpoint(_f, *a, params=_p))
            done.append(name)
    return done
