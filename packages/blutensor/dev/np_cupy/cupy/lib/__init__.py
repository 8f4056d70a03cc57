"""cupy.lib of the NumPy-backed stand-in."""
