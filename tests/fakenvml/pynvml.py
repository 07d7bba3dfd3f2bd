"""Stands in for NVIDIA's `pynvml` on a machine with no GPU: replays the devices in $LLMGW_FAKE_NVML.

Only the calls llmgw.node.discovery makes exist; anything else fails loudly.
"""

import json
import os
from types import SimpleNamespace


class NVMLError(Exception):
    pass


_devices = []
_driver = []


def nvmlInit():
    with open(os.environ["LLMGW_FAKE_NVML"]) as f:
        data = json.load(f)
    _devices[:] = data["devices"]
    _driver[:] = [data.get("driver", "580.65.06")]


def nvmlSystemGetDriverVersion():
    return _driver[0]


def nvmlShutdown():
    pass


def nvmlDeviceGetCount():
    return len(_devices)


def nvmlDeviceGetHandleByIndex(index):
    return _devices[index]


def nvmlDeviceGetName(handle):
    return handle["name"]


def nvmlDeviceGetMemoryInfo(handle):
    return SimpleNamespace(total=handle["total"], used=handle["used"], free=handle["total"] - handle["used"])


def nvmlDeviceGetUUID(handle):
    return handle["uuid"]


def nvmlDeviceGetCudaComputeCapability(handle):
    return tuple(handle["cc"])


def nvmlDeviceGetUtilizationRates(handle):
    if handle["util"] is None:
        raise NVMLError("Not Supported")
    return SimpleNamespace(gpu=handle["util"], memory=0)
