"""NumPy-backed CuPy stand-in for exercising blutensor's CUDA-branch Python code on a CPU."""

import numpy as _np

__version__ = "fake-np"


class _Dev:
    def __init__(self, i=0):
        self.id = i
    compute_capability = "90"
    def __enter__(self):
        return self
    def __exit__(self, *a):
        return False
    def synchronize(self):
        pass
    def use(self):
        pass


class _Data:
    def __init__(self, a):
        self.ptr = a.__array_interface__["data"][0]


class ndarray(_np.ndarray):
    @property
    def device(self):
        return _Dev(0)

    @property
    def data(self):
        return _Data(self)

    def get(self):
        return _np.asarray(self).view(_np.ndarray).copy()

    for _m in ("sum", "max", "min", "mean", "argmax", "argmin", "all", "any", "prod", "std", "var", "astype",
               "copy", "reshape", "__getitem__", "take", "swapaxes", "transpose", "squeeze", "view"):
        def _mk(name):
            base = getattr(_np.ndarray, name)

            def f(self, *a, **k):
                return _w(base(self, *[_unw(x) for x in a], **k))
            return f
        locals()[_m] = _mk(_m)

    def __array_wrap__(self, obj, context=None, return_scalar=False):
        out = _np.ndarray.__array_wrap__(self, obj, context, False)
        return out if isinstance(out, ndarray) else _w(out)


def _w(x):
    if isinstance(x, ndarray):
        return x
    if isinstance(x, (_np.ndarray, _np.generic)):
        return _np.asarray(x).view(ndarray)
    if isinstance(x, tuple):
        return tuple(_w(i) for i in x)
    if isinstance(x, list):
        return [_w(i) for i in x]
    return x


def _unw(x):
    if isinstance(x, ndarray):
        return x.view(_np.ndarray)
    if isinstance(x, (list, tuple)):
        return type(x)(_unw(i) for i in x)
    return x


def _wrapfn(f):
    def g(*a, **k):
        return _w(f(*[_unw(x) for x in a], **{kk: _unw(v) for kk, v in k.items()}))
    return g


def asarray(a, dtype=None):
    if isinstance(a, _np.ndarray) and not isinstance(a, ndarray) and type(a) is not _np.ndarray:
        raise TypeError("fake cupy: unexpected array type")
    return _w(_np.array(_unw(a), dtype=dtype))


def asnumpy(a):
    return _np.asarray(a).view(_np.ndarray).copy()


class _Runtime:
    @staticmethod
    def getDeviceCount():
        return 1

    @staticmethod
    def getDevice():
        return 0

    @staticmethod
    def getDeviceProperties(i):
        return {"name": b"FakeGPU"}


class cuda:  # noqa: N801
    runtime = _Runtime
    Device = _Dev


def get_default_memory_pool():
    class P:
        def total_bytes(self):
            return 0
    return P()


def __getattr__(name):
    obj = getattr(_np, name)
    if callable(obj) and not isinstance(obj, type):
        if isinstance(obj, _np.ufunc):
            class U:
                def __call__(self, *a, **k):
                    return _wrapfn(obj)(*a, **k)
                def __getattr__(self, n):
                    return _wrapfn(getattr(obj, n))
            return U()
        return _wrapfn(obj)
    return obj
