"""``blutensor.nn.utils``: gradient clipping and flat parameter vectors, under PyTorch's names."""

from __future__ import annotations

from blutensor.autograd.grad_mode import no_grad
from blutensor.errors import DTypeError, ShapeError
from blutensor.optim.clip import clip_grad_norm_, clip_grad_value_, get_total_norm


def _tensors(op: str, parameters) -> list:
    from blutensor._tensor import Tensor

    ps = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    for i, p in enumerate(ps):
        if not isinstance(p, Tensor):
            raise DTypeError(f"{op}: parameters[{i}] is a {type(p).__name__}, not a Tensor")
    return ps


def parameters_to_vector(parameters):
    """All parameters flattened and concatenated into one 1-D tensor (differentiable)."""
    from blutensor.functional import cat

    ps = _tensors("parameters_to_vector", parameters)
    if ps and any(p.device != ps[0].device for p in ps):
        raise DTypeError("parameters_to_vector: parameters are on different devices "
                         f"({sorted({str(p.device) for p in ps})})")
    return cat([p.reshape(-1) for p in ps])


@no_grad()
def vector_to_parameters(vec, parameters) -> None:
    """Copy consecutive slices of the 1-D ``vec`` into ``parameters`` (the inverse of
    :func:`parameters_to_vector`)."""
    from blutensor._tensor import Tensor

    if not isinstance(vec, Tensor) or vec.ndim != 1:
        got = vec._desc() if isinstance(vec, Tensor) else type(vec).__name__
        raise DTypeError(f"vector_to_parameters: expected vec to be a 1-D Tensor, got {got}")
    ps = _tensors("vector_to_parameters", parameters)
    total = sum(p.numel() for p in ps)
    if total != vec.shape[0]:
        raise ShapeError(f"vector_to_parameters: vec has {vec.shape[0]} elements, the parameters {total}")
    i = 0
    for p in ps:
        n = p.numel()
        p.copy_(vec[i:i + n].view(*p.shape))
        i += n


__all__ = ["clip_grad_norm_", "clip_grad_value_", "get_total_norm", "parameters_to_vector", "vector_to_parameters"]
