"""ops.dispatch.kernel_for: resolve() cached with the dispatcher's choices, and cleared with them."""

from blutensor.ops import dispatch


def _origin(k):
    """The kernel class resolve() chose (it may wrap it in a subclass that fills missing dispatch flags)."""
    return next(c for c in k.__mro__ if "forward" in vars(c))


def test_kernel_for_is_resolve_cached_and_cleared_with_the_cache():
    try:
        k = dispatch.kernel_for("gelu", "cpu", "float32")
        assert _origin(k) is _origin(dispatch.resolve("gelu", "cpu", "float32"))
        assert dispatch.kernel_for("gelu", "cpu", "float32") is k  # cached: the same object, no second lookup
        dispatch.clear_cache()
        assert ("gelu", "cpu", "float32", "kernel_for") not in dispatch._cache
        assert _origin(dispatch.kernel_for("gelu", "cpu", "float32")) is _origin(k)
    finally:
        dispatch.clear_cache()
