"""Health- and topology-aware GPU placement for ``blurun``: which GPU each local rank gets, and which cores.

Through NVML (``nvidia-ml-py``, module ``pynvml``, imported only here and only when asked) every GPU the
launcher may hand out is read: its NUMA node and the cores of that node, volatile ECC errors, retired and
pending-retirement pages, remapped-row failures, XID critical errors seen while placement watches, and the
current clock-throttle reasons. A GPU is *degraded*, and excluded with a logged reason, when:

- NVML cannot reach it (GPU lost, or any query of its handle fails);
- it has uncorrected ECC errors since the driver loaded (volatile count > 0);
- pages are pending retirement, or a row remapping failed or is pending (both need a GPU reset);
- it has ``max_retired_pages`` (60, NVIDIA's replacement guideline) or more retired pages;
- an XID critical error arrives within the watch window (``xid_watch_ms``);
- it is throttled by hardware or heat: HW slowdown, HW thermal, HW power brake or SW thermal slowdown (idle,
  application-clock, power-cap, sync-boost and display-clock reasons are normal and ignored).

Healthy GPUs are handed out in order to local ranks 0..n-1; rank r gets ``CUDA_VISIBLE_DEVICES`` of its GPU
(the UUID where NVML knows it, so CUDA's device order cannot mismatch) and ``BLUTRAIN_CPU_AFFINITY``: the
cores of that GPU's NUMA node (NVML's node-scope CPU affinity) within the launcher's own affinity, which
``dtms.runscript`` applies with ``os.sched_setaffinity`` before the rank's script imports anything.
Without NVML there is no placement (GPUs in order, no pinning), said once.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: throttle-reason bits (nvmlClocksThrottleReason*) that mark a GPU as degraded, by name
DEGRADING_THROTTLE = {0x8: "hw_slowdown", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
                      0x80: "hw_power_brake_slowdown"}
#: throttle-reason bits that are normal operation (reported, never a reason to exclude)
BENIGN_THROTTLE = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x10: "sync_boost",
                   0x100: "display_clock_setting"}
AFFINITY_ENV = "BLUTRAIN_CPU_AFFINITY"
NVML_INDEX_ENV = "BLUTRAIN_GPU_NVML_INDEX"
_NVML_MEMORY_ERROR_TYPE_UNCORRECTED, _NVML_MEMORY_ERROR_TYPE_CORRECTED, _NVML_VOLATILE_ECC = 1, 0, 0
_NVML_AFFINITY_SCOPE_NODE = 0
_NVML_EVENT_TYPE_XID_CRITICAL = 0x8


class PlacementError(RuntimeError):
    """Too few healthy GPUs for the ranks asked for, or a GPU id that NVML does not know."""


@dataclass
class PlacementPolicy:
    """Thresholds of the health check."""

    max_retired_pages: int = 60
    xid_watch_ms: int = 50
    exclude_throttled: bool = True


@dataclass
class GpuHealth:
    """What NVML says about one GPU, and why (if at all) it is degraded."""

    index: int
    visible_id: str  # the id to put in CUDA_VISIBLE_DEVICES (UUID when known, else the index)
    name: str = ""
    uuid: str = ""
    numa_node: int | None = None
    cpus: list[int] = field(default_factory=list)
    ecc_uncorrected: int | None = None
    ecc_corrected: int | None = None
    retired_pages: int | None = None
    retired_pending: bool = False
    remap_failed: bool = False
    remap_pending: bool = False
    xids: list[int] = field(default_factory=list)
    throttle_reasons: int = 0
    reasons: list[str] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return not self.reasons

    def throttle_names(self) -> list[str]:
        table = {**DEGRADING_THROTTLE, **BENIGN_THROTTLE}
        return [n for b, n in sorted(table.items()) if self.throttle_reasons & b]


@dataclass
class RankPlacement:
    """Local rank -> GPU and cores."""

    local_rank: int
    gpu: GpuHealth

    def env(self) -> dict[str, str]:
        e = {"CUDA_VISIBLE_DEVICES": self.gpu.visible_id, NVML_INDEX_ENV: str(self.gpu.index)}
        if self.gpu.cpus:
            e[AFFINITY_ENV] = format_cpulist(self.gpu.cpus)
        return e


def load_nvml() -> Any | None:
    """``pynvml`` initialised, or None when nvidia-ml-py is not installed or NVML cannot start."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    return pynvml


def format_cpulist(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the kernel's cpulist format)."""
    out, xs = [], sorted(set(cpus))
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def parse_cpulist(text: str) -> list[int]:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]``; a clear ValueError naming the text otherwise."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                a, b = (int(x) for x in part.split("-", 1))
                if b < a:
                    raise ValueError
                cpus += range(a, b + 1)
            else:
                cpus.append(int(part))
        except ValueError:
            raise ValueError(f"cpu list {text!r}: {part!r} is not a core number or a range a-b") from None
    if not cpus or min(cpus) < 0:
        raise ValueError(f"cpu list {text!r} names no cores")
    return sorted(set(cpus))


def _mask_to_cpus(words: Any, bits: int = 64) -> list[int]:
    cpus = []
    for w, word in enumerate(words):
        word = int(word)
        for b in range(bits):
            if word >> b & 1:
                cpus.append(w * bits + b)
    return cpus


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _numa_node(nv: Any, h: Any) -> int | None:
    fn = getattr(nv, "nvmlDeviceGetNumaNodeId", None)
    if fn is not None:
        try:
            n = int(fn(h))
            return n if n >= 0 else None
        except Exception:
            pass
    try:  # older NVML: the PCI device's node from sysfs
        bus = _text(nv.nvmlDeviceGetPciInfo(h).busId).lower()
        bus = bus[-12:] if len(bus) > 12 else bus  # 0000:3b:00.0 (NVML pads the domain to 8 digits)
        with open(f"/sys/bus/pci/devices/{bus}/numa_node") as f:
            n = int(f.read().strip())
        return n if n >= 0 else None
    except Exception:
        return None


def _cpus(nv: Any, h: Any) -> list[int]:
    n_cpus = max(os.cpu_count() or 64, 1 + max(os.sched_getaffinity(0), default=0)
                 if hasattr(os, "sched_getaffinity") else 0)
    size = max((n_cpus + 63) // 64, 2)
    fn = getattr(nv, "nvmlDeviceGetCpuAffinityWithinScope", None)
    try:
        if fn is not None:
            return _mask_to_cpus(fn(h, size, _NVML_AFFINITY_SCOPE_NODE))
        return _mask_to_cpus(nv.nvmlDeviceGetCpuAffinity(h, size))
    except Exception:
        return []


def _read_one(nv: Any, index: int, policy: PlacementPolicy) -> tuple[GpuHealth, Any]:
    g = GpuHealth(index=index, visible_id=str(index))
    try:
        h = nv.nvmlDeviceGetHandleByIndex(index)
        g.uuid = _text(nv.nvmlDeviceGetUUID(h))
        g.name = _text(nv.nvmlDeviceGetName(h))
    except Exception as e:
        g.reasons.append(f"NVML cannot reach it ({e})")
        return g, None
    if g.uuid:
        g.visible_id = g.uuid
    g.numa_node = _numa_node(nv, h)
    g.cpus = _cpus(nv, h)
    for attr, kind in (("ecc_uncorrected", _NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
                       ("ecc_corrected", _NVML_MEMORY_ERROR_TYPE_CORRECTED)):
        try:
            setattr(g, attr, int(nv.nvmlDeviceGetTotalEccErrors(h, kind, _NVML_VOLATILE_ECC)))
        except Exception:
            pass  # ECC off or not supported: no count, not a fault
    if g.ecc_uncorrected:
        g.reasons.append(f"ECC: {g.ecc_uncorrected} uncorrected error(s) since the driver loaded")
    try:
        g.retired_pending = int(nv.nvmlDeviceGetRetiredPagesPendingStatus(h)) == 1
    except Exception:
        pass
    try:
        pages = 0
        for cause in (0, 1):  # multiple single-bit, double-bit ECC
            pages += len(nv.nvmlDeviceGetRetiredPages(h, cause))
        g.retired_pages = pages
    except Exception:
        pass
    if g.retired_pending:
        g.reasons.append("retired pages: retirement pending (needs a GPU reset)")
    if g.retired_pages is not None and g.retired_pages >= policy.max_retired_pages:
        g.reasons.append(f"retired pages: {g.retired_pages} (limit {policy.max_retired_pages})")
    try:
        _corr, _unc, pending, failure = nv.nvmlDeviceGetRemappedRows(h)
        g.remap_pending, g.remap_failed = bool(pending), bool(failure)
    except Exception:
        pass
    if g.remap_failed:
        g.reasons.append("row remapping failed")
    elif g.remap_pending:
        g.reasons.append("row remapping pending (needs a GPU reset)")
    try:
        g.throttle_reasons = int(nv.nvmlDeviceGetCurrentClocksThrottleReasons(h))
    except Exception:
        g.throttle_reasons = 0
    bad = [n for b, n in sorted(DEGRADING_THROTTLE.items()) if g.throttle_reasons & b]
    if bad and policy.exclude_throttled:
        g.reasons.append(f"throttled: {', '.join(bad)}")
    return g, h


def _watch_xids(nv: Any, handles: dict[int, Any], gpus: dict[int, GpuHealth], wait_ms: int) -> None:
    """Register for XID critical errors on every reachable GPU and collect those arriving within wait_ms."""
    if wait_ms <= 0 or not handles or not hasattr(nv, "nvmlEventSetCreate"):
        return
    try:
        es = nv.nvmlEventSetCreate()
    except Exception:
        return
    try:
        by_handle = []
        for i, h in handles.items():
            try:
                nv.nvmlDeviceRegisterEvents(h, _NVML_EVENT_TYPE_XID_CRITICAL, es)
                by_handle.append((h, i))
            except Exception:
                continue  # this GPU does not deliver XID events
        if not by_handle:
            return
        waited = 0
        while waited <= wait_ms:
            try:
                ev = nv.nvmlEventSetWait_v2(es, max(wait_ms - waited, 1))
            except Exception:
                break  # timeout: no (more) events
            waited += 1
            idx = next((i for h, i in by_handle if h == ev.device), None)
            if idx is None:
                try:
                    idx = int(nv.nvmlDeviceGetIndex(ev.device))
                except Exception:
                    continue
            if idx in gpus:
                gpus[idx].xids.append(int(ev.eventData))
    finally:
        try:
            nv.nvmlEventSetFree(es)
        except Exception:
            pass
    for g in gpus.values():
        if g.xids:
            g.reasons.append(f"XID critical error(s) {sorted(set(g.xids))}")


def read_gpus(nv: Any, indices: list[int], policy: PlacementPolicy | None = None) -> list[GpuHealth]:
    """Health and topology of the GPUs with these NVML indices."""
    policy = policy or PlacementPolicy()
    gpus, handles = {}, {}
    for i in indices:
        g, h = _read_one(nv, i, policy)
        gpus[i] = g
        if h is not None:
            handles[i] = h
    _watch_xids(nv, handles, gpus, policy.xid_watch_ms)
    allowed = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    for g in gpus.values():
        if allowed is not None and g.cpus:
            g.cpus = sorted(set(g.cpus) & allowed)
    return [gpus[i] for i in indices]


def _nvml_indices(nv: Any, visible: list[str]) -> list[int]:
    """NVML indices of the launcher's GPU ids (indices or GPU-UUIDs)."""
    n = int(nv.nvmlDeviceGetCount())
    uuids: dict[str, int] = {}
    out = []
    for v in visible:
        if v.isdigit():
            if int(v) >= n:
                raise PlacementError(f"CUDA_VISIBLE_DEVICES names GPU {v} but NVML sees {n} GPU(s)")
            out.append(int(v))
            continue
        if not uuids:
            for i in range(n):
                try:
                    uuids[_text(nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(i)))] = i
                except Exception:
                    continue
        if v not in uuids:
            raise PlacementError(f"CUDA_VISIBLE_DEVICES names {v!r}, which is no GPU UUID that NVML knows")
        out.append(uuids[v])
    return out


def plan(nproc: int, visible: list[str], nv: Any = None, policy: PlacementPolicy | None = None,
         log: Callable[[str], None] | None = None) -> list[RankPlacement] | None:
    """The placement of ``nproc`` local ranks on the launcher's GPUs ``visible``; None without NVML (said
    once through ``log``), or when the ids are MIG instances (placement is per physical GPU)."""
    say = log or (lambda m: print(m, file=sys.stderr, flush=True))
    if nv is None:
        nv = load_nvml()
        if nv is None:
            say("blurun: placement off: nvidia-ml-py (NVML) is not importable or NVML did not start; GPUs are "
                "handed out in order with no health check and no NUMA pinning (pip install nvidia-ml-py)")
            return None
    if any(v.startswith("MIG-") for v in visible):
        say("blurun: placement off: CUDA_VISIBLE_DEVICES names MIG instances; handed out in order")
        return None
    gpus = read_gpus(nv, _nvml_indices(nv, visible), policy)
    for g in gpus:
        if not g.healthy:
            say(f"blurun: GPU {g.index} ({g.name or '?'} {g.uuid or ''}) excluded: {'; '.join(g.reasons)}")
    healthy = [g for g in gpus if g.healthy]
    if len(healthy) < nproc:
        raise PlacementError(
            f"{nproc} rank(s) need {nproc} healthy GPU(s) but only {len(healthy)} of {len(gpus)} are healthy "
            f"({', '.join(f'GPU {g.index}: ' + '; '.join(g.reasons) for g in gpus if not g.healthy)}); "
            "fix or drain those GPUs, lower --nproc-per-node, or pass --placement off to use them anyway")
    out = [RankPlacement(r, g) for r, g in enumerate(healthy[:nproc])]
    for p in out:
        g = p.gpu
        where = (f"NUMA node {g.numa_node}" if g.numa_node is not None else "NUMA node ?") + \
            (f", cores {format_cpulist(g.cpus)}" if g.cpus else ", no core pinning (affinity unknown)")
        say(f"blurun: local rank {p.local_rank} -> GPU {g.index} ({where})")
    return out


def apply_affinity(environ: dict[str, str] | None = None) -> list[int] | None:
    """Pin this process to ``$BLUTRAIN_CPU_AFFINITY`` (what blurun computed for the rank); the cores set, or
    None when the variable is unset. Called by ``dtms.runscript`` before the rank's script runs."""
    env = os.environ if environ is None else environ
    text = env.get(AFFINITY_ENV, "").strip()
    if not text:
        return None
    cpus = parse_cpulist(text)
    if not hasattr(os, "sched_setaffinity"):
        return None
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:
        raise OSError(f"{AFFINITY_ENV}={text!r}: cannot pin this rank to those cores: {e.strerror or e}") from None
    return cpus
