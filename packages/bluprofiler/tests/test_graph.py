"""Graph recorder: nodes, leaves, edges, shapes; JSON and dot."""

from __future__ import annotations

import json

import blutensor as bt
import pytest
from bluprofiler import profile, record_graph, record_shapes, save_graph, to_dot
from bluprofiler.demo import GPT, PRESETS
from bluprofiler.graph import GraphError


def test_small_graph_structure():
    a = bt.randn(3, 4, requires_grad=True)
    b = bt.randn(4, 2, requires_grad=True)
    with record_shapes():
        loss = bt.sum(bt.matmul(a, b) * a.sum())
    g = record_graph(loss, names={id(a): "a", id(b): "b"})
    ops = [n["op"] for n in g["nodes"]]
    assert ops[0] == "sum" and sorted(ops) == sorted(["sum", "mul", "matmul", "sum", "AccumulateGrad",
                                                      "AccumulateGrad"])
    leaves = {n["name"]: n for n in g["nodes"] if n["kind"] == "leaf"}
    assert leaves["a"]["shape"] == [3, 4] and leaves["b"]["shape"] == [4, 2]
    # a is reached twice (through matmul and through a.sum()): one node, two edges into it
    ida = leaves["a"]["id"]
    assert len([e for e in g["edges"] if e["dst"] == ida]) == 2
    mm = next(n for n in g["nodes"] if n["op"] == "matmul")
    assert mm["shape"] == [3, 2] and mm["in_shapes"] == [[3, 4], [4, 2]]
    assert {(e["src"], e["input"]) for e in g["edges"] if e["src"] == mm["id"]} == {(mm["id"], 0), (mm["id"], 1)}
    dot = to_dot(g)
    assert dot.startswith("digraph") and "matmulBackward\\n(3, 2)" in dot and 'label="a\\n(3, 4)"' in dot
    assert dot.count("->") == len(g["edges"])


def test_gpt_graph_names_every_parameter(tmp_path):
    c = PRESETS["tiny"]
    bt.manual_seed(0)
    m = GPT(c)
    idx = bt.randint(0, c.vocab_size, (2, 8))
    with profile(memory=False):  # the profiler annotates shapes too
        loss = bt.nn.functional.cross_entropy(m(idx).view(-1, c.vocab_size), idx.view(-1))
    pj, pd = save_graph(loss, tmp_path / "graph", names=m)
    g = json.loads(pj.read_text())
    leaves = [n for n in g["nodes"] if n["kind"] == "leaf"]
    assert sorted(n["name"] for n in leaves) == sorted(n for n, _ in m.named_parameters())
    assert g["nodes"][0]["op"] == "cross_entropy" and g["nodes"][0]["shape"] == []
    assert sum(n["op"] == "sdpa" for n in g["nodes"]) == c.n_layer
    assert pd.read_text().count("->") == len(g["edges"])


def test_no_graph_is_a_clear_error():
    with pytest.raises(GraphError, match="no grad_fn"):
        record_graph(bt.randn(2) * 2)
