"""Assemble and restore the full training state (what a checkpoint holds; docs/design.md, section 6).

Tensors (name -> NumPy array): ``model.<param>`` for every parameter (tied ones once) and
``optim.exp_avg.<param>`` / ``optim.exp_avg_sq.<param>`` for AdamW's moments. Meta (JSON-able):
completed ``step``, per-parameter optimizer step counts, the default generator's RNG state, the loader
position, the run config and a state format version. The CheckpointManager writes and verifies files.
"""

from __future__ import annotations

from typing import Any

import blutensor as bt
import numpy as np

STATE_FORMAT = 1
_MOMENTS = ("exp_avg", "exp_avg_sq")


class StateError(RuntimeError):
    """A checkpoint does not fit the model/optimizer it is restored into (names the tensor)."""


def _host(t: bt.Tensor, copy: bool = True) -> Any:
    """A host copy of a tensor's storage (bfloat16 kept as ml_dtypes.bfloat16); with ``copy=False`` a CPU
    tensor's storage itself, and a device tensor as the detached Tensor (its consumer, the checkpoint manager,
    copies it to reused pinned host buffers asynchronously instead of a blocking pageable copy here)."""
    if not copy and t.device.type != "cpu":
        return t.detach()
    a = t.detach().to("cpu").numpy()
    return np.array(a, copy=True) if copy else a


def training_state(model: bt.nn.Module, optimizer: bt.optim.Optimizer | None, step: int,
                   loader: Any = None, config: dict | None = None,
                   extra: dict | None = None, copy: bool = True) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(tensors, meta) describing everything needed to continue training bit-exactly at ``step``.

    ``copy=False`` returns CPU tensors' storage without copying it (the arrays then change with the next
    optimizer step) and device tensors as detached Tensors: for a caller that writes them before training goes
    on, as ``CheckpointManager.save`` does (a sync save writes them before it returns, an async one snapshots
    them first, device tensors with queued copies into pinned buffers).
    """
    tensors: dict[str, np.ndarray] = {}
    names = {}
    for name, p in model.named_parameters():
        tensors[f"model.{name}"] = _host(p, copy)
        names[id(p)] = name
    opt_steps: dict[str, int] = {}
    if optimizer is not None:
        for p, st in optimizer.state.items():
            name = names.get(id(p))
            if name is None:
                raise StateError("optimizer holds state for a parameter that is not in the model")
            for k in _MOMENTS:
                if k in st:
                    tensors[f"optim.{k}.{name}"] = _host(st[k], copy)
            opt_steps[name] = int(st.get("step", 0))
    meta: dict[str, Any] = {
        "state_format": STATE_FORMAT,
        "step": int(step),
        "optim_steps": opt_steps,
        "rng": bt.get_rng_state(),
        "loader": loader.state_dict() if loader is not None else None,
        "config": config or {},
    }
    if extra:
        meta.update(extra)
    return tensors, meta


def _check_array(key: str, arr: Any, p: bt.Tensor) -> None:
    """StateError naming ``key`` when the stored array cannot become parameter ``p`` (shape, kind of dtype)."""
    if not isinstance(arr, np.ndarray):
        raise StateError(f"checkpoint tensor {key} is a {type(arr).__name__}, not an array")
    if tuple(arr.shape) != tuple(p.shape):
        raise StateError(f"checkpoint tensor {key} has shape {tuple(arr.shape)}, the model's parameter has "
                         f"{tuple(p.shape)}")
    if arr.dtype.kind != "f" and arr.dtype.name != "bfloat16":
        raise StateError(f"checkpoint tensor {key} has dtype {arr.dtype}, the model's parameter is "
                         f"{p.dtype.name} (a floating-point tensor was expected)")


def check_training_state(tensors: dict[str, np.ndarray], meta: dict[str, Any], model: bt.nn.Module,
                         optimizer: bt.optim.Optimizer | None = None, loader: Any = None) -> int:
    """Everything :func:`restore_training_state` checks, changing nothing; returns the completed step.

    StateError (or the loader's ValueError) names the tensor or field that does not fit.
    """
    if not isinstance(meta, dict) or meta.get("state_format") != STATE_FORMAT:
        fmt = meta.get("state_format") if isinstance(meta, dict) else meta
        raise StateError(f"checkpoint state format {fmt!r} is not {STATE_FORMAT}")
    try:
        step = int(meta["step"])
    except (KeyError, TypeError, ValueError):
        raise StateError(f"checkpoint meta has no integer 'step' (got {meta.get('step')!r})") from None
    params = dict(model.named_parameters())
    expected = {f"model.{n}" for n in params}
    got = {k for k in tensors if k.startswith("model.")}
    if expected != got:
        raise StateError(f"checkpoint parameters do not match the model: missing "
                         f"{sorted(expected - got)[:5]}, unexpected {sorted(got - expected)[:5]}")
    for n, p in params.items():
        _check_array(f"model.{n}", tensors[f"model.{n}"], p)
    if optimizer is not None:
        steps = meta.get("optim_steps", {})
        if not isinstance(steps, dict):
            raise StateError(f"checkpoint meta 'optim_steps' must be a dict, got {type(steps).__name__}")
        for n, st_step in steps.items():
            if n not in params:
                raise StateError(f"checkpoint optimizer state names unknown parameter {n!r}")
            if isinstance(st_step, bool) or not isinstance(st_step, int) or st_step < 0:
                raise StateError(f"checkpoint optimizer step count of {n!r} is {st_step!r}, not a count")
            for k in _MOMENTS:
                key = f"optim.{k}.{n}"
                if key not in tensors:
                    raise StateError(f"checkpoint lacks optimizer tensor {key}")
                _check_array(key, tensors[key], params[n])
    if loader is not None and meta.get("loader") is not None:
        loader.check_state_dict(meta["loader"])
    return step


def restore_training_state(tensors: dict[str, np.ndarray], meta: dict[str, Any], model: bt.nn.Module,
                           optimizer: bt.optim.Optimizer | None = None, loader: Any = None,
                           restore_rng: bool = True) -> int:
    """Load parameters, moments, RNG and loader position in place; returns the completed step.

    Everything is checked first (:func:`check_training_state`): on a mismatch nothing has been changed.
    """
    step = check_training_state(tensors, meta, model, optimizer, loader)
    params = dict(model.named_parameters())
    with bt.no_grad():
        for n, p in params.items():
            p.copy_(_host_source(tensors[f"model.{n}"], p))
    if optimizer is not None:
        optimizer.state = {}
        for n, st_step in meta.get("optim_steps", {}).items():
            p = params[n]
            st: dict[str, Any] = {"step": int(st_step)}
            for k in _MOMENTS:
                st[k] = bt.tensor(tensors[f"optim.{k}.{n}"], device=p.device)
            optimizer.state[p] = st
    if restore_rng and meta.get("rng") is not None:
        bt.set_rng_state(meta["rng"])
    if loader is not None and meta.get("loader") is not None:
        loader.load_state_dict(meta["loader"])
    return step


def _host_source(arr: Any, p: bt.Tensor) -> bt.Tensor:
    """``arr`` as a CPU tensor for ``p.copy_``: shared with ``arr`` when the dtypes agree (then a CUDA parameter
    takes one host-to-device copy into its own memory), else converted to ``p``'s dtype."""
    if isinstance(arr, np.ndarray):
        try:
            t = bt.from_numpy(np.ascontiguousarray(arr))
        except bt.DTypeError:
            t = None
        if t is not None and t.dtype == p.dtype:
            return t
    return bt.tensor(arr, dtype=p.dtype)


def sharded_training_state(par: Any, optimizer: bt.optim.Optimizer | None, step: int, loader: Any = None,
                           config: dict | None = None,
                           extra: dict | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """:func:`training_state` of a sharded run (``dtms.parallel.Parallelized``: FSDP / TP / CP), in the
    single-process format: full parameters and moments by their unsharded names, gathered over the mesh.
    A collective on every rank; ``loader`` is the first data-parallel rank's (its position is the step's)."""
    params, moments, steps = par.full_state(optimizer)
    tensors = {f"model.{n}": _host_array(a) for n, a in params.items()}
    for k in _MOMENTS:
        for n, a in moments.get(k, {}).items():
            tensors[f"optim.{k}.{n}"] = _host_array(a)
    meta: dict[str, Any] = {
        "state_format": STATE_FORMAT,
        "step": int(step),
        "optim_steps": {n: int(v) for n, v in steps.items()},
        "rng": bt.get_rng_state(),
        "loader": loader.state_dict() if loader is not None else None,
        "config": config or {},
    }
    if extra:
        meta.update(extra)
    return tensors, meta


def _host_array(a: Any) -> np.ndarray:
    get = getattr(a, "get", None)  # CuPy
    return np.array(get() if callable(get) and not isinstance(a, np.ndarray) else a, copy=True)


def check_sharded_state(tensors: dict[str, np.ndarray], meta: dict[str, Any], par: Any,
                        optimizer: bt.optim.Optimizer | None = None, loader: Any = None) -> int:
    """What :func:`restore_sharded_state` checks, changing nothing; StateError names the tensor at fault."""
    if not isinstance(meta, dict) or meta.get("state_format") != STATE_FORMAT:
        fmt = meta.get("state_format") if isinstance(meta, dict) else meta
        raise StateError(f"checkpoint state format {fmt!r} is not {STATE_FORMAT}")
    try:
        step = int(meta["step"])
    except (KeyError, TypeError, ValueError):
        raise StateError(f"checkpoint meta has no integer 'step' (got {meta.get('step')!r})") from None
    params = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    try:
        par.check_full_state(params)
    except ValueError as e:
        raise StateError(str(e)) from None
    steps = meta.get("optim_steps", {})
    if optimizer is not None:
        if not isinstance(steps, dict):
            raise StateError(f"checkpoint meta 'optim_steps' must be a dict, got {type(steps).__name__}")
        for n in steps:
            if n not in params:
                raise StateError(f"checkpoint optimizer state names unknown parameter {n!r}")
            for k in _MOMENTS:
                key = f"optim.{k}.{n}"
                if key not in tensors:
                    raise StateError(f"checkpoint lacks optimizer tensor {key}")
                if tensors[key].shape != params[n].shape:
                    raise StateError(f"checkpoint tensor {key} has shape {tensors[key].shape}, its parameter has "
                                     f"{params[n].shape}")
    if loader is not None and meta.get("loader") is not None:
        loader.check_state_dict(meta["loader"])
    return step


def restore_sharded_state(tensors: dict[str, np.ndarray], meta: dict[str, Any], par: Any,
                          optimizer: bt.optim.Optimizer | None = None, loader: Any = None,
                          restore_rng: bool = True) -> int:
    """Reshard a full (single-process format) state into this rank's shards: any layout resumes from any
    other (e.g. fsdp=2 -> 1, tp=2 -> fsdp=2) and from a single-process checkpoint. No communication."""
    step = check_sharded_state(tensors, meta, par, optimizer, loader)
    params = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    steps = meta.get("optim_steps", {}) if optimizer is not None else {}
    moments = {k: {n: tensors[f"optim.{k}.{n}"] for n in steps} for k in _MOMENTS}
    with bt.no_grad():
        par.load_full_state(optimizer, params, moments, steps)
    if restore_rng and meta.get("rng") is not None:
        bt.set_rng_state(meta["rng"])
    if loader is not None and meta.get("loader") is not None:
        loader.load_state_dict(meta["loader"])
    return step
