"""cupy.lib.stride_tricks of the NumPy-backed stand-in: NumPy's, returning stand-in arrays."""

from numpy.lib import stride_tricks as _st

from cupy import _wrapfn

as_strided = _wrapfn(_st.as_strided)
sliding_window_view = _wrapfn(_st.sliding_window_view)
