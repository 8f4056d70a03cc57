"""Health-aware GPU placement: a fake NVML on CPU (healthy, ECC, throttled, XID, retired pages, lost GPUs;
NUMA pinning), blurun end to end with the fake, and a cuda-marked check with the real NVML."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from dtms import placement as pl
from dtms_testutil import clean_env, run_blurun

FAKE = Path(__file__).parent / "fakenvml"
ALLOWED = sorted(os.sched_getaffinity(0))
C0, C1 = ALLOWED[0], ALLOWED[-1]  # two "NUMA nodes" on whatever cores this machine lets us use
SPEC = [
    {"uuid": "GPU-aaaa-0", "numa": 0, "cpus": [C0, 64 + 7]},  # healthy (core 71 is outside our affinity)
    {"uuid": "GPU-bbbb-1", "numa": 0, "cpus": [C0], "ecc_uncorrected": 2, "ecc_corrected": 5},
    {"uuid": "GPU-cccc-2", "numa": 1, "cpus": [C1], "throttle": 0x8 | 0x4},  # hw slowdown (+ power cap)
    {"uuid": "GPU-dddd-3", "numa": 1, "cpus": [C1], "xids": [79]},  # fell off the bus
    {"uuid": "GPU-eeee-4", "numa": 1, "cpus": [C1], "throttle": 0x4 | 0x1},  # power cap, idle: normal
    {"uuid": "GPU-ffff-5", "numa": 1, "cpus": [C1], "retired_pages": 61},
    {"uuid": "GPU-gggg-6", "numa": 1, "cpus": [C1], "remap": (1, 0)},
    {"uuid": "GPU-hhhh-7", "lost": True},
]


@pytest.fixture
def fake_nvml(monkeypatch):
    monkeypatch.syspath_prepend(str(FAKE))
    sys.modules.pop("pynvml", None)
    import pynvml

    pynvml.configure([dict(g) for g in SPEC])
    yield pynvml
    sys.modules.pop("pynvml", None)


def test_degraded_gpus_excluded_with_reasons_and_numa_pinning(fake_nvml):
    said = []
    out = pl.plan(2, [str(i) for i in range(8)], policy=pl.PlacementPolicy(xid_watch_ms=5), log=said.append)
    assert [p.gpu.index for p in out] == [0, 4]
    env0, env1 = out[0].env(), out[1].env()
    assert env0 == {"CUDA_VISIBLE_DEVICES": "GPU-aaaa-0", "BLUTRAIN_GPU_NVML_INDEX": "0",
                    "BLUTRAIN_CPU_AFFINITY": str(C0)}  # the node's cores within our own affinity
    assert env1["CUDA_VISIBLE_DEVICES"] == "GPU-eeee-4" and env1["BLUTRAIN_CPU_AFFINITY"] == str(C1)
    assert out[0].gpu.numa_node == 0 and out[1].gpu.numa_node == 1
    text = "\n".join(said)
    assert "GPU 1 (Fake H200 GPU-bbbb-1) excluded: ECC: 2 uncorrected error(s)" in text
    assert "GPU 2 " in text and "throttled: hw_slowdown" in text and "sw_power_cap" not in text
    assert "GPU 3 " in text and "XID critical error(s) [79]" in text
    assert "GPU 5 " in text and "retired pages: 61 (limit 60)" in text
    assert "GPU 6 " in text and "row remapping pending" in text
    assert "GPU 7 " in text and "NVML cannot reach it (GPU is lost)" in text
    excluded = [ln for ln in said if " excluded: " in ln]
    assert [ln.split()[2] for ln in excluded] == ["1", "2", "3", "5", "6", "7"]  # not 0 nor 4
    assert "local rank 0 -> GPU 0 (NUMA node 0" in text and "local rank 1 -> GPU 4 (NUMA node 1" in text


def test_too_few_healthy_gpus_is_an_error_naming_them(fake_nvml):
    with pytest.raises(pl.PlacementError, match=r"3 rank\(s\) need 3 healthy GPU\(s\) but only 2 of 8.*"
                                                 r"GPU 1: ECC: 2 uncorrected"):
        pl.plan(3, [str(i) for i in range(8)], log=lambda m: None)
    with pytest.raises(pl.PlacementError, match="names GPU 9 but NVML sees 8"):
        pl.plan(1, ["9"], log=lambda m: None)
    with pytest.raises(pl.PlacementError, match="'GPU-nope', which is no GPU UUID"):
        pl.plan(1, ["GPU-nope"], log=lambda m: None)
    # GPUs named by UUID (a CUDA_VISIBLE_DEVICES the scheduler wrote) map to their NVML indices
    assert [p.gpu.index for p in pl.plan(1, ["GPU-eeee-4"], log=lambda m: None)] == [4]


def test_no_nvml_means_no_placement_said_once(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    said = []
    assert pl.plan(2, ["0", "1"], log=said.append) is None
    assert len(said) == 1 and "nvidia-ml-py" in said[0] and "no NUMA pinning" in said[0]


def test_cpulist_round_trip_and_bad_lists():
    assert pl.format_cpulist([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert pl.parse_cpulist("0-2,5,7-8") == [0, 1, 2, 5, 7, 8]
    for bad in ("", "a", "3-1", "-1"):
        with pytest.raises(ValueError, match="cpu list"):
            pl.parse_cpulist(bad)
    with pytest.raises(ValueError, match="BLUTRAIN_CPU_AFFINITY|cpu list"):
        pl.apply_affinity({"BLUTRAIN_CPU_AFFINITY": "x"})


RANK_SCRIPT = """
import json, os, sys
print("PLACED " + json.dumps({"rank": os.environ["RANK"], "cvd": os.environ["CUDA_VISIBLE_DEVICES"],
      "aff": os.environ.get("BLUTRAIN_CPU_AFFINITY"), "cpus": sorted(os.sched_getaffinity(0))}))
"""


def test_blurun_places_ranks_on_healthy_gpus_and_pins_them(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC[:5]))
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = clean_env(PYTHONPATH=os.pathsep.join([str(FAKE), os.environ.get("PYTHONPATH", "")]),
                    FAKE_NVML_SPEC=str(spec), CUDA_VISIBLE_DEVICES="0,1,2,3,4")
    p = run_blurun("--nproc-per-node", "2", "--xid-watch-ms", "5", "--log-dir", str(tmp_path / "logs"),
                   str(script), env=env, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    placed = {d["rank"]: d for d in (json.loads(ln.split("PLACED ", 1)[1]) for ln in p.stdout.splitlines()
                                     if "PLACED " in ln)}
    assert placed["0"]["cvd"] == "GPU-aaaa-0" and placed["1"]["cvd"] == "GPU-eeee-4"
    assert placed["0"]["cpus"] == [C0] and placed["1"]["cpus"] == [C1]  # pinned at spawn
    assert "GPU 1 (Fake H200 GPU-bbbb-1) excluded: ECC" in p.stderr
    # too few healthy GPUs: a clear launcher error before any rank starts
    p = run_blurun("--nproc-per-node", "3", "--xid-watch-ms", "5", str(script), env=env, timeout=60)
    assert p.returncode != 0 and "only 2 of 5 are healthy" in p.stderr and "PLACED" not in p.stdout
    # --placement off: in order, as before
    p = run_blurun("--nproc-per-node", "2", "--placement", "off", "--log-dir", str(tmp_path / "logs2"),
                   str(script), env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    assert sorted(json.loads(ln.split("PLACED ", 1)[1])["cvd"] for ln in p.stdout.splitlines()
                  if "PLACED " in ln) == ["0", "1"]


_THROTTLE_NAMES = {0x1: "GpuIdle", 0x2: "ApplicationsClocksSetting", 0x4: "SwPowerCap", 0x8: "HwSlowdown",
                   0x10: "SyncBoost", 0x20: "SwThermalSlowdown", 0x40: "HwThermalSlowdown",
                   0x80: "HwPowerBrakeSlowdown", 0x100: "DisplayClockSetting"}


def _nvml_const(nv, *names):
    return next((getattr(nv, n) for n in names if hasattr(nv, n)), None)


def assert_fields_sane(nv, gpus, sysfs=True):
    """What placement reads from NVML agrees with NVML's own constants and a second, direct reading: NUMA
    node (one of this machine's nodes when ``sysfs``), ECC counts, retired pages, remapping, throttle reasons,
    XIDs, and health = no reasons."""
    for bit, name in _THROTTLE_NAMES.items():  # the bits placement interprets are NVML's
        v = _nvml_const(nv, f"nvmlClocksThrottleReason{name}", f"nvmlClocksEventReason{name}")
        if v is not None:
            assert int(v) == bit, name
    assert set(pl.DEGRADING_THROTTLE) | set(pl.BENIGN_THROTTLE) == set(_THROTTLE_NAMES)
    for const, ours in (("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", pl._NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
                        ("NVML_MEMORY_ERROR_TYPE_CORRECTED", pl._NVML_MEMORY_ERROR_TYPE_CORRECTED),
                        ("NVML_VOLATILE_ECC", pl._NVML_VOLATILE_ECC),
                        ("NVML_AFFINITY_SCOPE_NODE", pl._NVML_AFFINITY_SCOPE_NODE),
                        ("nvmlEventTypeXidCriticalError", pl._NVML_EVENT_TYPE_XID_CRITICAL)):
        if hasattr(nv, const):
            assert int(getattr(nv, const)) == ours, const
    nodes = list(Path("/sys/devices/system/node").glob("node[0-9]*")) if sysfs else []
    for g in gpus:
        if not g.uuid:  # unreachable: the only reason is that one
            assert len(g.reasons) == 1 and "NVML cannot reach it" in g.reasons[0]
            continue
        h = nv.nvmlDeviceGetHandleByIndex(g.index)
        assert pl._text(nv.nvmlDeviceGetUUID(h)) == g.uuid
        if g.numa_node is not None:
            assert g.numa_node >= 0 and (not nodes or g.numa_node < len(nodes)), g
        for v in (g.ecc_uncorrected, g.ecc_corrected, g.retired_pages):
            assert v is None or (isinstance(v, int) and v >= 0), g
        if g.ecc_uncorrected is not None:  # volatile counts only grow
            assert int(nv.nvmlDeviceGetTotalEccErrors(h, pl._NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                      pl._NVML_VOLATILE_ECC)) >= g.ecc_uncorrected
        assert isinstance(g.retired_pending, bool) and isinstance(g.remap_pending, bool)
        assert isinstance(g.throttle_reasons, int) and g.throttle_reasons >= 0
        assert bool(g.throttle_names()) == bool(g.throttle_reasons & 0x1FF)
        assert all(isinstance(x, int) and x > 0 for x in g.xids), g
        expect = [(bool(g.ecc_uncorrected), "ECC"), (g.retired_pending, "retirement pending"),
                  (g.retired_pages is not None and g.retired_pages >= 60, "retired pages:"),
                  (g.remap_failed or g.remap_pending, "row remapping"), (bool(g.xids), "XID"),
                  (bool(g.throttle_reasons & sum(pl.DEGRADING_THROTTLE)), "throttled")]
        for on, word in expect:
            assert on == any(word in r for r in g.reasons), (word, g)
        assert g.healthy == (not g.reasons) == (not any(on for on, _ in expect))


def test_fields_sane_on_the_fake(fake_nvml):
    """CPU twin of the real-NVML check below: the same assertions over the fake's 8 GPUs."""
    gpus = pl.read_gpus(fake_nvml, list(range(8)), pl.PlacementPolicy(xid_watch_ms=5))
    assert [g.healthy for g in gpus] == [True, False, False, False, True, False, False, False]
    assert_fields_sane(fake_nvml, gpus, sysfs=False)  # the fake's two nodes need not exist here


def real_nvml() -> tuple[object, int]:
    """(the installed nvidia-ml-py, initialised; its GPU count). Skips only when the module is not installed,
    no NVIDIA driver is loaded or NVML sees no GPU; any other NVML failure fails the test. Never the fake."""
    mod = sys.modules.get("pynvml")
    if mod is not None and str(FAKE) in str(getattr(mod, "__file__", "")):
        sys.modules.pop("pynvml")  # a fake left behind by a CPU test
    try:
        import pynvml
    except ImportError:
        pytest.skip("needs nvidia-ml-py (pip install 'dtms[nvml]')")
    assert str(FAKE) not in str(pynvml.__file__), pynvml.__file__
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        no_driver = tuple(getattr(pynvml, n) for n in ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded",
                                                       "NVMLError_NoPermission") if hasattr(pynvml, n))
        if isinstance(e, no_driver):
            pytest.skip(f"no NVIDIA driver ({e})")
        raise
    n = int(pynvml.nvmlDeviceGetCount())
    if n == 0:
        pytest.skip("no GPU")
    assert pl.load_nvml() is pynvml  # what blurun itself loads
    return pynvml, n


@pytest.mark.cuda
def test_real_nvml_placement_decision():
    """The real NVML's fields for every GPU (NUMA node, ECC, retired pages, throttle reasons), then placement's
    decision on them: healthy GPUs are placed in NVML order with their UUID
    and their node's cores, every degraded one is excluded in the log with its reasons."""
    nv, n = real_nvml()
    gpus = pl.read_gpus(nv, list(range(n)))
    assert [g.index for g in gpus] == list(range(n))
    for g in gpus:
        h = nv.nvmlDeviceGetHandleByIndex(g.index)
        assert g.uuid == pl._text(nv.nvmlDeviceGetUUID(h)) and g.uuid.startswith("GPU-")
        assert isinstance(g.throttle_reasons, int) and g.throttle_reasons >= 0, g
        if g.numa_node is not None:
            assert 0 <= g.numa_node < 64
        for v in (g.ecc_uncorrected, g.ecc_corrected, g.retired_pages):
            assert v is None or (isinstance(v, int) and v >= 0), g
        assert g.healthy == (not g.reasons), g
    healthy = [g for g in gpus if g.healthy]
    said: list[str] = []
    if not healthy:
        with pytest.raises(pl.PlacementError) as e:
            pl.plan(1, [str(i) for i in range(n)], nv=nv, log=said.append)
        assert all(f"GPU {g.index}: " in str(e.value) for g in gpus)
        return
    out = pl.plan(len(healthy), [str(i) for i in range(n)], nv=nv, log=said.append)
    assert [p.gpu.index for p in out] == [g.index for g in healthy]
    for p in out:
        env = p.env()
        assert env["CUDA_VISIBLE_DEVICES"] == p.gpu.uuid and env["BLUTRAIN_GPU_NVML_INDEX"] == str(p.gpu.index)
        if p.gpu.cpus:
            assert pl.parse_cpulist(env["BLUTRAIN_CPU_AFFINITY"]) == sorted(p.gpu.cpus)
            assert set(p.gpu.cpus) <= set(os.sched_getaffinity(0))
    text = "\n".join(said)
    for g in gpus:
        if not g.healthy:
            assert f"GPU {g.index} " in text and all(r in text for r in g.reasons), (g, text)


@pytest.mark.cuda
def test_real_nvml_fields_are_sane():
    """Placement against the real nvidia-ml-py: every field it reads is sane and NVML's own; UUIDs and PCI
    order agree with nvidia-smi where it is installed."""
    nv, n = real_nvml()
    gpus = pl.read_gpus(nv, list(range(n)))
    assert_fields_sane(nv, gpus)
    import shutil
    import subprocess

    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=60).stdout
        smi = {int(i): u.strip() for i, u in (ln.split(",", 1) for ln in out.strip().splitlines())}
        assert {g.index: g.uuid for g in gpus if g.uuid} == {i: u for i, u in smi.items() if i < n}


@pytest.mark.cuda
def test_real_nvml_reads_every_gpu_against_sysfs():
    nv, n = real_nvml()
    gpus = pl.read_gpus(nv, list(range(n)))
    allowed = set(os.sched_getaffinity(0))
    for g in gpus:
        assert g.uuid.startswith("GPU-") and g.name, g
        assert set(g.cpus) <= allowed
        if g.numa_node is not None:  # NVML's node-scope affinity is the node's cpulist (within ours)
            node = Path(f"/sys/devices/system/node/node{g.numa_node}/cpulist")
            if node.is_file():
                assert set(g.cpus) == set(pl.parse_cpulist(node.read_text())) & allowed
        assert g.healthy == (not g.reasons)
    said = []
    try:
        out = pl.plan(1, [str(i) for i in range(n)], nv=nv, log=said.append)
    except pl.PlacementError as e:  # every GPU degraded: the message names each reason
        assert all(f"GPU {g.index}: " in str(e) for g in gpus)
        return
    assert out[0].gpu.healthy and out[0].env()["CUDA_VISIBLE_DEVICES"] == out[0].gpu.uuid
