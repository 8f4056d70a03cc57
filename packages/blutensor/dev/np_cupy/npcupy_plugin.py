import blutensor.backend as be
import blutensor.cuda_ops as co
import cupy

co.cupy_installed = lambda: False  # the fused kernels need a real GPU; test the generic CUDA branch
_orig = be.array_module


def array_module(arr):  # the fake's arrays subclass np.ndarray; real CuPy arrays do not
    return cupy if isinstance(arr, cupy.ndarray) else _orig(arr)


be.array_module = array_module
import blutensor.ops._util as u  # noqa: E402

u.array_module = array_module
