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


def test_async_wait_orders_the_current_stream_without_blocking_the_host(nccl_group):
    """wait() makes the current stream wait on the collective's event: later work sees its result."""
    big = cp.ones(1 << 26, dtype=cp.float32)
    x = cp.asarray(np.arange(1024, dtype=np.float32))
    with nccl_group.stream:  # keep the communication stream busy for a while
        for _ in range(40):
            big *= 1.0000001
    w = nccl_group.all_reduce(x, op="avg", async_op=True)
    w.wait()
    y = x * 2  # ordered after the collective
    w.synchronize()
    assert w.is_completed()
    np.testing.assert_array_equal(cp.asnumpy(y), np.arange(1024, dtype=np.float32) * 2)


def test_collective_sees_prior_work_of_the_current_stream(nccl_group):
    x = cp.zeros(1 << 24, dtype=cp.float32)
    x += 1.0
    x += 1.0
    nccl_group.all_reduce(x, op="max")
    assert float(x[0]) == 2.0 and float(x[-1]) == 2.0


def test_store_bootstrap_shares_the_nccl_id_and_makes_sub_groups():
    from dtms.backends.nccl import NCCLProcessGroup, StoreBootstrap

    st = dtms.TCPStore("127.0.0.1", 0, is_server=True, secret="nccl-test")
    try:
        g = NCCLProcessGroup(0, 1, StoreBootstrap(st, "dtms/check", 10.0))
        assert len(st.get("dtms/check/nccl_unique_id")) == 128
        x = cp.ones(16, cp.float32)
        g.all_reduce(x)
        assert float(x.sum()) == 16.0
        g.new_group([0]).all_reduce(x)
        assert float(x.sum()) == 16.0
        g.destroy()
    finally:
        st.close()


@pytest.mark.skipif(cp is None or cp.cuda.runtime.getDeviceCount() < 2, reason="needs 2 GPUs")
def test_blurun_on_several_gpus_runs_the_collectives_against_numpy(tmp_path):
    """blurun launches one rank per GPU (up to 4); each checks every collective against NumPy
    (workers/nccl_worker.py) and lists what passed."""
    import json
    import os
    import subprocess
    import sys

    n = min(cp.cuda.runtime.getDeviceCount(), 4)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    worker = os.path.join(os.path.dirname(__file__), "workers", "nccl_worker.py")
    p = subprocess.run([sys.executable, "-m", "dtms.run", "--nproc-per-node", str(n), "--log-dir",
                        str(tmp_path / "logs"), worker, str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=150)
    assert p.returncode == 0, p.stderr[-2000:]
    ranks = [json.loads((tmp_path / f"nccl_rank{r}.json").read_text()) for r in range(n)]
    want = {"all_reduce_sum", "all_reduce_avg", "all_reduce_max", "all_reduce_min", "reduce_scatter", "all_gather",
            "broadcast", "all_to_all", "send_recv", "async", "subgroup"}
    assert all(want <= set(r["passed"]) for r in ranks), ranks
