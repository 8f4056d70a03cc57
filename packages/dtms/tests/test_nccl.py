"""NCCL backend at world size 1 on a GPU (skipped without CuPy, NCCL or a GPU); CPU twin: test_local.py."""

import dtms
import numpy as np
import pytest
from dtms_testutil import clean_env, world1_checks


def _cupy():
    try:
        import cupy
        from cupy.cuda import nccl

        if cupy.cuda.runtime.getDeviceCount() < 1 or not getattr(nccl, "available", True):
            return None
        return cupy
    except Exception:
        return None


cp = _cupy()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(cp is None, reason="needs CuPy with NCCL and a GPU")]


@pytest.fixture
def nccl_group(monkeypatch):
    for k in list(__import__("os").environ):
        monkeypatch.delenv(k, raising=False)
    for k, v in clean_env().items():
        monkeypatch.setenv(k, v)
    pg = dtms.init_process_group("nccl")
    yield pg
    dtms.destroy_process_group()


def test_nccl_world1(nccl_group):
    assert nccl_group.backend == "nccl"
    world1_checks(nccl_group, cp)


def test_nccl_refuses_host_arrays(nccl_group):
    with pytest.raises(dtms.CollectiveError, match="nccl backend works on CuPy"):
        nccl_group.all_reduce(np.zeros(3, np.float32))


@pytest.mark.parametrize("side_stream", [True, False])
def test_nccl_inside_cuda_graph(nccl_group, side_stream):
    nccl_group.use_side_stream = side_stream
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        x = cp.arange(1024, dtype=cp.float32)
        out = cp.zeros(1024, dtype=cp.float32)
        x *= 2  # compile the kernel before capture
        s.begin_capture()
        nccl_group.all_reduce(x, op="avg")
        x *= 2
        nccl_group.all_gather(out, x)
        w = nccl_group.all_reduce(out, op="sum", async_op=True)
        w.wait()
        g = s.end_capture()
        x[...] = cp.arange(1024, dtype=cp.float32)
        g.launch(s)
        g.launch(s)
        s.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(x), np.arange(1024, dtype=np.float32) * 4)
    np.testing.assert_array_equal(cp.asnumpy(out), np.arange(1024, dtype=np.float32) * 4)
