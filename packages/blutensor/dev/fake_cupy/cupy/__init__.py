"""NumPy-backed stand-in for CuPy: kernels are no-ops (Python-path smoke test only)."""

import numpy as _np
from numpy import bool_, float32, float64, int32, int64, uint16, uint32, uint64  # noqa

__version__ = "fake"
LAUNCHES = []


class _Data:
    def __init__(self, a):
        self.ptr = a.__array_interface__["data"][0]


class ndarray(_np.ndarray):
    @property
    def data(self):
        return _Data(self)

    def get(self):
        return _np.asarray(self).view(_np.ndarray).copy()


def _w(a):
    a = _np.asarray(a)
    return a.view(ndarray)


def asarray(a, dtype=None):
    return _w(_np.array(a, dtype=dtype) if not isinstance(a, _np.ndarray) or dtype is not None else _np.array(a))


def asnumpy(a):
    return _np.asarray(a).view(_np.ndarray).copy()


def empty(shape, dtype=float32):
    return _w(_np.full(shape, _np.nan if _np.dtype(dtype).kind == "f" else 0, dtype=dtype))


def zeros(shape, dtype=float32):
    return _w(_np.zeros(shape, dtype=dtype))


def ones_like(a):
    return _w(_np.ones_like(a))


def empty_like(a, dtype=None):
    return _w(_np.zeros_like(a, dtype=dtype))


def ascontiguousarray(a, dtype=None):
    return _w(_np.ascontiguousarray(a, dtype=dtype))


def argsort(a):
    return _w(_np.argsort(_np.asarray(a), kind="stable"))


def where(*a):
    return _w(_np.where(*a))


def copyto(dst, src):
    _np.copyto(dst, src)


def __getattr__(name):
    return getattr(_np, name)


class _Fn:
    max_dynamic_shared_size_bytes = 0

    def __init__(self, name):
        self.name = name

    def __call__(self, grid, block, args, shared_mem=0):
        assert isinstance(grid, tuple) and isinstance(block, tuple), (grid, block)
        for a in args:
            assert isinstance(a, (ndarray, _np.generic)), (self.name, type(a))
        LAUNCHES.append(
            (
                self.name,
                grid,
                block,
                len(args),
                shared_mem,
                tuple("ptr" if isinstance(a, ndarray) else a.dtype.name for a in args),
            )
        )


class RawModule:
    def __init__(self, code, options=()):
        import re

        self.names = set(re.findall(r"(blu_\w+)", code))

    def get_function(self, name):
        return _Fn(name)


class _Runtime:
    @staticmethod
    def getDevice():
        return 0

    @staticmethod
    def getDeviceCount():
        return 1

    @staticmethod
    def getDeviceProperties(d):
        return {"multiProcessorCount": 132, "sharedMemPerBlockOptin": 232448, "name": b"FAKE"}


class _Device:
    compute_capability = "90"

    def __init__(self, d=0):
        pass

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def use(self):
        pass


class _Event:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


def _elapsed(a, b):
    return 1.0


class cuda:  # noqa: N801
    runtime = _Runtime
    Device = _Device
    Event = _Event
    get_elapsed_time = staticmethod(_elapsed)


class random:  # noqa: N801
    @staticmethod
    def standard_normal(shape, dtype=float32):
        return _w(_np.random.standard_normal(shape).astype(dtype))

    @staticmethod
    def randint(lo, hi, n):
        return _w(_np.random.randint(lo, hi, n))
