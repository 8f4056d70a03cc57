"""Invalid meshes are rejected before any communication, with the reason."""

import pytest
from dtms.parallel import MeshError, ParallelDims, local_positions, shard_sequence


def test_product_must_equal_world():
    with pytest.raises(MeshError, match=r"dp=2 x cp=1 x tp=2 = 4 != world size 3"):
        ParallelDims(dp=2, tp=2).validate(3)


def test_heads_divisible_by_tp():
    with pytest.raises(MeshError, match="n_head=12 is not divisible by tp=5"):
        ParallelDims(tp=5).validate(5, n_head=12)


def test_sequence_divisible_by_2cp():
    with pytest.raises(MeshError, match=r"sequence length 1000 is not divisible by 2\*cp=16"):
        ParallelDims(cp=8).validate(8, seq_len=1000)


def test_positive_sizes():
    with pytest.raises(MeshError, match="tp=0"):
        ParallelDims(tp=0).validate(1)


def test_coords_roundtrip():
    d = ParallelDims(dp=2, cp=3, tp=2)
    seen = set()
    for r in range(d.world_size):
        c = d.coords(r)
        assert d.rank_of(*c) == r
        seen.add(c)
    assert len(seen) == 12


def test_load_balanced_layout():
    # rank r holds chunks r and 2W-1-r: every rank gets the same causal work
    W, T = 4, 16
    allpos = sorted(p for r in range(W) for p in local_positions(T, r, W))
    assert allpos == list(range(T))
    assert list(local_positions(T, 0, W)) == [0, 1, 14, 15]
    work = [sum(int(p) + 1 for p in local_positions(T, r, W)) for r in range(W)]
    assert len(set(work)) == 1
    import numpy as np

    x = np.arange(2 * T).reshape(2, T)
    assert shard_sequence(x, 1, W).tolist() == [[2, 3, 12, 13], [18, 19, 28, 29]]
