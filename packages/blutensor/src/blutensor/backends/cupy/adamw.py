"""Fused AdamW on CUDA: every parameter of a group updated by ONE kernel launch (kernels/adamw.cu)."""

from __future__ import annotations

import numpy as np

from blutensor.backends.cupy._loader import NULL, cupy, launch
from blutensor.backends.cupy.multi_tensor import table_for
from blutensor.errors import DTypeError

FILE = "adamw.cu"
BLOCK = 512


def _scalar_arg(x, name: str):
    """(host value, device pointer) for a Python number or a 1-element float32 CuPy array."""
    if type(x).__module__.startswith("cupy"):  # a device array
        if x.dtype != np.float32 or x.size != 1:
            raise DTypeError(
                f"multi_tensor_adamw: device {name} must be a 1-element float32 array, got "
                f"dtype {x.dtype} size {x.size}"
            )
        return np.float64(0.0), x
    return np.float64(float(x)), NULL


def _table(params, grads, exp_avgs, exp_avg_sqs, copies=None):
    """The (cached) multi-tensor table of these arrays (and of the bf16 weight copies, when given); building it
    copies to the device, so a CUDA-graph capture must find it cached (see :func:`prepare_group`)."""
    flags = []
    for i, (p, g) in enumerate(zip(params, grads)):
        for what, a in (("param", p), ("grad", g)):
            if a.dtype not in (np.float32, np.uint16):
                raise DTypeError(
                    f"multi_tensor_adamw: {what} {i} has dtype {a.dtype}; expected float32 or bfloat16 bits (uint16)"
                )
        flags.append(int(p.dtype == np.uint16) | (int(g.dtype == np.uint16) << 1))
    if copies is not None:
        for i, (p, c) in enumerate(zip(params, copies)):
            if c.dtype != np.uint16 or c.size != p.size or p.dtype != np.float32:
                raise DTypeError(f"multi_tensor_adamw: copy {i} must be bf16 bits (uint16) of a float32 param's size, "
                                 f"got {c.dtype} size {c.size} for a {p.dtype} param of size {p.size}")
        return table_for((params, grads, exp_avgs, exp_avg_sqs, copies), flags)
    return table_for((params, grads, exp_avgs, exp_avg_sqs), flags)


def _copies_for(copies, items):
    """The bf16 copy arrays of the parameters in ``items`` when ``copies`` (bt.amp.WeightCopies) holds them all."""
    if copies is None or not items or not all(p in copies and p.dtype.name == "float32" for p, _ in items):
        return None
    return [copies.view(p) for p, _ in items]


def prepare_group(optimizer, group, copies=None):
    """Build (and cache) the table fused_step will use for ``group`` with its current gradient arrays (and the
    bf16 weight copies ``copies``, a bt.amp.WeightCopies, as fused_step is given them); returns it (a CUDA graph
    that captures the launch must keep it alive: the cache may evict it)."""
    items = [(p, optimizer.state[p]) for p in group["params"] if p.grad is not None and p in optimizer.state]
    if items:
        cp = cupy()
        return _table(
            [p._data for p, _ in items],
            [cp.ascontiguousarray(p.grad._data) for p, _ in items],
            [st["exp_avg"]._data for _, st in items],
            [st["exp_avg_sq"]._data for _, st in items],
            _copies_for(copies, items),
        )


def multi_tensor_adamw(params, grads, exp_avgs, exp_avg_sqs, step, lr, b1, b2, eps, wd, found_inf=None,
                       copies=None) -> None:
    """AdamW update of all ``params`` (fp32 or bf16-bit CuPy arrays, in place) in one launch.

    grads: fp32 or bf16 bits; exp_avgs/exp_avg_sqs: fp32. ``step`` and ``lr`` may be Python numbers or
    1-element float32 device arrays (read by the kernel, so a captured CUDA graph replays new values).
    ``found_inf``: optional 1-element float32 device flag; when it holds a non-zero value the kernel leaves
    parameters and moments untouched (the step is skipped on the device, as PyTorch's fused Adam does).
    ``copies``: optional bf16-bit arrays, one per (float32) param: the kernel writes each updated param rounded to
    bf16 (nearest even, as the cast kernels) into its copy in the same pass.
    """
    if not params:
        return
    for name, lst in (("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
        for i, a in enumerate(lst):
            if a.dtype != np.float32:
                raise DTypeError(f"multi_tensor_adamw: {name}[{i}] must be float32, got {a.dtype}")
    t = _table(params, grads, exp_avgs, exp_avg_sqs, copies)
    if t.n_chunks == 0:
        return
    lr_v, lr_p = _scalar_arg(lr, "lr")
    st_v, st_p = _scalar_arg(step, "step")
    fi_p = NULL if found_inf is None else _scalar_arg(found_inf, "found_inf")[1]
    launch(
        FILE,
        "blu_adamw_step" if copies is None else "blu_adamw_step_bf16_copy",
        t.n_chunks,
        BLOCK,
        (
            *t.args(),
            lr_v,
            lr_p,
            st_v,
            st_p,
            fi_p,
            np.float64(b1),
            np.float64(b2),
            np.float64(eps),
            np.float64(wd),
        ),
    )


def fused_step(optimizer, group, lr_dev=None, step_dev=None, found_inf=None, copies=None) -> None:
    """One AdamW step of ``group`` of ``optimizer`` (blutensor.optim.AdamW) through multi_tensor_adamw.

    All parameters of the group must share one step count (the usual case); the moments are created as
    in the eager optimizer (fp32, zero). ``lr_dev``/``step_dev``: optional 1-element float32 device arrays the
    kernel reads instead of the group's lr and the host step count (a captured CUDA graph replays new
    values); the host step counts are still advanced, so state_dict stays right. ``found_inf``: a 1-element
    float32 device flag that skips the update on the device when non-zero (the caller, who reads the flag
    later, takes the host step counts back). A group lr that is
    itself a device array (or a 1-element CUDA Tensor) is read on device too. ``copies`` (bt.amp.WeightCopies):
    where it holds every float32 parameter of a launch, the kernel also writes their bf16 copies, which are then
    current for the next autocast region's :func:`bt.amp.precast`.
    """
    from blutensor.optim.adamw import adamw_state

    lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    by_step: dict[int, list] = {}
    for p in group["params"]:
        if p.grad is None:
            continue
        st = adamw_state(optimizer, p)
        st["step"] += 1
        by_step.setdefault(st["step"], []).append((p, st))
    cp = cupy()
    if lr_dev is not None:
        lr = lr_dev
    else:
        lr = getattr(lr, "_data", lr)  # a CUDA Tensor lr: its device array
        if not type(lr).__module__.startswith("cupy"):
            lr = float(lr)
    batches = list(by_step.items())
    if step_dev is not None:  # one device step count for the whole group
        batches = [(step_dev, [it for _, items in batches for it in items])] if batches else []
    for st_key, items in batches:
        cl = _copies_for(copies, items)
        multi_tensor_adamw(
            [p._data for p, _ in items],
            [cp.ascontiguousarray(p.grad._data) for p, _ in items],
            [st["exp_avg"]._data for _, st in items],
            [st["exp_avg_sq"]._data for _, st in items],
            st_key,
            lr,
            b1,
            b2,
            eps,
            wd,
            found_inf,
            cl,
        )
        for p, _ in items:
            p._version.v += 1
        if cl is not None:
            copies.mark([p for p, _ in items])


#: most blocks one per-tensor update launches (a grid-stride loop covers larger tensors)
TENSOR_MAX_BLOCKS = 2048


def adamw_tensor_(param, grad, exp_avg, exp_avg_sq, lr_dev, step_dev, b1: float, b2: float, eps: float,
                  wd: float) -> None:
    """AdamW update of ONE parameter array in place (optimizer-in-backward's per-parameter step).

    ``param``/``grad``: fp32 or bf16-bit CuPy arrays of one size; moments fp32. ``lr_dev`` and ``step_dev``
    (1-element float32 device arrays: this step's learning rate and AdamW's update count for the bias
    corrections) are read by the kernel, so a launch recorded in a CUDA graph replays each step's values. One
    launch, no multi-tensor table (a table would hold the capture's gradient addresses and need a host copy).
    """
    for name, a in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if a.dtype != np.float32:
            raise DTypeError(f"adamw_tensor_: {name} must be float32, got {a.dtype}")
    for what, a in (("param", param), ("grad", grad)):
        if a.dtype not in (np.float32, np.uint16):
            raise DTypeError(f"adamw_tensor_: {what} has dtype {a.dtype}; expected float32 or bfloat16 bits (uint16)")
    if not param.size == grad.size == exp_avg.size == exp_avg_sq.size:
        from blutensor.errors import ShapeError

        raise ShapeError(f"adamw_tensor_: sizes differ (param {param.size}, grad {grad.size}, exp_avg "
                         f"{exp_avg.size}, exp_avg_sq {exp_avg_sq.size})")
    for name, x in (("lr_dev", lr_dev), ("step_dev", step_dev)):
        if not type(x).__module__.startswith("cupy") or x.dtype != np.float32 or x.size != 1:
            raise DTypeError(f"adamw_tensor_: {name} must be a 1-element float32 CuPy array, got "
                             f"{type(x).__name__} {getattr(x, 'dtype', '')} size {getattr(x, 'size', '?')}")
    for name, a in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if not a.flags.c_contiguous:
            from blutensor.errors import ShapeError

            raise ShapeError(f"adamw_tensor_: {name} (shape {a.shape}) must be contiguous (it is updated in place)")
    n = int(param.size)
    if n == 0:
        return
    cp = cupy()
    grad = cp.ascontiguousarray(grad)
    fl = int(param.dtype == np.uint16) | (int(grad.dtype == np.uint16) << 1)
    blocks = min(TENSOR_MAX_BLOCKS, -(-n // BLOCK))
    launch(FILE, "blu_adamw_tensor", blocks, BLOCK,
           (param, grad, exp_avg, exp_avg_sq, np.int64(n), np.int32(fl), lr_dev, step_dev, np.float64(b1),
            np.float64(b2), np.float64(eps), np.float64(wd)))
