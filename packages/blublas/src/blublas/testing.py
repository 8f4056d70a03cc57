"""Test helpers shared by the CPU tests, the GPU tests and benchmarks/blublas/: random cases, the float64
reference of a case and the normalised error metric with its per-precision tolerance."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .reference import bf16_bits_to_f32, f32_to_bf16_bits, gelu_tanh_grad, gemm_reference

#: (precision, output dtype tag) -> max |out - ref64| / scale,
#: scale = max(|op(a)| @ |op(b)|) + |beta| max|c| + max|bias|
TOLERANCES = {
    ("fp32", "f32"): 1e-5,
    ("tf32", "f32"): 2e-3,
    ("3xtf32", "f32"): 1e-5,  # fp32-accurate emulation on the TF32 tensor cores
    ("bf16", "f32"): 1e-5,
    ("bf16", "bf16"): 5e-3,
}

#: sizes including non-multiples of every tile dimension and tiny edge cases
ODD_SHAPES = ((1, 1, 1), (7, 5, 3), (33, 17, 65), (130, 67, 19), (257, 129, 200), (64, 128, 96))


def to_f64(x: np.ndarray, is_bf16: bool) -> np.ndarray:
    """Host array (float32, or bf16 bits as uint16) -> float64 values."""
    x = np.asarray(x)
    if is_bf16:
        return bf16_bits_to_f32(x.view(np.uint16)).astype(np.float64)
    return x.astype(np.float64)


@dataclass
class Case:
    """One GEMM problem on the host: inputs (bf16 as uint16 bits), and what the epilogue should do."""

    precision: str
    layout: str
    m: int
    n: int
    k: int
    batch: int  # 0 = plain 2-D gemm
    a: np.ndarray
    b: np.ndarray
    out0: np.ndarray | None  # previous output when beta != 0
    bias: np.ndarray | None
    bias_bf16: bool
    out_bf16: bool
    epilogue: str
    save_preact: bool
    alpha: float
    beta: float
    extra: dict[str, Any] = field(default_factory=dict)
    aux: np.ndarray | None = None  # 'dgelu': the GELU input (output storage)
    bias_grad: bool = False  # 'dgelu': also check the bias gradient (column sums of the output)

    @property
    def in_bf16(self) -> bool:
        return self.precision == "bf16"

    @property
    def out_tag(self) -> str:
        return "bf16" if self.out_bf16 else "f32"

    @property
    def tol(self) -> float:
        return TOLERANCES[(self.precision, self.out_tag)]

    @property
    def out_shape(self) -> tuple[int, ...]:
        return (self.batch, self.m, self.n) if self.batch else (self.m, self.n)

    def describe(self) -> str:
        b = f" batch={self.batch}" if self.batch else ""
        bias = "bf16" if self.bias_bf16 else "f32" if self.bias is not None else "-"
        return (
            f"{self.precision} {self.layout} {self.m}x{self.n}x{self.k}{b} epi={self.epilogue}"
            f"{'+preact' if self.save_preact else ''}{'+bias_grad' if self.bias_grad else ''} bias={bias}"
            f" out={self.out_tag} alpha={self.alpha} beta={self.beta}"
        )


def make_case(
    rng: np.random.Generator,
    m: int,
    n: int,
    k: int,
    *,
    layout: str = "nn",
    precision: str = "fp32",
    batch: int = 0,
    bias: str | None = None,
    epilogue: str = "none",
    save_preact: bool = False,
    alpha: float = 1.0,
    beta: float = 0.0,
    out_bf16: bool | None = None,
    bias_grad: bool = False,
) -> Case:
    """Random inputs of the right storage for ``precision`` (bf16 values exactly representable); 'dgelu' cases
    get a GELU input spread over [-4, 4] (both tails and the curved middle of gelu')."""
    ta, tb = layout[0] == "t", layout[1] == "t"
    lead = (batch,) if batch else ()
    a_shape = lead + ((k, m) if ta else (m, k))
    b_shape = lead + ((n, k) if tb else (k, n))
    in_bf16 = precision == "bf16"
    out_bf16 = in_bf16 if out_bf16 is None else out_bf16

    def arr(shape: tuple[int, ...], bf16: bool) -> np.ndarray:
        x = rng.standard_normal(shape).astype(np.float32)
        return f32_to_bf16_bits(x).reshape(shape) if bf16 else x

    out_shape = lead + (m, n)
    aux = None
    if epilogue == "dgelu":
        u = (rng.uniform(-4.0, 4.0, out_shape)).astype(np.float32)
        aux = f32_to_bf16_bits(u).reshape(out_shape) if out_bf16 else u
    return Case(
        precision,
        layout,
        m,
        n,
        k,
        batch,
        arr(a_shape, in_bf16),
        arr(b_shape, in_bf16),
        arr(out_shape, out_bf16) if beta != 0.0 else None,
        arr((n,), bias == "bf16") if bias else None,
        bias == "bf16",
        out_bf16,
        epilogue,
        save_preact,
        alpha,
        beta,
        aux=aux,
        bias_grad=bias_grad,
    )


def reference(case: Case) -> tuple[np.ndarray, np.ndarray, float]:
    """(out, preact, scale) in float64 for ``case``; scale normalises the error metric (for 'dgelu' it includes
    the largest |gelu'(aux)| the product is multiplied by)."""
    a = to_f64(case.a, case.in_bf16)
    b = to_f64(case.b, case.in_bf16)
    c0 = to_f64(case.out0, case.out_bf16) if case.out0 is not None else None
    bias = to_f64(case.bias, case.bias_bf16) if case.bias is not None else None
    ta, tb = case.layout[0] == "t", case.layout[1] == "t"
    out, pre = gemm_reference(
        a,
        b,
        trans_a=ta,
        trans_b=tb,
        alpha=case.alpha,
        beta=case.beta,
        c_old=c0,
        bias=bias,
        epilogue=case.epilogue,
        aux=to_f64(case.aux, case.out_bf16) if case.aux is not None else None,
        dtype=np.float64,
    )
    absprod, _ = gemm_reference(np.abs(a), np.abs(b), trans_a=ta, trans_b=tb, alpha=abs(case.alpha))
    scale = float(np.max(absprod, initial=0.0))
    if c0 is not None:
        scale += abs(case.beta) * float(np.max(np.abs(c0), initial=0.0))
    if bias is not None:
        scale += float(np.max(np.abs(bias), initial=0.0))
    if case.aux is not None:
        scale *= max(1.0, float(np.max(np.abs(gelu_tanh_grad(to_f64(case.aux, case.out_bf16))), initial=0.0)))
    return out, pre, max(scale, 1e-30)


def normalized_error(got: np.ndarray, ref: np.ndarray, scale: float, is_bf16: bool) -> float:
    """max |got - ref| / scale with ``got`` a host array (bf16 bits when ``is_bf16``)."""
    g = to_f64(got, is_bf16)
    if g.shape != ref.shape:
        raise AssertionError(f"shape {g.shape} != reference shape {ref.shape}")
    if not np.all(np.isfinite(g)):
        return float("inf")
    return float(np.max(np.abs(g - ref), initial=0.0)) / scale


def run_case(case: Case, xp: Any = np, provider: str = "blublas",
             **kw: Any) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Run ``case`` through blublas.gemm/gemm_batched on ``xp`` arrays; returns host (out, preact, bias_grad)."""
    from .api import gemm, gemm_batched

    def dev(x: np.ndarray | None) -> Any:
        return None if x is None else xp.array(x, copy=True)

    out_dtype = np.uint16 if case.out_bf16 else np.float32
    out = dev(case.out0) if case.out0 is not None else xp.zeros(case.out_shape, dtype=out_dtype)
    pre = xp.zeros(case.out_shape, dtype=out_dtype) if case.save_preact else None
    if case.epilogue == "dgelu":
        kw = dict(kw, preact=dev(case.aux))
        if case.bias_grad:
            kw["bias_grad"] = dev(np.full(case.n, np.nan, dtype=np.float32))  # every element must be written
    fn = gemm_batched if case.batch else gemm
    res = fn(
        dev(case.a),
        dev(case.b),
        out,
        trans_a=case.layout[0] == "t",
        trans_b=case.layout[1] == "t",
        alpha=case.alpha,
        beta=case.beta,
        bias=dev(case.bias),
        epilogue=case.epilogue,
        save_preact=pre,
        precision=case.precision,
        provider=provider,
        **kw,
    )
    assert res is out
    host = (lambda x: x.get()) if xp is not np else (lambda x: np.asarray(x))
    bg = kw.get("bias_grad")
    return host(out), (host(pre) if pre is not None else None), (host(bg) if bg is not None else None)


def check_case(case: Case, xp: Any = np, provider: str = "blublas", **kw: Any) -> float:
    """Run and compare ``case`` against float64; returns the worst normalised error (out, preact and the bias
    gradient, whose scale is M times the output's: it sums M of them)."""
    out, pre, bg = run_case(case, xp, provider, **kw)
    ref, ref_pre, scale = reference(case)
    err = normalized_error(out, ref, scale, case.out_bf16)
    if pre is not None:
        err = max(err, normalized_error(pre, ref_pre, scale, case.out_bf16))
    if bg is not None:
        err = max(err, normalized_error(bg, ref.sum(axis=-2), scale * max(case.m, 1), False))
    return err


def time_ms(cp: Any, fn: Any, warmup: int = 2, target_ms: float = 20.0, min_reps: int = 3,
            max_reps: int = 200) -> float:
    """Mean milliseconds per call of ``fn`` on the current CUDA stream, over enough back-to-back calls to fill
    about ``target_ms`` (``min_reps`` to ``max_reps`` calls), timed with CUDA events (the GPU checks' timer)."""
    for _ in range(warmup):
        fn()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    one = max(cp.cuda.get_elapsed_time(start, stop), 1e-3)
    reps = int(min(max_reps, max(min_reps, target_ms / one)))
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / reps


def graph_ms(cp: Any, fn: Any, calls: int = 10, reps: int = 3) -> float:
    """Milliseconds per call of ``fn`` with the host out of the loop: ``calls`` calls captured into one CUDA graph
    on a fresh stream (``fn`` must be capture-safe, as both GEMM providers are), the graph replayed ``reps``
    times between CUDA events."""
    st = cp.cuda.Stream(non_blocking=True)
    with st:
        fn()  # warm-up on this stream (per-stream workspaces, cuBLASLt's algorithm choice)
        st.synchronize()
        st.begin_capture()
        for _ in range(calls):
            fn()
        graph = st.end_capture()
        graph.launch(st)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(st)
        for _ in range(reps):
            graph.launch(st)
        stop.record(st)
        stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / (calls * reps)


def gpt2_gemm_shapes(tokens: int = 16384, d: int = 768, vocab: int = 50304) -> list[tuple[str, str, int, int, int]]:
    """GPT-2's dense-layer GEMMs at ``tokens`` = B*T as (name, layout, M, N, K): the forward (``nt``: weights stored
    (out, in) like torch.nn.Linear), dX (``nn``) and dW (``tn``) of qkv, attn_proj, fc, fc_proj and the LM head."""
    layers = {"qkv": (d, 3 * d), "attn_proj": (d, d), "fc": (d, 4 * d), "fc_proj": (4 * d, d), "lm_head": (d, vocab)}
    fwd = [(f"fwd_{n}", "nt", tokens, out, inp) for n, (inp, out) in layers.items()]
    dx = [(f"dx_{n}", "nn", tokens, inp, out) for n, (inp, out) in layers.items()]
    dw = [(f"dw_{n}", "tn", out, inp, tokens) for n, (inp, out) in layers.items()]
    return fwd + dx + dw
