"""Graph recorder: the autograd graph behind a loss, as JSON and Graphviz dot.

Walks from ``loss.grad_fn`` through ``Node.next``; ``AccumulateGrad`` nodes are the leaves
(parameters and other tensors that require grad). Shapes: leaves always; op nodes when the graph
was built under a :class:`~bluprofiler.Profiler` with ``record_shapes`` (it annotates
``node.meta``) or inside :func:`record_shapes`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class GraphError(ValueError):
    """The thing passed has no autograd graph."""


def record_graph(root: Any, names: dict | Any = None) -> dict:
    """The graph reachable from ``root`` (a Tensor with a grad_fn, or a Node).

    ``names``: a Module (its named_parameters label the leaves) or a dict {id(tensor): name}.
    Returns ``{"nodes": [...], "edges": [...]}``; node ids follow a breadth-first walk from the root.
    """
    node = getattr(root, "grad_fn", root) if not _is_node(root) else root
    if node is None or not _is_node(node):
        if getattr(root, "requires_grad", False):
            node = root._acc_node()
        else:
            raise GraphError(f"record_graph: {getattr(root, '_desc', lambda: repr(root))()} has no grad_fn "
                             f"(was it computed under no_grad, or from tensors that do not require grad?)")
    if names is not None and hasattr(names, "named_parameters"):
        names = {id(p): n for n, p in names.named_parameters()}
    names = names or {}
    ids: dict[int, int] = {id(node): 0}
    order = [node]
    edges = []
    i = 0
    while i < len(order):
        n = order[i]
        for slot, nxt in enumerate(getattr(n, "next", ())):
            if nxt is None:
                continue
            j = ids.get(id(nxt))
            if j is None:
                j = ids[id(nxt)] = len(order)
                order.append(nxt)
            edges.append({"src": ids[id(n)], "dst": j, "input": slot})
        i += 1
    nodes = [_describe(k, n, names) for k, n in enumerate(order)]
    return {"root": 0, "nodes": nodes, "edges": edges}


def _is_node(x: Any) -> bool:
    return hasattr(x, "next") and hasattr(x, "seq")


def _describe(k: int, n: Any, names: dict) -> dict:
    if type(n).__name__ == "AccumulateGrad":
        t = n.tensor
        d = {"id": k, "op": "AccumulateGrad", "kind": "leaf", "seq": n.seq, "shape": list(t.shape),
             "dtype": t.dtype.name}
        if id(t) in names:
            d["name"] = names[id(t)]
        return d
    d = {"id": k, "op": n.op, "kind": "op", "seq": n.seq, "kernel": _kname(n.kernel), "freed": bool(n.freed)}
    meta = n.meta if isinstance(n.meta, dict) else None
    if meta:
        if meta.get("out_shape") is not None:
            d["shape"] = list(meta["out_shape"])
        if meta.get("in_shapes") is not None:
            d["in_shapes"] = [list(s) if s is not None else None for s in meta["in_shapes"]]
    return d


def _kname(k: Any) -> str:
    k = getattr(k, "kernel", k)
    return getattr(k, "PLUGIN_NAME", None) or getattr(k, "__name__", type(k).__name__)


def to_dot(graph: dict) -> str:
    """Graphviz dot text: ops as boxes, leaves as ellipses, edges from consumer to producer
    (the direction gradients flow), labelled with the input slot."""
    lines = ["digraph autograd {", '  rankdir=TB; node [fontname="Helvetica", fontsize=10];']
    for n in graph["nodes"]:
        shape = f"\\n{tuple(n['shape'])}" if "shape" in n else ""
        if n["kind"] == "leaf":
            label = (n.get("name") or "leaf") + shape
            lines.append(f'  n{n["id"]} [shape=ellipse, style=filled, fillcolor="#d9ead3", label="{_esc(label)}"];')
        else:
            label = f"{n['op']}Backward{shape}"
            fill = "#fce5cd" if n["id"] == graph["root"] else "#ffffff"
            lines.append(f'  n{n["id"]} [shape=box, style=filled, fillcolor="{fill}", label="{_esc(label)}"];')
    for e in graph["edges"]:
        lines.append(f'  n{e["src"]} -> n{e["dst"]} [label="{e["input"]}", fontsize=8];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _esc(s: str) -> str:
    return s.replace('"', '\\"')


def save_graph(root: Any, out: str | Path, names: Any = None) -> tuple[Path, Path]:
    """Write ``<out>.json`` and ``<out>.dot`` for the graph behind ``root``; returns both paths."""
    g = record_graph(root, names)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pj, pd = out.with_suffix(".json"), out.with_suffix(".dot")
    pj.write_text(json.dumps(g, indent=1))
    pd.write_text(to_dot(g))
    return pj, pd


@contextmanager
def record_shapes() -> Iterator[None]:
    """Annotate autograd nodes created inside the block with input/output shapes (no timing)."""
    from blutensor import ext

    from bluprofiler.profiler import _annotate, _shape

    def obs(op, inputs, attrs, run):
        res = run()
        node = getattr(res, "grad_fn", None)
        if node is not None:
            _annotate(node, tuple(_shape(x) for x in inputs), _shape(res))
        return res

    ext.add_op_observer(obs)
    try:
        yield
    finally:
        ext.remove_op_observer(obs)
