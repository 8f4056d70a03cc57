"""compiled == eager on a suite of small graphs (values and gradients), through the C backend."""

import blucompiler
import blutensor as bt
import blutensor.nn.functional as F
import numpy as np
import pytest
from helpers import maxdiff


def _params(rng, *shapes):
    return [bt.tensor(rng.standard_normal(s).astype(np.float32), requires_grad=True) for s in shapes]


CASES = {
    "mlp_relu": (lambda x, w1, w2: F.relu(x @ w1) @ w2, [(4, 8), (8, 16), (16, 3)]),
    "tanh_sigmoid": (lambda x, w: F.sigmoid(F.tanh(x * w) + x), [(5, 7), (5, 7)]),
    "broadcast_arith": (lambda x, b: (x - b) / (b * b + 1.0) + 2.0 * x, [(3, 4, 5), (5,)]),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (6,), w, b, 1e-5), [(2, 3, 6), (6,), (6,)]),
    "softmax": (lambda x, w: F.softmax(x * w, -1), [(4, 9), (4, 9)]),
    "log_softmax_dim0": (lambda x: F.log_softmax(x, 0), [(5, 3)]),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), [(4, 6)]),
    "gelu_erf": (lambda x: F.gelu(x), [(4, 6)]),
    "reductions": (lambda x: x.sum(1) * x.mean(0).sum() + bt.amax(x, 1), [(3, 5)]),
    "var_sqrt_exp_log": (lambda x: bt.var(x, 1) + bt.exp(x).mean() + bt.log(x * x + 1.0).sum(), [(4, 5)]),
    "transpose_permute_bmm": (lambda a, b: bt.bmm(a.transpose(1, 2), b.permute(0, 2, 1)), [(2, 5, 3), (2, 4, 5)]),
    "where_maximum_clamp": (lambda x, y: bt.where(x > y, x, y) + bt.maximum(x, y) + bt.clamp(x, -0.5, 0.5),
                            [(3, 4), (3, 4)]),
    "cat_stack_getitem": (lambda a, b: bt.cat([a, b], 1)[:, 1:4] * bt.stack([a, b], 0).sum(0)[:, :3],
                          [(3, 4), (3, 4)]),
    "sdpa_causal": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                    [(2, 2, 5, 4), (2, 2, 5, 4), (2, 2, 5, 4)]),
    "linear_bias": (lambda x, w, b: F.linear(x, w, b), [(2, 3, 4), (6, 4), (6,)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_small_graph(name):
    fn, shapes = CASES[name]
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    base = [rng.standard_normal(s).astype(np.float32) for s in shapes]

    def run(compiled):
        ps = [bt.tensor(a, requires_grad=True) for a in base]

        def step(*args):
            for p in args:
                p.grad = None
            out = fn(*args)
            out.sum().backward()
            return out

        f = blucompiler.compile(step, backend="c") if compiled else step
        res = []
        for _ in range(2):  # first call traces, second runs the compiled program
            out = f(*ps)
            res.append((out.numpy().copy(), [p.grad.numpy().copy() for p in ps]))
        return res, f

    eager, _ = run(False)
    comp, f = run(True)
    for (oe, ge), (oc, gc) in zip(eager, comp):
        assert maxdiff(oe, oc) <= 2e-6 * max(1.0, float(np.abs(oe).max()))
        for a, b in zip(ge, gc):
            assert maxdiff(a, b) <= 2e-6 * max(1.0, float(np.abs(a).max()))
    assert f.report()["fallback_ops"] == {}


def test_forward_only_graph_with_integer_ops():
    x = bt.tensor(np.arange(12, dtype=np.float32).reshape(3, 4))
    f = blucompiler.compile(lambda t: (bt.argmax(t, 1), (t > 5).sum(), t.mean()), backend="c")
    for _ in range(2):
        a, c, m = f(x)
        assert a.numpy().tolist() == [3, 3, 3] and int(c.item()) == 6 and m.item() == pytest.approx(5.5)
