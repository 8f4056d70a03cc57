"""Bad input gives a GemmError naming the operand and the problem, before any work is done."""

from __future__ import annotations

import numpy as np
import pytest
from blublas import GemmError, gemm, gemm_batched


def f32(*shape):
    return np.ones(shape, np.float32)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: gemm(f32(4, 5), f32(6, 3)), r"inner dimensions differ: op\(a\) is 4x5"),
        (lambda: gemm(f32(4, 5), f32(3, 6), trans_b=True), r"inner dimensions differ"),
        (lambda: gemm(f32(5, 4), f32(3, 5), trans_a=True, trans_b=True), r"layout TT"),
        (lambda: gemm(np.ones((4, 5), np.int32), np.ones((5, 3), np.int32)), r"precision 'fp32' needs"),
        (lambda: gemm(f32(4, 5), f32(5, 3), precision="bf16"), r"precision 'bf16' needs bfloat16"),
        (lambda: gemm(f32(4, 5), f32(5, 3), precision="fp16"), r"precision must be one of"),
        (lambda: gemm(f32(4, 5), f32(5, 3), epilogue="relu"), r"epilogue must be one of"),
        (lambda: gemm(f32(4, 5), f32(5, 3), save_preact=f32(4, 3)), r"save_preact is only meaningful"),
        (lambda: gemm(f32(4, 5), f32(5, 3), beta=1.0), r"beta != 0 accumulates into out"),
        (lambda: gemm(f32(4, 5), f32(5, 3), bias=f32(4)), r"bias must be 1-D of length N=3"),
        (lambda: gemm(f32(4, 5), f32(5, 3), out=f32(3, 4)), r"out has shape \(3, 4\), expected \(4, 3\)"),
        (lambda: gemm(f32(4, 5), f32(5, 3), out=np.ones((4, 3))), r"out has dtype float64"),
        (lambda: gemm(f32(4, 5), np.ones((5, 3)), precision="fp32"), r"inputs of one dtype"),
        (
            lambda: gemm(f32(4, 5), f32(5, 3), precision="tf32", out=None, bias=np.ones(3, np.int8)),
            r"bias dtype",
        ),
        (lambda: gemm(f32(4, 10)[:, ::2], f32(5, 3)), r"a: the last axis must be contiguous"),
        (lambda: gemm(f32(2, 4, 5), f32(5, 3)), r"a: expected a 2-D array"),
        (lambda: gemm_batched(f32(4, 5), f32(5, 3)), r"at least one of a, b must be 3-D"),
        (lambda: gemm_batched(f32(2, 4, 5), f32(3, 5, 3)), r"batch sizes differ: a has 2, b has 3"),
        (lambda: gemm([[1.0]], f32(1, 1)), r"a: expected a NumPy or CuPy array"),
        (lambda: gemm(f32(4, 5), f32(5, 3), epilogue="dgelu"), r"'dgelu' needs preact="),
        (lambda: gemm(f32(4, 5), f32(5, 3), preact=f32(4, 3)), r"preact is the input of epilogue='dgelu' only"),
        (lambda: gemm(f32(4, 5), f32(5, 3), bias_grad=f32(3)), r"bias_grad is only written with epilogue='dgelu'"),
        (lambda: gemm(f32(4, 5), f32(5, 3), epilogue="dgelu", preact=f32(3, 4)), r"preact has shape \(3, 4\)"),
        (lambda: gemm(f32(4, 5), f32(5, 3), epilogue="dgelu", preact=np.ones((4, 3))), r"preact has dtype float64"),
        (lambda: gemm(f32(4, 5), f32(5, 3), epilogue="dgelu", preact=f32(4, 3), bias=f32(3)), r"takes no bias"),
        (lambda: gemm(f32(4, 5), f32(5, 3), f32(4, 3), beta=1.0, epilogue="dgelu", preact=f32(4, 3)), r"beta = 0"),
        (lambda: gemm(f32(4, 5), f32(5, 3), epilogue="dgelu", preact=f32(4, 3), precision="3xtf32"), r"not '3xtf32'"),
        (lambda: gemm(f32(4, 5), f32(5, 3), epilogue="dgelu", preact=f32(4, 3), bias_grad=f32(4)),
         r"bias_grad must be 1-D of length N=3"),
        (lambda: gemm(f32(4, 5), f32(5, 3), epilogue="dgelu", preact=f32(4, 3), bias_grad=np.ones(3, np.int32)),
         r"bias_grad dtype int32"),
        (lambda: gemm_batched(f32(2, 4, 5), f32(5, 3), epilogue="dgelu"), r"'dgelu' is 2-D only"),
        (
            lambda: gemm(
                f32(4, 5),
                f32(5, 3),
                save_preact=f32(4, 3),
                epilogue="gelu",
                out=np.ones((4, 3), np.float32)[:, :],
            ),
            None,
        ),
    ],
)
def test_bad_input_raises_clear_error(call, match):
    if match is None:
        call()  # control: a valid call does not raise
        return
    with pytest.raises(GemmError, match=match):
        call()


def test_misaligned_pointer_is_rejected():
    buf = np.zeros(4 * 20 + 1, dtype=np.uint8)
    a = np.frombuffer(buf.data, dtype=np.float32, count=20, offset=1).reshape(4, 5)
    with pytest.raises(GemmError, match=r"a: misaligned pointer 0x[0-9a-f]+; float32 data must be 4-byte aligned"):
        gemm(a, f32(5, 3))


def test_out_aliasing_an_input_is_rejected():
    a = f32(4, 4)
    with pytest.raises(GemmError, match="out overlaps input a"):
        gemm(a, f32(4, 4), out=a)


def test_dgelu_outputs_aliasing_its_inputs_are_rejected():
    a, u = f32(4, 5), f32(4, 3)
    with pytest.raises(GemmError, match="out overlaps preact"):
        gemm(a, f32(5, 3), u, epilogue="dgelu", preact=u)
    with pytest.raises(GemmError, match="bias_grad overlaps preact"):
        gemm(a, f32(5, 3), epilogue="dgelu", preact=u, bias_grad=u[0])
    with pytest.raises(GemmError, match="bias_grad overlaps a"):
        gemm(a, f32(5, 3), epilogue="dgelu", preact=u, bias_grad=a[0, :3])


def test_batched_out_with_zero_batch_stride_is_rejected():
    out = np.broadcast_to(np.zeros((4, 3), np.float32), (2, 4, 3))
    with pytest.raises(GemmError, match="batch stride 0"):
        gemm_batched(f32(2, 4, 5), f32(2, 5, 3), out=out)


def test_unknown_provider_is_rejected_for_gpu_arrays_only():
    # NumPy inputs always use the reference; the provider name is validated when dispatching to a GPU.
    out = gemm(f32(2, 2), f32(2, 2), provider="nope")
    assert out.shape == (2, 2)
