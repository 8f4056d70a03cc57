"""Passes over the blu dialect (each an xDSL ModulePass), run in order by :mod:`pipeline`."""
