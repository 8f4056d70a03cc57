"""The traced graph before it becomes MLIR: a flat list of pure operations on single values.

Every node has one result (its index is the value id). Graph inputs are ``input`` nodes whose
binding says where the runtime finds them each call: a positional argument, a live tensor's
storage (parameters, optimizer state: bound without copies), a captured constant array, or a host
scalar recomputed from live Python state (learning rate, bias corrections).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: elementwise ops (NumPy semantics, broadcasting); value = number of operands
ELEMENTWISE = {
    "add": 2, "sub": 2, "mul": 2, "div": 2, "pow": 2, "max": 2, "min": 2, "and": 2, "or": 2, "xor": 2,
    "eq": 2, "ne": 2, "lt": 2, "le": 2, "gt": 2, "ge": 2,
    "neg": 1, "exp": 1, "log": 1, "tanh": 1, "sqrt": 1, "abs": 1, "sign": 1, "not": 1, "sin": 1, "cos": 1,
    "erf": 1, "recip": 1, "square": 1, "cast": 1, "copy": 1, "where": 3,
}
COMPARE = {"eq", "ne", "lt", "le", "gt", "ge"}
#: ops that only re-describe memory (a strided view in the runtime)
VIEWS = {"reshape", "transpose", "broadcast", "slice", "expand_dims", "squeeze"}


@dataclass
class Node:
    """One operation: ``op`` on ``inputs`` (value ids) with attributes; result shape and dtype."""

    op: str
    inputs: list[int]
    attrs: dict
    shape: tuple
    dtype: np.dtype | None  # None: an opaque object (eager context, tuples of gradients)


@dataclass
class Graph:
    nodes: list[Node] = field(default_factory=list)
    #: input node id -> binding ("arg", i) | ("live", Tensor) | ("const", array) | ("host", (fn, k))
    bindings: dict = field(default_factory=dict)
    #: (value id, sink): sink ("ret", k) | ("write", input node id) | ("grad", tensor)
    outputs: list = field(default_factory=list)
    #: Python objects the IR refers to by key (eager kernels, index expressions)
    side: list = field(default_factory=list)
    #: host effects run before each compiled call (optimizer step counters)
    effects: list = field(default_factory=list)
    #: per-call host scalar producers (fn() -> tuple of scalars)
    host_fns: list = field(default_factory=list)

    def add(self, op: str, inputs, attrs: dict, shape, dtype) -> int:
        self.nodes.append(Node(op, list(inputs), attrs, tuple(shape), None if dtype is None else np.dtype(dtype)))
        return len(self.nodes) - 1

    def keep(self, obj) -> int:
        """Store a Python object for the IR (by key)."""
        self.side.append(obj)
        return len(self.side) - 1
