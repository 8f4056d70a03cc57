"""Public GEMM entry points on raw NumPy/CuPy arrays: validate everything up front, then dispatch.

NumPy arrays go to the NumPy reference (float32 compute, float64 for float64 inputs); CuPy arrays go to our
CUDA kernels (``provider='blublas'``) or to the ctypes cuBLAS/cuBLASLt provider (``provider='cublas'``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import settings as _settings
from .errors import EpilogueUnavailable, GemmError
from .reference import bf16_bits_to_f32, concat_3xtf32, f32_to_bf16_bits, gemm_reference

PRECISIONS = ("fp32", "tf32", "bf16", "3xtf32")  # 3xtf32: fp32-accurate, on TF32 tensor cores
#: 'gelu': tanh GELU after the bias (the pre-activation optionally saved); 'dgelu': the product times gelu'(preact),
#: the backward through a GELU (its input gradient, and the bias gradient of the layer before it)
EPILOGUES = ("none", "gelu", "dgelu")
PROVIDERS = ("blublas", "cublas")


def _backend(x: Any, name: str) -> str:
    if isinstance(x, np.ndarray):
        return "numpy"
    if type(x).__module__.split(".")[0] == "cupy":
        return "cupy"
    raise GemmError(f"{name}: expected a NumPy or CuPy array, got {type(x).__name__}")


def dtype_tag(dtype: np.dtype) -> str:
    """'f32', 'f64', 'bf16' (uint16 storage or ml_dtypes.bfloat16) or the dtype's name."""
    dt = np.dtype(dtype)
    if dt == np.float32:
        return "f32"
    if dt == np.float64:
        return "f64"
    if dt == np.uint16 or dt.name == "bfloat16":
        return "bf16"
    return dt.name


@dataclass
class MatInfo:
    """How one operand sits in memory: rows x cols with leading dimension ld and batch stride (elements)."""

    rows: int
    cols: int
    ld: int
    batch: int  # 0 = not batched (2-D, shared by every batch entry)
    bstride: int
    itemsize: int
    ptr: int
    span: int  # bytes from ptr to one past the last element


def _mat_info(x: Any, name: str, batched: bool, backend: str) -> MatInfo:
    if x.ndim not in ((2, 3) if batched else (2,)):
        want = "2-D or 3-D (batch, rows, cols)" if batched else "2-D"
        raise GemmError(f"{name}: expected a {want} array, got shape {tuple(x.shape)}")
    isz = x.dtype.itemsize
    shape, strides = tuple(x.shape), tuple(x.strides)
    rows, cols = shape[-2], shape[-1]
    if x.size == 0:  # empty operands: strides are meaningless, nothing is read or written
        ptr = int(x.data.ptr) if backend == "cupy" else 0
        return MatInfo(rows, cols, max(cols, 1), shape[0] if x.ndim == 3 else 0, rows * max(cols, 1), isz, ptr, 0)
    if cols > 1 and strides[-1] != isz:
        raise GemmError(
            f"{name}: the last axis must be contiguous (stride {isz} bytes), got strides {strides}; "
            f"pass a row-major array (e.g. ascontiguousarray) or use trans_a/trans_b"
        )
    ld = strides[-2] // isz if rows > 1 else max(cols, 1)
    if rows > 1 and (strides[-2] % isz or ld < cols):
        raise GemmError(
            f"{name}: row stride {strides[-2]} bytes is not a multiple of the item size "
            f"covering {cols} columns (shape {shape}, strides {strides})"
        )
    batch, bstride = 0, 0
    if x.ndim == 3:
        batch = shape[0]
        if strides[0] % isz or strides[0] < 0:
            raise GemmError(f"{name}: batch stride {strides[0]} bytes is not a non-negative multiple of {isz}")
        bstride = strides[0] // isz
    ptr = int(x.data.ptr) if backend == "cupy" else int(x.__array_interface__["data"][0])
    if ptr % isz:
        raise GemmError(f"{name}: misaligned pointer 0x{ptr:x}; {x.dtype} data must be {isz}-byte aligned")
    last = (rows - 1) * ld + cols if rows and cols else 0
    span = ((max(batch, 1) - 1) * bstride + last) * isz if last else 0
    return MatInfo(rows, cols, ld, batch, bstride, isz, ptr, span)


@dataclass
class Problem:
    """A validated GEMM call (everything a kernel launch or the reference needs)."""

    backend: str
    a: Any
    b: Any
    out: Any
    bias: Any
    preact: Any
    A: MatInfo
    B: MatInfo
    C: MatInfo | None
    P: MatInfo | None
    M: int
    N: int
    K: int
    batch: int
    batched: bool
    trans_a: bool
    trans_b: bool
    alpha: float
    beta: float
    gelu: bool
    precision: str
    out_tag: str
    bias_tag: str | None
    device_id: int | None
    dgelu: bool = False
    aux: Any = None  # dgelu: the GELU input the forward saved (read)
    X: MatInfo | None = None
    bias_grad: Any = None  # dgelu: receives the column sums of the result (written, not accumulated)
    bgrad_tag: str | None = None

    @property
    def layout(self) -> str:
        return ("t" if self.trans_a else "n") + ("t" if self.trans_b else "n")


def _overlap(x: MatInfo, y: MatInfo) -> bool:
    return x.span > 0 and y.span > 0 and x.ptr < y.ptr + y.span and y.ptr < x.ptr + x.span


def plan(
    a: Any,
    b: Any,
    out: Any,
    *,
    trans_a: bool,
    trans_b: bool,
    alpha: float,
    beta: float,
    bias: Any,
    epilogue: str,
    save_preact: Any,
    precision: str,
    batched: bool,
    preact: Any = None,
    bias_grad: Any = None,
) -> Problem:
    """Check every argument of a GEMM call and describe it, raising GemmError naming the culprit."""
    if precision not in PRECISIONS:
        raise GemmError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if epilogue not in EPILOGUES:
        raise GemmError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
    if trans_a and trans_b:
        raise GemmError(
            "layout TT (trans_a=True and trans_b=True) is not supported; use (b @ a)^T, i.e. compute "
            "gemm(b, a) and transpose the result"
        )
    dgelu = epilogue == "dgelu"
    if dgelu:
        if batched:
            raise GemmError("epilogue 'dgelu' is 2-D only: use gemm, not gemm_batched")
        if preact is None:
            raise GemmError("epilogue 'dgelu' needs preact=, the GELU input the forward saved (its save_preact)")
        if precision == "3xtf32":
            raise GemmError("epilogue 'dgelu' runs at precision 'fp32', 'tf32' or 'bf16', not '3xtf32'")
        if beta != 0.0:
            raise GemmError("epilogue 'dgelu' takes beta = 0: its output is overwritten")
        if bias is not None:
            raise GemmError("epilogue 'dgelu' takes no bias; pass bias_grad= to receive the bias gradient")
    elif preact is not None:
        raise GemmError("preact is the input of epilogue='dgelu' only (the 'gelu' forward writes save_preact)")
    elif bias_grad is not None:
        raise GemmError("bias_grad is only written with epilogue='dgelu'")
    be = _backend(a, "a")
    operands = (("b", b), ("out", out), ("bias", bias), ("save_preact", save_preact), ("preact", preact),
                ("bias_grad", bias_grad))
    for nm, x in operands:
        if x is not None and _backend(x, nm) != be:
            raise GemmError(f"{nm} is a {_backend(x, nm)} array but a is a {be} array; put both on one device")
    device_id = None
    if be == "cupy":
        device_id = int(a.device.id)
        for nm, x in operands:
            if x is not None and int(x.device.id) != device_id:
                raise GemmError(f"{nm} is on cuda:{int(x.device.id)} but a is on cuda:{device_id}")

    ta, tb = dtype_tag(a.dtype), dtype_tag(b.dtype)
    if precision == "bf16":
        if ta != "bf16" or tb != "bf16":
            raise GemmError(
                f"precision 'bf16' needs bfloat16 inputs (uint16 storage or ml_dtypes.bfloat16), got "
                f"a {a.dtype}, b {b.dtype}"
            )
        if a.dtype != b.dtype:
            raise GemmError(f"a ({a.dtype}) and b ({b.dtype}) must use the same bfloat16 storage dtype")
    else:
        allowed = ("f32", "f64") if be == "numpy" and precision == "fp32" else ("f32",)
        if ta not in allowed or tb != ta:
            raise GemmError(
                f"precision {precision!r} needs {' or '.join(allowed)} inputs of one dtype "
                f"(float64 only on CPU), got a {a.dtype}, b {b.dtype}"
            )

    A = _mat_info(a, "a", batched, be)
    B = _mat_info(b, "b", batched, be)
    M, Ka = (A.cols, A.rows) if trans_a else (A.rows, A.cols)
    Kb, N = (B.cols, B.rows) if trans_b else (B.rows, B.cols)
    if Ka != Kb:
        raise GemmError(
            f"inner dimensions differ: op(a) is {M}x{Ka} (a.shape={tuple(a.shape)}, trans_a={trans_a}) but "
            f"op(b) is {Kb}x{N} (b.shape={tuple(b.shape)}, trans_b={trans_b})"
        )
    if batched:
        if A.batch == 0 and B.batch == 0:
            raise GemmError("gemm_batched: at least one of a, b must be 3-D (batch, rows, cols)")
        if A.batch and B.batch and A.batch != B.batch:
            raise GemmError(f"batch sizes differ: a has {A.batch}, b has {B.batch}")
        batch = A.batch or B.batch
    else:
        batch = 1
    out_shape = (batch, M, N) if batched else (M, N)

    in_tag = ta
    if out is not None:
        ot = dtype_tag(out.dtype)
        ok = (ot == in_tag and out.dtype == a.dtype) or (precision == "bf16" and ot == "f32")
        if not ok:
            want = f"{a.dtype} or float32" if precision == "bf16" else str(a.dtype)
            raise GemmError(f"out has dtype {out.dtype}; precision {precision!r} with {a.dtype} inputs needs {want}")
        if tuple(out.shape) != out_shape:
            raise GemmError(f"out has shape {tuple(out.shape)}, expected {out_shape}")
    elif beta != 0.0:
        raise GemmError("beta != 0 accumulates into out: pass the out array to accumulate into")
    out_tag = dtype_tag(out.dtype) if out is not None else in_tag

    bias_tag = None
    if bias is not None:
        bias_tag = dtype_tag(bias.dtype)
        allowed_b = ("f32", "bf16") if be == "cupy" else ("f32", "bf16", "f64")
        if bias_tag not in allowed_b:
            raise GemmError(f"bias dtype {bias.dtype} is not supported (float32 or bfloat16)")
        if bias.ndim != 1 or bias.shape[0] != N:
            raise GemmError(f"bias must be 1-D of length N={N} (one value per output column), got {tuple(bias.shape)}")
        if bias.shape[0] > 1 and bias.strides[0] != bias.dtype.itemsize:
            raise GemmError(f"bias must be contiguous, got strides {bias.strides}")
        if be == "cupy" and int(bias.data.ptr) % bias.dtype.itemsize:
            raise GemmError(f"bias: misaligned pointer 0x{int(bias.data.ptr):x}")

    if save_preact is not None:
        if epilogue != "gelu":
            raise GemmError("save_preact is only meaningful with epilogue='gelu'")
        if tuple(save_preact.shape) != out_shape:
            raise GemmError(f"save_preact has shape {tuple(save_preact.shape)}, expected {out_shape}")
        if dtype_tag(save_preact.dtype) != out_tag or (out is not None and save_preact.dtype != out.dtype):
            raise GemmError(f"save_preact has dtype {save_preact.dtype}; it must match the output dtype")

    C = _mat_info(out, "out", batched, be) if out is not None else None
    P = _mat_info(save_preact, "save_preact", batched, be) if save_preact is not None else None
    for nm, info in (("out", C), ("save_preact", P)):
        if info is not None:
            if batched and batch > 1 and info.bstride == 0:
                raise GemmError(f"{nm}: batch stride 0 would make batch entries overwrite each other")
            for src_nm, src in (("a", A), ("b", B)):
                if _overlap(info, src):
                    raise GemmError(f"{nm} overlaps input {src_nm} in memory; use a separate output array")
    if C is not None and P is not None and _overlap(C, P):
        raise GemmError("save_preact overlaps out in memory; use a separate array")

    X = bgrad_tag = None
    if dgelu:
        if tuple(preact.shape) != out_shape:
            raise GemmError(f"preact has shape {tuple(preact.shape)}, expected {out_shape} (the output's)")
        if dtype_tag(preact.dtype) != out_tag or (out is not None and preact.dtype != out.dtype):
            raise GemmError(f"preact has dtype {preact.dtype}; it must match the output dtype")
        X = _mat_info(preact, "preact", False, be)
        if C is not None and _overlap(C, X):
            raise GemmError("out overlaps preact in memory; use a separate output array")
    if bias_grad is not None:
        bgrad_tag = dtype_tag(bias_grad.dtype)
        allowed_g = ("f32", "f64") if be == "numpy" else ("f32",)
        if bgrad_tag not in allowed_g:
            raise GemmError(f"bias_grad dtype {bias_grad.dtype} is not supported (float32)")
        if bias_grad.ndim != 1 or bias_grad.shape[0] != N:
            raise GemmError(f"bias_grad must be 1-D of length N={N} (one sum per output column), got "
                            f"{tuple(bias_grad.shape)}")
        if bias_grad.shape[0] > 1 and bias_grad.strides[0] != bias_grad.dtype.itemsize:
            raise GemmError(f"bias_grad must be contiguous, got strides {bias_grad.strides}")
        isz = bias_grad.dtype.itemsize
        ptr = int(bias_grad.data.ptr) if be == "cupy" else int(bias_grad.__array_interface__["data"][0])
        if ptr % isz:
            raise GemmError(f"bias_grad: misaligned pointer 0x{ptr:x}")
        G = MatInfo(1, N, max(N, 1), 0, 0, isz, ptr, N * isz)
        for nm, info in (("a", A), ("b", B), ("out", C), ("preact", X)):
            if info is not None and _overlap(G, info):
                raise GemmError(f"bias_grad overlaps {nm} in memory; use a separate array")

    return Problem(
        be,
        a,
        b,
        out,
        bias,
        save_preact,
        A,
        B,
        C,
        P,
        M,
        N,
        Ka,
        batch,
        batched,
        bool(trans_a),
        bool(trans_b),
        float(alpha),
        float(beta),
        epilogue == "gelu",
        precision,
        out_tag,
        bias_tag,
        device_id,
        dgelu=dgelu,
        aux=preact,
        X=X,
        bias_grad=bias_grad,
        bgrad_tag=bgrad_tag,
    )


def _to_float(x: Any, compute: type) -> np.ndarray:
    if dtype_tag(x.dtype) == "bf16":
        return bf16_bits_to_f32(x.view(np.uint16)).astype(compute, copy=False)
    return np.asarray(x, dtype=compute)


def _from_float(v: np.ndarray, like_dtype: np.dtype) -> np.ndarray:
    if dtype_tag(like_dtype) == "bf16":
        return f32_to_bf16_bits(v.astype(np.float32)).view(like_dtype)
    return v.astype(like_dtype, copy=False)


def _run_numpy(p: Problem) -> Any:
    compute = np.float64 if dtype_tag(p.a.dtype) == "f64" else np.float32
    out_dtype = p.out.dtype if p.out is not None else p.a.dtype
    c_old = _to_float(p.out, compute) if (p.out is not None and p.beta != 0.0) else None
    bias = _to_float(p.bias, compute) if p.bias is not None else None
    a, b, ta, tb = _to_float(p.a, compute), _to_float(p.b, compute), p.trans_a, p.trans_b
    if p.precision == "3xtf32":  # the emulation: one fp32 GEMM of the K-concatenated TF32 parts
        a, b = concat_3xtf32(np.swapaxes(a, -1, -2) if ta else a, np.swapaxes(b, -1, -2) if tb else b)
        ta = tb = False
    v, pre = gemm_reference(
        a,
        b,
        trans_a=ta,
        trans_b=tb,
        alpha=p.alpha,
        beta=p.beta,
        c_old=c_old,
        bias=bias,
        epilogue="gelu" if p.gelu else "dgelu" if p.dgelu else "none",
        aux=_to_float(p.aux, compute) if p.dgelu else None,
        dtype=compute,
    )
    res = _from_float(v, out_dtype)
    if p.preact is not None:
        p.preact[...] = _from_float(pre, out_dtype)
    if p.bias_grad is not None:  # the column sums of the unrounded result, summed in float64
        p.bias_grad[...] = np.asarray(v, dtype=np.float64).sum(axis=0).astype(p.bias_grad.dtype)
    if p.out is None:
        return res
    p.out[...] = res
    return p.out


def _dispatch(
    p: Problem, provider: str, stream: Any, config: Any, splits: int | None, autotune: bool | None, memo: Any = None
) -> Any:
    if p.backend == "numpy":
        return _run_numpy(p)
    if provider not in PROVIDERS:
        raise GemmError(f"provider must be one of {PROVIDERS}, got {provider!r}")
    import cupy

    if p.out is None:
        dt = p.a.dtype
        p.out = cupy.empty((p.batch, p.M, p.N) if p.batched else (p.M, p.N), dtype=dt)
        p.C = _mat_info(p.out, "out", p.batched, "cupy")
    if p.dgelu and provider != "cublas":
        raise EpilogueUnavailable(
            "epilogue 'dgelu' on CuPy arrays runs on provider='cublas' (cuBLASLt's DGELU epilogue); BluBLAS's own "
            "kernels do not implement it"
        )
    if p.M == 0 or p.N == 0 or p.batch == 0:
        if p.bias_grad is not None and p.N:
            p.bias_grad.fill(0)  # an empty sum (M == 0)
        return p.out
    if p.precision == "3xtf32":
        from .split_tf32 import run_3xtf32

        if provider == "cublas":
            from .cublas import run_cublas

            run_3xtf32(p, stream, lambda q: run_cublas(q, stream))
        else:
            from .launch import run_blublas

            run_3xtf32(p, stream, lambda q: run_blublas(q, stream, config=config, splits=splits, autotune=autotune))
    elif provider == "cublas":
        from .cublas import run_cublas

        run_cublas(p, stream)
    else:
        from .launch import run_blublas

        run_blublas(p, stream, config=config, splits=splits, autotune=autotune, memo=memo)
    return p.out


def _planned_gemm(a, b, out, batched, trans_a, trans_b, alpha, beta, bias, epilogue, save_preact, precision,
                  stream, provider, config, splits, autotune, preact=None, bias_grad=None):
    """The one body of :func:`gemm` and :func:`gemm_batched`: validate into a plan, then dispatch it. A CuPy
    call repeated with the same arrays and options replays its recorded launch (blublas.memo). The switches
    (blublas.settings) are read, and a bad one refused by name, at the first call, whichever the device."""
    if _settings._current is None:
        _settings.get()
    key = None
    if (provider == "blublas" and precision != "3xtf32" and out is not None and epilogue != "dgelu"
            and not isinstance(a, np.ndarray)):
        from . import memo

        opts = (batched, trans_a, trans_b, alpha, beta, epilogue, precision, config, splits, autotune)
        key = memo.key(a, b, out, bias, save_preact, stream, opts)
        if memo.replay(key, stream):
            return out
    p = plan(a, b, out, trans_a=trans_a, trans_b=trans_b, alpha=alpha, beta=beta, bias=bias, epilogue=epilogue,
             save_preact=save_preact, precision=precision, batched=batched, preact=preact, bias_grad=bias_grad)
    return _dispatch(p, provider, stream, config, splits, autotune, key)


def gemm(
    a: Any,
    b: Any,
    out: Any = None,
    *,
    trans_a: bool = False,
    trans_b: bool = False,
    alpha: float = 1.0,
    beta: float = 0.0,
    bias: Any = None,
    epilogue: str = "none",
    save_preact: Any = None,
    precision: str = "fp32",
    stream: Any = None,
    provider: str = "blublas",
    config: str | None = None,
    splits: int | None = None,
    autotune: bool | None = None,
    preact: Any = None,
    bias_grad: Any = None,
) -> Any:
    """out = epi(alpha * op(a) @ op(b) + beta * out + bias) for 2-D arrays; epi is identity or GELU (tanh).

    op(x) is x.T when trans_x. ``save_preact`` receives the value before GELU. NumPy in -> NumPy out
    (reference on CPU); CuPy in -> our kernels or cuBLAS (``provider``), on ``stream`` (default: current).
    ``epilogue='dgelu'`` is the backward through a GELU: out = alpha * op(a) @ op(b) * gelu_tanh'(preact), with
    ``preact`` the GELU input the forward saved (same shape and dtype as out); ``bias_grad`` (float32, length N)
    then receives out's column sums before rounding (written, not accumulated): the bias gradient of the layer
    before the GELU. It takes beta = 0 and no bias, runs on NumPy and on provider 'cublas' (cuBLASLt's DGELU /
    DGELU_BGRAD epilogues), and raises EpilogueUnavailable (a GemmError; nothing written) where no fused
    algorithm exists for the problem.
    ``precision``: 'fp32' (strict FFMA), 'tf32', 'bf16', or '3xtf32' (fp32-accurate: split-TF32 operands on
    the tensor cores, see blublas.split_tf32).
    ``config``/``splits`` force a tile config; ``autotune`` measures candidates (default: env
    BLUBLAS_AUTOTUNE).
    """
    return _planned_gemm(a, b, out, False, trans_a, trans_b, alpha, beta, bias, epilogue, save_preact, precision,
                         stream, provider, config, splits, autotune, preact, bias_grad)


def gemm_batched(
    a: Any,
    b: Any,
    out: Any = None,
    *,
    trans_a: bool = False,
    trans_b: bool = False,
    alpha: float = 1.0,
    beta: float = 0.0,
    bias: Any = None,
    epilogue: str = "none",
    save_preact: Any = None,
    precision: str = "fp32",
    stream: Any = None,
    provider: str = "blublas",
    config: str | None = None,
    splits: int | None = None,
    autotune: bool | None = None,
) -> Any:
    """Strided-batched ``gemm``: a, b are (batch, rows, cols) or 2-D (shared by every batch entry)."""
    return _planned_gemm(a, b, out, True, trans_a, trans_b, alpha, beta, bias, epilogue, save_preact, precision,
                         stream, provider, config, splits, autotune)
