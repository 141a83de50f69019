"""A snapshot of every GPU of this node through NVML, for the hang report: utilization, memory,
the processes on each GPU, ECC error counts and retired / remapped pages where the GPU has them.

Written to ``gpu/<host>.json``. Without NVML (no GPU, no driver) the snapshot is
``{"available": false, "reason": "..."}``: a fact about the node, not an error.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from moedoctor.layout import gpu_file_name


def gpu_snapshot() -> dict:
    """Every GPU's state as a JSON-ready dict; never raises."""
    try:
        import pynvml
    except ImportError:
        return {"available": False, "reason": "nvidia-ml-py (pynvml) is not installed"}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return {"available": False, "reason": f"no NVML: {e}"}
    try:
        snapshot = {
            "available": True,
            "time": time.time(),
            "driver": _get(lambda: _text(pynvml.nvmlSystemGetDriverVersion())),
            "gpus": [],
        }
        for index in range(pynvml.nvmlDeviceGetCount()):
            snapshot["gpus"].append(_device(pynvml, index))
        return snapshot
    except pynvml.NVMLError as e:
        return {"available": False, "reason": f"NVML failed: {e}"}
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def write_gpu_snapshot(out_dir: Path, host: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / gpu_file_name(host)
    path.write_text(json.dumps({"host": host, **gpu_snapshot()}, indent=1))
    return path


def _device(nv, index: int) -> dict:
    h = nv.nvmlDeviceGetHandleByIndex(index)
    info: dict = {
        "index": index,
        "name": _get(lambda: _text(nv.nvmlDeviceGetName(h))),
        "uuid": _get(lambda: _text(nv.nvmlDeviceGetUUID(h))),
        "pci_bus_id": _get(lambda: _text(nv.nvmlDeviceGetPciInfo(h).busId)),
    }
    util = _get(lambda: nv.nvmlDeviceGetUtilizationRates(h))
    info["utilization"] = None if util is None else {"gpu": util.gpu, "memory": util.memory}
    mem = _get(lambda: nv.nvmlDeviceGetMemoryInfo(h))
    info["memory"] = None if mem is None else {"total": mem.total, "used": mem.used, "free": mem.free}
    procs = (_get(lambda: nv.nvmlDeviceGetComputeRunningProcesses(h)) or []) + (
        _get(lambda: nv.nvmlDeviceGetGraphicsRunningProcesses(h)) or []
    )
    info["processes"] = [{"pid": p.pid, "used_memory": p.usedGpuMemory} for p in procs]
    info["temperature_c"] = _get(lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
    info["power_w"] = _get(lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000)
    info["ecc_errors"] = {
        "volatile_uncorrected": _get(
            lambda: nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
        ),
        "volatile_corrected": _get(
            lambda: nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC)
        ),
        "aggregate_uncorrected": _get(
            lambda: nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_AGGREGATE_ECC)
        ),
    }
    info["retired_pages"] = {
        "double_bit": _get(
            lambda: len(nv.nvmlDeviceGetRetiredPages(h, nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR))
        ),
        "single_bit": _get(
            lambda: len(nv.nvmlDeviceGetRetiredPages(h, nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS))
        ),
        "pending": _get(lambda: bool(nv.nvmlDeviceGetRetiredPagesPendingStatus(h))),
    }
    remap = _get(lambda: nv.nvmlDeviceGetRemappedRows(h))
    info["remapped_rows"] = (
        None
        if remap is None
        else dict(zip(("correctable", "uncorrectable", "pending", "failure"), (int(v) for v in remap)))
    )
    info["xid_note"] = "Xid events are in the kernel log (dmesg), not NVML's snapshot"
    return info


def _get(read: Callable):
    """One NVML field, or None where this GPU or driver does not have it."""
    try:
        return read()
    except Exception:
        return None


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
