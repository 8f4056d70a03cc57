"""CPU (NumPy) path of blublas.gemm against float64 for every layout, precision and epilogue."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from blublas import gemm, gemm_batched
from blublas.reference import bf16_bits_to_f32, f32_to_bf16_bits, gelu_tanh, gelu_tanh_grad
from blublas.testing import ODD_SHAPES, check_case, make_case

LAYOUTS = ("nn", "nt", "tn")
PRECISIONS = ("fp32", "tf32", "bf16")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_plain_gemm_matches_float64(layout, precision, shape):
    rng = np.random.default_rng(hash((layout, precision, shape)) % 2**32)
    case = make_case(rng, *shape, layout=layout, precision=precision)
    assert check_case(case) <= case.tol, case.describe()


EPILOGUES = [
    dict(bias="f32"),
    dict(bias="bf16"),
    dict(epilogue="gelu"),
    dict(epilogue="gelu", bias="f32", save_preact=True),
    dict(alpha=0.5, beta=1.0),
    dict(alpha=-1.5, beta=0.25, bias="f32", epilogue="gelu", save_preact=True),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("precision,out_bf16", [("fp32", False), ("tf32", False), ("bf16", True), ("bf16", False)])
@pytest.mark.parametrize("epi", EPILOGUES, ids=lambda e: "-".join(f"{k}={v}" for k, v in e.items()))
def test_epilogues_match_float64(layout, precision, out_bf16, epi):
    rng = np.random.default_rng(7)
    case = make_case(rng, 37, 29, 45, layout=layout, precision=precision, out_bf16=out_bf16, **epi)
    assert check_case(case) <= case.tol, case.describe()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("precision,out_bf16", [("fp32", False), ("tf32", False), ("bf16", True), ("bf16", False)])
@pytest.mark.parametrize("bias_grad", [False, True])
def test_dgelu_epilogue_matches_float64(layout, precision, out_bf16, bias_grad):
    """out = (op(a) @ op(b)) * gelu'(preact) and its column sums against the float64 formula."""
    rng = np.random.default_rng(8)
    case = make_case(rng, 37, 72, 40, layout=layout, precision=precision, out_bf16=out_bf16, epilogue="dgelu",
                     bias_grad=bias_grad)
    assert check_case(case) <= case.tol, case.describe()


def test_gelu_tanh_grad_matches_finite_differences():
    x = np.linspace(-8.0, 8.0, 2001)
    h = 1e-5
    fd = (gelu_tanh(x + h) - gelu_tanh(x - h)) / (2 * h)
    np.testing.assert_allclose(gelu_tanh_grad(x), fd, rtol=1e-8, atol=1e-9)
    assert gelu_tanh_grad(np.array([0.0]))[0] == 0.5


def test_dgelu_is_the_backward_of_the_gelu_gemm():
    """Through h = gemm(x, w1, 'gelu', bias b1, saving u) and y = h @ w2.T, the 'dgelu' GEMM of dy @ w2 with
    preact=u gives dL/du, and its bias_grad dL/db1: both match float64 central differences of L = sum(dy * y)."""
    rng = np.random.default_rng(21)
    x, w1, b1 = rng.standard_normal((9, 6)), rng.standard_normal((8, 6)) * 0.5, rng.standard_normal(8)
    w2, dy = rng.standard_normal((5, 8)), rng.standard_normal((9, 5))

    def loss(bias):
        return float(np.sum(dy * (gemm(x, w1, trans_b=True, bias=bias, epilogue="gelu") @ w2.T)))

    u = np.empty((9, 8))
    gemm(x, w1, trans_b=True, bias=b1, epilogue="gelu", save_preact=u)
    np.testing.assert_allclose(u, x @ w1.T + b1, rtol=1e-13, atol=1e-13)
    db1 = np.full(8, np.nan)
    du = gemm(dy, w2, epilogue="dgelu", preact=u, bias_grad=db1)
    assert du.dtype == np.float64 and db1.dtype == np.float64
    eps = 1e-6
    fd = np.array([(loss(b1 + eps * e) - loss(b1 - eps * e)) / (2 * eps) for e in np.eye(8)])
    np.testing.assert_allclose(db1, fd, rtol=1e-7, atol=1e-8)
    np.testing.assert_allclose(du, (dy @ w2) * gelu_tanh_grad(u), rtol=1e-13, atol=1e-13)


def test_dgelu_of_an_empty_product_is_zero():
    bg = np.full(4, np.nan, np.float32)
    out = gemm(np.zeros((3, 0), np.float32), np.zeros((0, 4), np.float32), epilogue="dgelu",
               preact=np.ones((3, 4), np.float32), bias_grad=bg)
    assert not out.any() and not bg.any()
    bg = np.full(4, np.nan, np.float32)
    gemm(np.zeros((0, 5), np.float32), np.zeros((5, 4), np.float32), epilogue="dgelu",
         preact=np.ones((0, 4), np.float32), bias_grad=bg)
    assert not bg.any()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_batched_matches_float64(layout, precision):
    rng = np.random.default_rng(11)
    case = make_case(
        rng,
        19,
        23,
        31,
        layout=layout,
        precision=precision,
        batch=3,
        bias="f32",
        epilogue="gelu",
        save_preact=True,
    )
    assert check_case(case) <= case.tol, case.describe()


def test_batched_broadcasts_a_2d_operand():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((4, 5, 6)).astype(np.float32)
    w = rng.standard_normal((7, 6)).astype(np.float32)
    out = gemm_batched(a, w, trans_b=True)
    np.testing.assert_allclose(out, a.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-5, atol=1e-5)


def test_float64_inputs_compute_in_float64():
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((9, 8)), rng.standard_normal((8, 7))
    out = gemm(a, b, bias=np.arange(7.0), epilogue="gelu")
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, gelu_tanh(a @ b + np.arange(7.0)), rtol=1e-13, atol=1e-13)


def test_gelu_matches_torch_tanh_gelu():
    torch = pytest.importorskip("torch")
    x = np.linspace(-6, 6, 1001)
    ref = torch.nn.functional.gelu(torch.from_numpy(x), approximate="tanh").numpy()
    np.testing.assert_allclose(gelu_tanh(x), ref, rtol=1e-12, atol=1e-12)


def test_ml_dtypes_bfloat16_inputs_are_accepted():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(9)
    a = rng.standard_normal((6, 4)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((4, 5)).astype(ml_dtypes.bfloat16)
    out = gemm(a, b, precision="bf16")
    assert out.dtype == a.dtype
    ref = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=1e-2, atol=1e-2)


def test_bf16_rounding_is_nearest_even_and_exact_roundtrip():
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, np.inf, 0.0], dtype=np.float32)
    bits = f32_to_bf16_bits(x)
    back = bf16_bits_to_f32(bits)
    assert back[0] == 1.0 and back[1] == 1.0  # tie rounds to even (mantissa 0)
    assert back[2] == 1.0 + 2**-6  # tie rounds up to even
    assert back[3] == -2.5 and np.isinf(back[4]) and back[5] == 0.0
    assert np.isnan(bf16_bits_to_f32(f32_to_bf16_bits(np.array([np.nan], np.float32))))[0]


def test_views_with_leading_dimension_are_honoured():
    rng = np.random.default_rng(1)
    big = rng.standard_normal((20, 30)).astype(np.float32)
    a = big[2:12, 3:11]  # 10x8 view, ld 30
    b = rng.standard_normal((8, 6)).astype(np.float32)
    out_big = np.zeros((10, 16), np.float32)
    out = out_big[:, 5:11]
    gemm(a, b, out)
    np.testing.assert_allclose(out, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)
    assert not out_big[:, :5].any() and not out_big[:, 11:].any()


def test_zero_k_gives_epilogue_of_zero():
    a = np.zeros((3, 0), np.float32)
    b = np.zeros((0, 4), np.float32)
    bias = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(gemm(a, b, bias=bias), np.tile(bias, (3, 1)))


def test_all_layout_precision_combinations_listed():
    assert len(list(itertools.product(LAYOUTS, PRECISIONS))) == 9
