"""A fake ``pynvml`` (nvidia-ml-py) for placement tests on machines without GPUs.

The GPUs come from the JSON file named by $FAKE_NVML_SPEC (or ``configure(spec)``): a list of dicts with
keys uuid, name, numa, cpus (core list), ecc_uncorrected, ecc_corrected, retired_pages, retired_pending,
remap (pending, failure), throttle (bitmask), xids (event data of XID critical errors queued), lost.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

NVML_TEMPERATURE_GPU = 0
NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC = 0, 1, 0
NVML_AFFINITY_SCOPE_NODE = 0
NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS, NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 0, 1
nvmlEventTypeXidCriticalError = 0x8
nvmlClocksThrottleReasonGpuIdle, nvmlClocksThrottleReasonApplicationsClocksSetting = 0x1, 0x2
nvmlClocksThrottleReasonSwPowerCap, nvmlClocksThrottleReasonHwSlowdown = 0x4, 0x8
nvmlClocksThrottleReasonSyncBoost, nvmlClocksThrottleReasonSwThermalSlowdown = 0x10, 0x20
nvmlClocksThrottleReasonHwThermalSlowdown, nvmlClocksThrottleReasonHwPowerBrakeSlowdown = 0x40, 0x80
nvmlClocksThrottleReasonDisplayClockSetting = 0x100
_GPUS: list[dict] = []
_QUEUE: list = []
INITS = []


class NVMLError(Exception):
    pass


def configure(spec: list[dict]) -> None:
    _GPUS[:] = spec
    _QUEUE.clear()


def nvmlInit() -> None:
    INITS.append(1)
    if not _GPUS and os.environ.get("FAKE_NVML_SPEC"):
        with open(os.environ["FAKE_NVML_SPEC"]) as f:
            configure(json.load(f))


def nvmlDeviceGetCount() -> int:
    return len(_GPUS)


def nvmlDeviceGetHandleByIndex(i: int):
    if i >= len(_GPUS):
        raise NVMLError("Invalid Argument")
    if _GPUS[i].get("lost"):
        raise NVMLError("GPU is lost")
    return ("handle", i)


def _g(h) -> dict:
    return _GPUS[h[1]]


def nvmlDeviceGetUUID(h) -> str:
    return _g(h)["uuid"]


def nvmlDeviceGetName(h) -> str:
    return _g(h).get("name", "Fake H200")


def nvmlDeviceGetIndex(h) -> int:
    return h[1]


def nvmlDeviceGetNumaNodeId(h) -> int:
    return _g(h).get("numa", -1)


def nvmlDeviceGetCpuAffinityWithinScope(h, size: int, scope: int):
    words = [0] * size
    for c in _g(h).get("cpus", []):
        if c // 64 < size:  # NVML fills only the words it is given
            words[c // 64] |= 1 << (c % 64)
    return words


def nvmlDeviceGetTotalEccErrors(h, kind: int, counter: int) -> int:
    key = "ecc_uncorrected" if kind == NVML_MEMORY_ERROR_TYPE_UNCORRECTED else "ecc_corrected"
    return _g(h).get(key, 0)


def nvmlDeviceGetRetiredPagesPendingStatus(h) -> int:
    return 1 if _g(h).get("retired_pending") else 0


def nvmlDeviceGetRetiredPages(h, cause: int) -> list:
    n = _g(h).get("retired_pages", 0)
    return list(range(n)) if cause == 1 else []


def nvmlDeviceGetRemappedRows(h):
    pending, failure = _g(h).get("remap", (0, 0))
    return 0, 0, pending, failure


def nvmlDeviceGetCurrentClocksThrottleReasons(h) -> int:
    return _g(h).get("throttle", 0)


def nvmlEventSetCreate():
    return "eventset"


def nvmlDeviceRegisterEvents(h, types: int, es) -> None:
    for x in _g(h).get("xids", []):
        _QUEUE.append(SimpleNamespace(device=h, eventData=x, eventType=types))


def nvmlEventSetWait_v2(es, timeout_ms: int):
    if not _QUEUE:
        raise NVMLError("Timeout")
    return _QUEUE.pop(0)


def nvmlEventSetFree(es) -> None:
    pass
