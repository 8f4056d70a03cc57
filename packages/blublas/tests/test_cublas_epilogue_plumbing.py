"""The cuBLASLt descriptors of the GELU epilogues, checked on the fake CUDA device against a stand-in libcublasLt
that records every attribute and computes each cublasLtMatmul from the recorded column-major layouts, operations,
epilogue and pointers (as cublasLt.h documents them: the bias or bias-gradient vector runs along the rows of the
column-major D, i.e. along the columns of our row-major output). What the real library does with them is the
``cuda``-marked tests' part (test_gpu.py)."""

from __future__ import annotations

import ctypes
import itertools
import types

import kernel_contract
import numpy as np
import pytest
from blublas import EpilogueUnavailable, GemmError, cublas, gemm
from blublas.hooks import BluBLASProvider, CuBLASProvider
from blublas.reference import bf16_bits_to_f32, f32_to_bf16_bits, gelu_tanh, gelu_tanh_grad
from blublas.testing import check_case, make_case

LAYOUTS = ("nn", "nt", "tn")
PRECISIONS = [("fp32", False), ("tf32", False), ("bf16", True), ("bf16", False)]


class FakeLt:
    """The libcublasLt entry points ``cublas._matmul`` calls, on the fake device's host memory."""

    def __init__(self, n_algos: int = 1):
        self.n_algos = n_algos
        self.ids = itertools.count(1)
        self.descs: dict[int, dict] = {}
        self.layouts: dict[int, dict] = {}
        self.heuristics: list[dict] = []
        self.matmuls: list[dict] = []

    def _new(self, ref) -> int:
        ref._obj.value = next(self.ids)
        return ref._obj.value

    def cublasLtMatmulDescCreate(self, ref, compute, scale):  # noqa: N802 - the C names
        self.descs[self._new(ref)] = {"compute": compute}
        return 0

    def cublasLtMatmulDescSetAttribute(self, desc, attr, ref, size):  # noqa: N802
        self.descs[desc.value][attr] = ref._obj.value
        return 0

    def cublasLtMatrixLayoutCreate(self, ref, dtype, rows, cols, ld):  # noqa: N802
        self.layouts[self._new(ref)] = {"type": dtype, "rows": rows, "cols": cols, "ld": ld}
        return 0

    def cublasLtMatrixLayoutSetAttribute(self, lay, attr, ref, size):  # noqa: N802
        raise AssertionError("batched layouts are not emulated here")

    def cublasLtMatmulPreferenceCreate(self, ref):  # noqa: N802
        self._new(ref)
        return 0

    def cublasLtMatmulPreferenceSetAttribute(self, *a):  # noqa: N802
        return 0

    def cublasLtMatmulAlgoGetHeuristic(self, handle, desc, xa, ya, cd, dd, pref, n_max, res, n_ref):  # noqa: N802
        self.heuristics.append(dict(self.descs[desc.value]))
        n = min(self.n_algos, n_max)
        for i in range(n):
            res[i].state = 0
            res[i].algo[0] = i + 1
        n_ref._obj.value = n
        return 0

    def cublasLtMatrixLayoutDestroy(self, lay):  # noqa: N802
        return 0

    def cublasLtMatmulDescDestroy(self, desc):  # noqa: N802
        return 0

    def cublasLtMatmulPreferenceDestroy(self, pref):  # noqa: N802
        return 0

    @staticmethod
    def _view(ptr: int, dtype: int, rows: int, cols: int, ld: int) -> np.ndarray:
        """The column-major rows x cols matrix at ``ptr`` (leading dimension ``ld``) as a writable NumPy view."""
        npt = np.float32 if dtype == cublas.CUDA_R_32F else np.uint16
        isz = np.dtype(npt).itemsize
        n = (cols - 1) * ld + rows if rows and cols else 0
        raw = np.frombuffer((ctypes.c_char * (n * isz)).from_address(ptr), dtype=npt)
        return np.lib.stride_tricks.as_strided(raw, shape=(rows, cols), strides=(isz, ld * isz))

    @staticmethod
    def _f64(v: np.ndarray, dtype: int) -> np.ndarray:
        return (v if dtype == cublas.CUDA_R_32F else bf16_bits_to_f32(v)).astype(np.float64)

    @staticmethod
    def _store(view: np.ndarray, vals: np.ndarray, dtype: int) -> None:
        f = vals.astype(np.float32)
        view[...] = f if dtype == cublas.CUDA_R_32F else f32_to_bf16_bits(f).reshape(f.shape)

    def cublasLtMatmul(self, handle, desc, alpha, a, xa, b, ya, beta, c, cd, d, dd, algo, ws, ws_size,  # noqa: N802
                       stream):
        at = self.descs[desc.value]
        self.matmuls.append(at)
        la, lb, lc = self.layouts[xa.value], self.layouts[ya.value], self.layouts[dd.value]
        A = self._f64(self._view(a.value, **{"dtype": la["type"], **_rcl(la)}), la["type"])
        B = self._f64(self._view(b.value, **{"dtype": lb["type"], **_rcl(lb)}), lb["type"])
        A = A.T if at.get(cublas.DESC_TRANSA, cublas.OP_N) == cublas.OP_T else A
        B = B.T if at.get(cublas.DESC_TRANSB, cublas.OP_N) == cublas.OP_T else B
        D = self._view(d.value, dtype=lc["type"], **_rcl(lc))
        v = alpha._obj.value * (A @ B)
        if beta._obj.value:
            v = v + beta._obj.value * self._f64(D, lc["type"])
        epi = at.get(cublas.DESC_EPILOGUE, cublas.EPI_DEFAULT)
        m, n = v.shape
        bias_t = at.get(cublas.DESC_BIAS_DATA_TYPE, lc["type"])
        aux = None
        if epi in cublas.EPI_WITH_AUX:
            aux = self._view(at[cublas.DESC_AUX_POINTER], lc["type"], m, n, at[cublas.DESC_AUX_LD])
        if epi in (cublas.EPI_BIAS, cublas.EPI_GELU_BIAS, cublas.EPI_GELU_AUX_BIAS):
            bias = self._f64(self._view(at[cublas.DESC_BIAS_POINTER], bias_t, m, 1, m), bias_t)
            v = v + bias
        if epi in (cublas.EPI_GELU_AUX, cublas.EPI_GELU_AUX_BIAS):
            self._store(aux, v, lc["type"])
        if epi in (cublas.EPI_GELU, cublas.EPI_GELU_BIAS, cublas.EPI_GELU_AUX, cublas.EPI_GELU_AUX_BIAS):
            v = gelu_tanh(v)
        if epi in (cublas.EPI_DGELU, cublas.EPI_DGELU_BGRAD):
            v = v * gelu_tanh_grad(self._f64(aux, lc["type"]))
        if epi == cublas.EPI_DGELU_BGRAD:
            self._store(self._view(at[cublas.DESC_BIAS_POINTER], bias_t, m, 1, m), v.sum(axis=1, keepdims=True),
                        bias_t)
        self._store(D, v, lc["type"])
        return 0


def _rcl(lay: dict) -> dict:
    return {"rows": lay["rows"], "cols": lay["cols"], "ld": lay["ld"]}


@pytest.fixture
def lt(monkeypatch, tmp_path):
    """The fake device as ``cupy`` and a FakeLt as the cuBLASLt library of its device state."""
    kernel_contract.install(monkeypatch, tmp_path)
    fake = FakeLt()
    state = types.SimpleNamespace(lib=fake, handle=ctypes.c_void_p(1), algos={})
    monkeypatch.setattr(cublas, "_state", lambda device_id: state)
    fake.state = state
    return fake


def _fcp():
    import cupy

    return cupy


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("precision,out_bf16", PRECISIONS)
@pytest.mark.parametrize("bias_grad", [False, True])
def test_dgelu_descriptors_describe_the_row_major_problem(lt, layout, precision, out_bf16, bias_grad):
    """DGELU(_BGRAD): the aux pointer and leading dimension, the bias-gradient pointer and its float32 type give
    du = (op(a) @ op(b)) * gelu'(preact) and its column sums, as the NumPy reference computes them."""
    case = make_case(np.random.default_rng(3), 37, 72, 40, layout=layout, precision=precision, out_bf16=out_bf16,
                     epilogue="dgelu", bias_grad=bias_grad)
    assert check_case(case, _fcp(), "cublas") <= case.tol, case.describe()
    (at,) = lt.matmuls
    assert at[cublas.DESC_EPILOGUE] == (208 if bias_grad else 192)  # cublasLt.h: DGELU_BGRAD, DGELU
    assert at[cublas.DESC_AUX_LD] == 72
    assert (cublas.DESC_BIAS_DATA_TYPE in at) == bias_grad and at.get(cublas.DESC_BIAS_DATA_TYPE, 0) == 0


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("precision,out_bf16", PRECISIONS)
def test_gelu_aux_descriptors_describe_the_row_major_problem(lt, layout, precision, out_bf16):
    """The forward's GELU_AUX_BIAS under the same stand-in: out and the saved pre-activation equal the reference."""
    case = make_case(np.random.default_rng(4), 37, 72, 40, layout=layout, precision=precision, out_bf16=out_bf16,
                     bias="f32", epilogue="gelu", save_preact=True)
    assert check_case(case, _fcp(), "cublas") <= case.tol, case.describe()
    (at,) = lt.matmuls
    assert at[cublas.DESC_EPILOGUE] == cublas.EPI_GELU_AUX_BIAS and at[cublas.DESC_AUX_LD] == 72


def _dgelu_args(cp, m=37, n=72, k=40, ld=None):
    rng = np.random.default_rng(5)
    a = cp.array(rng.standard_normal((m, k)).astype(np.float32))
    b = cp.array(rng.standard_normal((k, n)).astype(np.float32))
    ld = ld or n
    u = cp.array(rng.standard_normal((m, ld)).astype(np.float32))[:, :n]
    out = cp.array(np.full((m, n), 7.0, np.float32))
    bg = cp.array(np.full(n, 7.0, np.float32))
    return a, b, u, out, bg


def test_dgelu_without_an_algorithm_raises_and_writes_nothing(lt):
    """No cuBLASLt algorithm for DGELU_BGRAD: EpilogueUnavailable (a GemmError) before any launch, out and
    bias_grad untouched; the provider class answers None, so its caller computes the same thing unfused."""
    cp = _fcp()
    lt.n_algos = 0
    a, b, u, out, bg = _dgelu_args(cp)
    with pytest.raises(EpilogueUnavailable, match="no DGELU_BGRAD algorithm"):
        gemm(a, b, out, epilogue="dgelu", preact=u, bias_grad=bg, provider="cublas")
    assert issubclass(EpilogueUnavailable, GemmError)
    assert CuBLASProvider.matmul(a, b, out=out, epilogue="dgelu", preact=u, bias_grad=bg) is None
    assert lt.matmuls == [] and len(lt.heuristics) == 1  # the miss is remembered: one heuristic query
    assert (out.get() == 7.0).all() and (bg.get() == 7.0).all()


def test_dgelu_aux_leading_dimension_not_a_multiple_of_8_is_never_asked(lt):
    """cuBLASLt's GELU aux buffer needs a leading dimension divisible by 8: otherwise nothing is asked of it."""
    cp = _fcp()
    a, b, u, out, bg = _dgelu_args(cp, n=36, ld=37)
    with pytest.raises(EpilogueUnavailable, match="aux leading dimension 37"):
        gemm(a, b, out, epilogue="dgelu", preact=u, bias_grad=bg, provider="cublas")
    assert lt.heuristics == [] and lt.matmuls == []
    a, b, u, out, bg = _dgelu_args(cp, n=36, ld=40)  # a view of leading dimension 40 is fine
    gemm(a, b, out, epilogue="dgelu", preact=u, bias_grad=bg, provider="cublas")
    ref = (a.get().astype(np.float64) @ b.get()) * gelu_tanh_grad(u.get().astype(np.float64))
    np.testing.assert_allclose(out.get(), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(bg.get(), ref.sum(axis=0), rtol=1e-5, atol=1e-4)


def test_cublas_refusing_an_attribute_is_unavailable_too(lt, monkeypatch):
    """A cuBLASLt that rejects an attribute (an older library without the bias data type): EpilogueUnavailable."""
    cp = _fcp()
    real = lt.cublasLtMatmulDescSetAttribute

    def refuse_bias_type(desc, attr, ref, size):
        return 7 if attr == cublas.DESC_BIAS_DATA_TYPE else real(desc, attr, ref, size)  # 7: INVALID_VALUE

    monkeypatch.setattr(lt, "cublasLtMatmulDescSetAttribute", refuse_bias_type)
    a, b, u, out, bg = _dgelu_args(cp)
    with pytest.raises(EpilogueUnavailable, match="INVALID_VALUE"):
        gemm(a, b, out, epilogue="dgelu", preact=u, bias_grad=bg, provider="cublas")
    assert lt.matmuls == [] and (out.get() == 7.0).all()
    gemm(a, b, out, epilogue="dgelu", preact=u, provider="cublas")  # plain DGELU sets no bias data type
    assert len(lt.matmuls) == 1 and lt.matmuls[0][cublas.DESC_EPILOGUE] == cublas.EPI_DGELU


def test_own_kernels_refuse_dgelu_on_the_device(lt):
    """BluBLAS's own kernels do not implement 'dgelu' (their provider does not declare it) and say so by name."""
    cp = _fcp()
    a, b, u, out, _ = _dgelu_args(cp)
    with pytest.raises(EpilogueUnavailable, match="provider='cublas'"):
        gemm(a, b, out, epilogue="dgelu", preact=u)
    assert "dgelu" not in BluBLASProvider.EPILOGUES and "dgelu" in CuBLASProvider.EPILOGUES
    assert BluBLASProvider.matmul(a, b, out=out, epilogue="dgelu", preact=u) is None
    assert (out.get() == 7.0).all()
