"""TokenLoader: the rank-strided cursor against a NumPy reference, resume, pinned == sync."""

import blutensor as bt
import fake_cuda as fake_cuda_mod
import numpy as np
import pytest
from blumodels.data.loader import TokenLoader
from blumodels.data.shards import write_shard

# shard lengths chosen so steps do not divide them: exercises the "not enough left" advance
SHARD_LENS = (1000, 777, 50, 1234)  # the 50-token shard is smaller than any step here: skipped


@pytest.fixture()
def shards(tmp_path):
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 60000, n).astype(np.uint16) for n in SHARD_LENS]
    for i, d in enumerate(data):
        write_shard(tmp_path / f"train_{i:05d}.bin", d)
    return tmp_path, data


def reference(data, B, T, r, W, n_batches):
    """Batches rank r sees: global steps k fill [k*BTW, (k+1)*BTW]; rank r takes the r-th window."""
    BT, out = B * T, []
    while len(out) < n_batches:
        for toks in data:
            for k in range((len(toks) - 1) // (BT * W)):
                w = toks[k * BT * W + r * BT:][:BT + 1].astype(np.int64)
                out.append((w[:-1].reshape(B, T), w[1:].reshape(B, T)))
    return out[:n_batches]


def cursor_reference_w1(data, B, T, n_batches):
    """The cursor rules written out literally, for W = 1 (where they are rank independent)."""
    BT, cur, pos, out = B * T, 0, 0, []

    def advance():
        nonlocal cur, pos
        cur = (cur + 1) % len(data)
        while len(data[cur]) < BT + 1:
            cur = (cur + 1) % len(data)
        pos = 0

    while len(out) < n_batches:
        if pos + BT + 1 > len(data[cur]):
            advance()
        w = data[cur][pos:pos + BT + 1].astype(np.int64)
        out.append((w[:-1].reshape(B, T), w[1:].reshape(B, T)))
        pos += BT
        if pos + BT + 1 > len(data[cur]):
            advance()
    return out


def _take(loader, n):
    out = []
    for _ in range(n):
        x, y = loader.next_batch()
        out.append((x.numpy().copy(), y.numpy().copy()))
    return out


def _assert_same(got, want):
    assert len(got) == len(want)
    for i, ((gx, gy), (wx, wy)) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(gx, wx, err_msg=f"x of batch {i}")
        np.testing.assert_array_equal(gy, wy, err_msg=f"y of batch {i}")


def test_batch_types(shards):
    d, _ = shards
    x, y = TokenLoader(d, "train", 2, 16).next_batch()
    assert isinstance(x, bt.Tensor) and x.dtype == bt.int64 and x.shape == (2, 16) and y.shape == (2, 16)
    assert x.device.type == "cpu"
    np.testing.assert_array_equal(x.numpy()[:, 1:], y.numpy()[:, :-1])


@pytest.mark.parametrize("B,T", [(2, 16), (3, 7), (1, 100)])
def test_w1_matches_reference_and_cursor_rules(shards, B, T):
    d, data = shards
    n = 3 * sum((len(t) - 1) // (B * T) for t in data)  # three passes: shard advance and wrap-around
    got = _take(TokenLoader(d, "train", B, T), n)
    _assert_same(got, reference(data, B, T, 0, 1, n))
    _assert_same(got, cursor_reference_w1(data, B, T, n))


@pytest.mark.parametrize("W", [2, 3])
def test_ranks_disjoint_interleaved(shards, W):
    d, data = shards
    B, T, n = 2, 8, 200
    per_rank = [_take(TokenLoader(d, "train", B, T, rank=r, world_size=W), n) for r in range(W)]
    for r in range(W):
        _assert_same(per_rank[r], reference(data, B, T, r, W, n))
    # each global step: rank windows tile one contiguous stretch [k*BTW, (k+1)*BTW) of one shard
    for k in range(n):
        xs = np.concatenate([per_rank[r][k][0].ravel() for r in range(W)])
        ys = np.concatenate([per_rank[r][k][1].ravel() for r in range(W)])
        np.testing.assert_array_equal(xs[1:], ys[:-1])


def test_first_batches_positions(shards):
    d, data = shards
    B, T = 2, 10
    x0, _ = TokenLoader(d, "train", B, T, rank=0, world_size=2).next_batch()
    x1, _ = TokenLoader(d, "train", B, T, rank=1, world_size=2).next_batch()
    np.testing.assert_array_equal(x0.numpy().ravel(), data[0][:20])
    np.testing.assert_array_equal(x1.numpy().ravel(), data[0][20:40])


@pytest.mark.parametrize("W,r", [(1, 0), (2, 1)])
def test_state_dict_resume(shards, W, r):
    d, _ = shards
    B, T = 3, 11
    full = _take(TokenLoader(d, "train", B, T, rank=r, world_size=W), 150)
    for cut in (0, 1, 29, 30, 31, 97):
        a = TokenLoader(d, "train", B, T, rank=r, world_size=W)
        _take(a, cut)
        state = a.state_dict()
        assert all(isinstance(v, int | str) for v in state.values())
        b = TokenLoader(d, "train", B, T, rank=r, world_size=W)
        b.load_state_dict(state)
        _assert_same(_take(b, 150 - cut), full[cut:])
        _assert_same(_take(a, 150 - cut), full[cut:])  # saving does not disturb the original


def test_reset_and_state_errors(shards):
    d, _ = shards
    a = TokenLoader(d, "train", 2, 16)
    first = _take(a, 3)
    a.reset()
    _assert_same(_take(a, 3), first)
    s = a.state_dict()
    with pytest.raises(ValueError, match="batch_size=2 but this loader has batch_size=4"):
        TokenLoader(d, "train", 4, 16).load_state_dict(s)
    with pytest.raises(ValueError, match="out of range"):
        a.load_state_dict({**s, "shard": 99})


def test_loader_errors(tmp_path, shards):
    d, _ = shards
    with pytest.raises(FileNotFoundError, match="no 'val' shards"):
        TokenLoader(d, "val", 2, 16)
    with pytest.raises(ValueError, match="smaller than one step"):
        TokenLoader(d, "train", 64, 64)
    with pytest.raises(ValueError, match="rank 2 out of range"):
        TokenLoader(d, "train", 2, 16, rank=2, world_size=2)
    with pytest.raises(ValueError, match="pinned=True"):
        TokenLoader(d, "train", 2, 16, pinned=True)
    if not _cuda_ok():
        with pytest.raises(RuntimeError, match="needs CuPy and a CUDA GPU"):
            TokenLoader(d, "train", 2, 16, device="cuda")


def test_uint32_shards(tmp_path):
    toks = np.arange(70000, 70000 + 500, dtype=np.uint32)
    write_shard(tmp_path / "train_00000.bin", toks)
    x, y = TokenLoader(tmp_path, "train", 2, 10).next_batch()
    np.testing.assert_array_equal(x.numpy().ravel(), toks[:20])
    np.testing.assert_array_equal(y.numpy().ravel(), toks[1:21])


def _cuda_ok():
    try:
        return bt.cuda.is_available()
    except Exception:
        return False


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda_ok(), reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("W,r", [(1, 0), (2, 1), (3, 2)])
def test_pinned_equals_sync_on_cuda(shards, W, r):
    """CPU twin: test_w1_matches_reference_and_cursor_rules / test_state_dict_resume on the sync path."""
    d, data = shards
    B, T, n = 2, 16, 120
    fast = TokenLoader(d, "train", B, T, rank=r, world_size=W, device="cuda")
    slow = TokenLoader(d, "train", B, T, rank=r, world_size=W, device="cuda", pinned=False)
    assert fast.pinned and not slow.pinned
    got_fast = []
    for i in range(n):
        x, y = fast.next_batch()
        assert x.device.type == "cuda" and x.dtype == bt.int64
        got_fast.append((x.numpy().copy(), y.numpy().copy()))
        if i == 40:
            state = fast.state_dict()
    _assert_same(got_fast, _take(slow, n))
    _assert_same(got_fast, reference(data, B, T, r, W, n))
    resumed = TokenLoader(d, "train", B, T, rank=r, world_size=W, device="cuda")
    resumed.load_state_dict(state)
    _assert_same(_take(resumed, n - 41), got_fast[41:])


# ------------------------------------------------------------ the pinned path on an emulated CUDA (CPU twin)
@pytest.fixture()
def fake_cuda(monkeypatch):
    """The shared fake CUDA device (testing/fake_cuda/): copies queued on a stream run only when an event
    recorded after them is waited on or synchronized; ``arr.set(host, stream)`` reads ``host`` when it runs."""
    from blumodels.data import loader as loader_mod

    fake_cuda_mod.install(monkeypatch)
    monkeypatch.setattr(loader_mod, "_pinned_empty", lambda shape, dtype: np.zeros(shape, dtype))
    return monkeypatch


@pytest.mark.parametrize("W,r", [(1, 0), (2, 1)])
def test_algorithm2_emulated(shards, fake_cuda, W, r):
    """The double buffer, copy stream and events on a CUDA emulation give the reference batches and resume."""
    d, data = shards
    B, T, n = 2, 16, 120
    fast = TokenLoader(d, "train", B, T, rank=r, world_size=W, device="cuda")
    slow = TokenLoader(d, "train", B, T, rank=r, world_size=W, device="cuda", pinned=False)
    assert fast.pinned and not slow.pinned
    got = _take(fast, n)
    _assert_same(got, reference(data, B, T, r, W, n))
    _assert_same(_take(slow, n), got)
    a = TokenLoader(d, "train", B, T, rank=r, world_size=W, device="cuda")
    _take(a, 37)
    b = TokenLoader(d, "train", B, T, rank=r, world_size=W, device="cuda")
    b.load_state_dict(a.state_dict())
    _assert_same(_take(b, n - 37), got[37:])
    fast.reset()  # re-priming mid-stream (as an evaluation loop does)
    _assert_same(_take(fast, 5), got[:5])


def test_algorithm2_emulation_catches_missing_wait(shards, fake_cuda):
    """The emulation is strict: without "default stream waits on h2d_done" the batches are wrong."""
    d, data = shards
    fake_cuda.setattr(fake_cuda_mod.Stream, "wait_event", lambda self, ev: None)
    got = _take(TokenLoader(d, "train", 2, 16, device="cuda"), 10)
    assert not all(np.array_equal(g[0], w[0]) for g, w in zip(got, reference(data, 2, 16, 0, 1, 10)))
