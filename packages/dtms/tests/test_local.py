"""The one-process ('local') backend and the module-level API; CPU twins of the NCCL world-1 checks."""

import dtms
import numpy as np
import pytest
from dtms import CollectiveError
from dtms.backends.local import LocalProcessGroup
from dtms_testutil import world1_checks


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
    from blutensor.ext import BlutrainSpecs
    from dtms import hooks

    pm = pluggy.PluginManager("blutrain")
    pm.add_hookspecs(BlutrainSpecs)
    pm.register(hooks)
    for provided in pm.hook.blutrain_register_parallel_strategies():
        for cls in provided if isinstance(provided, list) else [provided]:
            assert isinstance(cls.PLUGIN_NAME, str)


def test_missing_backends_name_the_extra(monkeypatch):
    import sys

    from dtms.backends.mpi import import_mpi
    from dtms.backends.nccl import import_nccl

    monkeypatch.setitem(sys.modules, "mpi4py", None)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)
    with pytest.raises(RuntimeError, match=r"'mpi' backend needs mpi4py.*pip install dtms\[mpi\]"):
        import_mpi()
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(RuntimeError, match=r"'nccl' backend needs CuPy.*pip install dtms\[cuda12\]"):
        import_nccl()
