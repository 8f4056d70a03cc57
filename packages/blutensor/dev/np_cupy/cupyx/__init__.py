import numpy as _np


def scatter_add(a, slices, value):
    import cupy
    if not isinstance(a, cupy.ndarray):
        raise TypeError("scatter_add: not a (fake) cupy array")
    _np.add.at(a.view(_np.ndarray), cupy._unw(slices), cupy._unw(value))
