"""cuda_ops/sort.py: the sync-free stable radix argsort equals NumPy's stable argsort (CPU reference)."""

import numpy as np
import pytest
from blutensor.cuda_ops.sort import stable_argsort


@pytest.mark.parametrize("n, V", [(0, 5), (1, 5), (17, 3), (1000, 256), (4096, 257), (16384, 50304), (3000, 1 << 20)])
def test_stable_argsort_matches_numpy(n, V):
    keys = np.random.default_rng(n + V).integers(0, V, size=n)
    got = stable_argsort(keys, V)
    np.testing.assert_array_equal(got, np.argsort(keys, kind="stable"))


def test_stable_argsort_many_duplicates_keeps_order():
    keys = np.array([3, 1, 3, 3, 0, 1, 0, 3] * 50)
    np.testing.assert_array_equal(stable_argsort(keys, 4), np.argsort(keys, kind="stable"))
