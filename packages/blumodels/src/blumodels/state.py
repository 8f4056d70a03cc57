"""Assemble and restore the full training state (what a checkpoint holds; DESIGN.md section 6).

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


def _host(t: bt.Tensor) -> np.ndarray:
    """A host copy of a tensor's storage (bfloat16 kept as ml_dtypes.bfloat16)."""
    return np.array(t.detach().to("cpu").numpy(), copy=True)


def training_state(model: bt.nn.Module, optimizer: bt.optim.Optimizer | None, step: int,
                   loader: Any = None, config: dict | None = None,
                   extra: dict | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(tensors, meta) describing everything needed to continue training bit-exactly at ``step``."""
    tensors: dict[str, np.ndarray] = {}
    names = {}
    for name, p in model.named_parameters():
        tensors[f"model.{name}"] = _host(p)
        names[id(p)] = name
    opt_steps: dict[str, int] = {}
    if optimizer is not None:
        for p, st in optimizer.state.items():
            name = names.get(id(p))
            if name is None:
                raise StateError("optimizer holds state for a parameter that is not in the model")
            for k in _MOMENTS:
                if k in st:
                    tensors[f"optim.{k}.{name}"] = _host(st[k])
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


def restore_training_state(tensors: dict[str, np.ndarray], meta: dict[str, Any], model: bt.nn.Module,
                           optimizer: bt.optim.Optimizer | None = None, loader: Any = None,
                           restore_rng: bool = True) -> int:
    """Load parameters, moments, RNG and loader position in place; returns the completed step."""
    if int(meta.get("state_format", -1)) != STATE_FORMAT:
        raise StateError(f"checkpoint state format {meta.get('state_format')!r} is not {STATE_FORMAT}")
    params = dict(model.named_parameters())
    expected = {f"model.{n}" for n in params}
    got = {k for k in tensors if k.startswith("model.")}
    if expected != got:
        raise StateError(f"checkpoint parameters do not match the model: missing "
                         f"{sorted(expected - got)[:5]}, unexpected {sorted(got - expected)[:5]}")
    with bt.no_grad():
        for n, p in params.items():
            arr = tensors[f"model.{n}"]
            if tuple(arr.shape) != tuple(p.shape):
                raise StateError(f"checkpoint tensor model.{n} has shape {tuple(arr.shape)}, the model's "
                                 f"parameter has {tuple(p.shape)}")
            p.copy_(bt.tensor(arr, dtype=p.dtype, device=p.device))
    if optimizer is not None:
        optimizer.state = {}
        for n, st_step in meta.get("optim_steps", {}).items():
            if n not in params:
                raise StateError(f"checkpoint optimizer state names unknown parameter {n!r}")
            p = params[n]
            st: dict[str, Any] = {"step": int(st_step)}
            for k in _MOMENTS:
                key = f"optim.{k}.{n}"
                if key not in tensors:
                    raise StateError(f"checkpoint lacks optimizer tensor {key}")
                arr = tensors[key]
                if tuple(arr.shape) != tuple(p.shape):
                    raise StateError(f"checkpoint tensor {key} has shape {tuple(arr.shape)}, parameter has "
                                     f"{tuple(p.shape)}")
                st[k] = bt.tensor(arr, device=p.device)
            optimizer.state[p] = st
    if restore_rng and meta.get("rng") is not None:
        bt.set_rng_state(meta["rng"])
    if loader is not None and meta.get("loader") is not None:
        loader.load_state_dict(meta["loader"])
    return int(meta["step"])
