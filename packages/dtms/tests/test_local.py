"""The one-process ('local') backend and the module-level API; CPU twins of the NCCL world-1 checks."""

import dtms
import numpy as np
import pytest
from dtms import CollectiveError, Work
from dtms.backends.local import LocalProcessGroup


class FakeTensor:
    """Stands in for a blutensor Tensor: collectives use its ``_data``."""

    def __init__(self, data):
        self._data = data


def world1_checks(pg, xp):
    """The assertions shared by the local backend (NumPy) and NCCL at world size 1 (CuPy)."""
    ref = np.arange(12, dtype=np.float32).reshape(3, 4)
    for op in ("sum", "avg", "max", "min", "prod"):
        x = xp.asarray(ref.copy())
        assert pg.all_reduce(x, op=op) is None
        np.testing.assert_array_equal(xp.asnumpy(x) if xp is not np else x, ref)
    out = xp.zeros(12, dtype=xp.float32)
    pg.all_gather(out, xp.asarray(ref))
    rs = xp.zeros(12, dtype=xp.float32)
    pg.reduce_scatter(rs, xp.asarray(ref.reshape(-1)), op="avg")
    a2a = xp.zeros((3, 4), dtype=xp.float32)
    pg.all_to_all(a2a, xp.asarray(ref))
    b = xp.asarray(ref.copy())
    pg.broadcast(b, src=0)
    for got in (out, rs, a2a, b):
        np.testing.assert_array_equal(np.asarray(got.get() if hasattr(got, "get") else got).reshape(-1),
                                      ref.reshape(-1))
    t = FakeTensor(xp.asarray(ref.copy()))
    w = pg.all_reduce(t, op="avg", async_op=True)
    assert isinstance(w, Work)
    w.wait()
    w.synchronize()
    assert w.is_completed()
    pg.barrier()
    sub = pg.new_group([0])
    assert sub.size() == 1 and sub.rank() == 0
    with pytest.raises(CollectiveError, match="not C-contiguous"):
        pg.all_reduce(xp.zeros((4, 4), dtype=xp.float32)[:, 1])
    with pytest.raises(CollectiveError, match="unknown op 'mean'"):
        pg.all_reduce(xp.zeros(2, dtype=xp.float32), op="mean")
    with pytest.raises(CollectiveError, match="'avg' needs a floating dtype"):
        pg.all_reduce(xp.zeros(2, dtype=xp.int32), op="avg")
    with pytest.raises(CollectiveError, match="expected group size 1 x input size 12 = 12"):
        pg.all_gather(xp.zeros(5, dtype=xp.float32), xp.asarray(ref))
    with pytest.raises(CollectiveError, match="output dtype float64 differs from input dtype float32"):
        pg.all_gather(xp.zeros(12, dtype=xp.float64), xp.asarray(ref))
    with pytest.raises(CollectiveError, match="src=1 is not a rank of this group of size 1"):
        pg.broadcast(xp.zeros(2, dtype=xp.float32), src=1)
    with pytest.raises(CollectiveError, match="dst=0 is this rank"):
        pg.send(xp.zeros(2, dtype=xp.float32), 0)
    with pytest.raises(CollectiveError, match=r"new_group: ranks \[1\] are not in this group"):
        pg.new_group([1])
    with pytest.raises(TypeError, match="must be a NumPy/CuPy array or a blutensor Tensor, got list"):
        pg.all_reduce([1.0, 2.0])


def test_local_world1():
    world1_checks(LocalProcessGroup(), np)


def test_read_only_array_refused():
    x = np.zeros(3)
    x.flags.writeable = False
    with pytest.raises(CollectiveError, match="read-only"):
        LocalProcessGroup().all_reduce(x)


def test_module_api_single_process(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeError, match="init_process_group\\(\\) has not been called"):
        dtms.get_rank()
    pg = dtms.init_process_group("local")
    try:
        assert dtms.is_initialized() and dtms.get_default_group() is pg
        assert (dtms.get_rank(), dtms.get_world_size(), dtms.get_backend()) == (0, 1, "local")
        with pytest.raises(RuntimeError, match="already called"):
            dtms.init_process_group("local")
        x = np.ones(4)
        dtms.all_reduce(x, op="avg")
        w = dtms.all_reduce(x, async_op=True)
        w.wait()
        g = np.zeros(4)
        dtms.all_gather(g, x)
        dtms.broadcast(x, 0)
        dtms.barrier()
        assert dtms.new_group([0]).size() == 1
        assert dtms.get_store() is None  # no MASTER_ADDR/PORT: no store
    finally:
        dtms.destroy_process_group()
    assert not dtms.is_initialized()
    dtms.destroy_process_group()  # idempotent


def test_hooks_module_is_a_valid_plugin():
    import pluggy
    from blutensor.plugin.specs import BlutrainSpecs
    from dtms import hooks

    pm = pluggy.PluginManager("blutrain")
    pm.add_hookspecs(BlutrainSpecs)
    pm.register(hooks)
    for provided in pm.hook.blutrain_register_parallel_strategies():
        for cls in provided if isinstance(provided, list) else [provided]:
            assert isinstance(cls.PLUGIN_NAME, str)
