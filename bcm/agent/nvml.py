"""The narrow NVML interface the agent's collector uses, and its one real implementation.

This is the only module that imports ``pynvml`` (PyPI ``nvidia-ml-py``), and it does so lazily inside
:class:`RealNvml`, so the rest of the agent imports on a machine without it.

Contract of :class:`NvmlBackend`: GPUs are addressed by NVML index; getters return raw NVML values
(milliwatts, bytes, bitmasks, enum ints) and raise :class:`NvmlError` carrying NVML's numeric return
code. The collector converts units and decides which codes are tolerable (``NOT_SUPPORTED`` always is).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Literal, Protocol

# NVML return codes (nvml.h ``nvmlReturn_t``); the same numbers pynvml puts in ``NVMLError.value``.
SUCCESS = 0
ERROR_UNINITIALIZED = 1
ERROR_INVALID_ARGUMENT = 2
ERROR_NOT_SUPPORTED = 3
ERROR_NO_PERMISSION = 4
ERROR_NOT_FOUND = 6
ERROR_DRIVER_NOT_LOADED = 9
ERROR_TIMEOUT = 10
ERROR_LIBRARY_NOT_FOUND = 12
ERROR_FUNCTION_NOT_FOUND = 13
ERROR_GPU_IS_LOST = 15
ERROR_NO_DATA = 21
ERROR_UNKNOWN = 999

ERROR_NAMES: dict[int, str] = {
    ERROR_UNINITIALIZED: "UNINITIALIZED",
    ERROR_INVALID_ARGUMENT: "INVALID_ARGUMENT",
    ERROR_NOT_SUPPORTED: "NOT_SUPPORTED",
    ERROR_NO_PERMISSION: "NO_PERMISSION",
    ERROR_NOT_FOUND: "NOT_FOUND",
    ERROR_DRIVER_NOT_LOADED: "DRIVER_NOT_LOADED",
    ERROR_TIMEOUT: "TIMEOUT",
    ERROR_LIBRARY_NOT_FOUND: "LIBRARY_NOT_FOUND",
    ERROR_FUNCTION_NOT_FOUND: "FUNCTION_NOT_FOUND",
    ERROR_GPU_IS_LOST: "GPU_IS_LOST",
    ERROR_NO_DATA: "NO_DATA",
    ERROR_UNKNOWN: "UNKNOWN",
}
ERROR_CODES: dict[str, int] = {name: code for code, name in ERROR_NAMES.items()}

# Codes that mean "this device or driver does not offer the metric", never "the GPU is unwell".
UNAVAILABLE_CODES = frozenset({ERROR_NOT_SUPPORTED, ERROR_FUNCTION_NOT_FOUND, ERROR_NOT_FOUND})

# nvmlGpuRecoveryAction_t (nvml.h, R550+): the value of field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION and
# the hex code Xid 154 prints ("recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)").
RECOVERY_ACTIONS: dict[int, str] = {
    0: "none",
    1: "gpu_reset",
    2: "node_reboot",
    3: "drain_p2p",
    4: "drain_and_reset",
    5: "recover_imex_domain",
    6: "bus_reset",
    7: "system_reboot",
}

# nvmlNvLinkErrorCounter_t, in order: DL replay, DL recovery, DL CRC flit, DL CRC data, DL ECC data.
NVLINK_COUNTERS: tuple[str, ...] = ("replay", "recovery", "crc_flit", "crc_data", "ecc_data")
# NVML_NVLINK_MAX_LINKS was 18 before R550 and is 36 since; the collector stops at the first link the
# driver says does not exist.
NVLINK_MAX_LINKS = 36

# nvmlClocksEventReason* bits (formerly nvmlClocksThrottleReason*), name per bit.
CLOCK_EVENT_REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}

ThresholdKind = Literal["slowdown", "shutdown"]


class NvmlError(Exception):
    """An NVML call failed; ``code`` is NVML's numeric return code."""

    def __init__(self, code: int, message: str | None = None) -> None:
        self.code = code
        self.name = ERROR_NAMES.get(code, f"ERROR_{code}")
        super().__init__(message or self.name)

    @property
    def unavailable(self) -> bool:
        """True when the metric is simply not offered by this GPU or driver (tolerated silently)."""
        return self.code in UNAVAILABLE_CODES


@dataclass(frozen=True)
class XidRaw:
    """One critical-error event as NVML delivers it: the GPU index and the Xid number."""

    gpu_index: int | None
    xid: int


class NvmlBackend(Protocol):
    """The NVML calls the collector needs; see the module docstring for the contract."""

    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def driver_version(self) -> str: ...
    def cuda_driver_version(self) -> int: ...
    def device_count(self) -> int: ...
    def uuid(self, index: int) -> str: ...
    def name(self, index: int) -> str: ...
    def serial(self, index: int) -> str: ...
    def pci_bus_id(self, index: int) -> str: ...
    def vbios_version(self, index: int) -> str: ...
    def temperature(self, index: int) -> int: ...
    def temperature_threshold(self, index: int, kind: ThresholdKind) -> int: ...
    def power_usage_mw(self, index: int) -> int: ...
    def power_limit_mw(self, index: int) -> int: ...
    def utilization(self, index: int) -> tuple[int, int]: ...
    def memory_info(self, index: int) -> tuple[int, int]: ...
    def ecc_mode(self, index: int) -> tuple[int, int]: ...
    def total_ecc_errors(self, index: int, *, uncorrected: bool, aggregate: bool) -> int: ...
    def remapped_rows(self, index: int) -> tuple[int, int, int, int]: ...
    def retired_pages(self, index: int, *, double_bit: bool) -> int: ...
    def retired_pages_pending(self, index: int) -> bool: ...
    def clock_event_reasons(self, index: int) -> int: ...
    def nvlink_active(self, index: int, link: int) -> bool: ...
    def nvlink_error_counter(self, index: int, link: int, counter: int) -> int: ...
    def pcie_replay_counter(self, index: int) -> int: ...
    def pcie_link_generation(self, index: int, *, maximum: bool) -> int: ...
    def pcie_link_width(self, index: int, *, maximum: bool) -> int: ...
    def recovery_action(self, index: int) -> int: ...
    def register_xid_events(self) -> None: ...
    def wait_xid(self, timeout_ms: int) -> XidRaw | None: ...


def _text(value: Any) -> str:
    # Older pynvml returned bytes from string getters, newer ones return str.
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class RealNvml:
    """:class:`NvmlBackend` over the machine's libnvidia-ml through pynvml."""

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError as exc:  # the bundle carries pynvml; a bare checkout may not
            raise NvmlError(ERROR_LIBRARY_NOT_FOUND, f"pynvml is not importable: {exc}") from exc
        self._nv: Any = pynvml
        self._handles: dict[int, Any] = {}
        self._event_set: Any = None
        self._lock = threading.Lock()

    def _call(self, fn: str, *args: Any) -> Any:
        func = getattr(self._nv, fn, None)
        if func is None:  # this pynvml predates the call
            raise NvmlError(ERROR_FUNCTION_NOT_FOUND, f"pynvml has no {fn}")
        try:
            return func(*args)
        except self._nv.NVMLError as exc:
            raise NvmlError(int(getattr(exc, "value", ERROR_UNKNOWN)), f"{fn}: {exc}") from exc

    def _handle(self, index: int) -> Any:
        with self._lock:
            handle = self._handles.get(index)
            if handle is None:
                handle = self._call("nvmlDeviceGetHandleByIndex", index)
                self._handles[index] = handle
            return handle

    def init(self) -> None:
        self._call("nvmlInit")

    def shutdown(self) -> None:
        if self._event_set is not None:
            with contextlib.suppress(NvmlError):
                self._call("nvmlEventSetFree", self._event_set)
            self._event_set = None
        self._handles.clear()
        self._call("nvmlShutdown")

    def driver_version(self) -> str:
        return _text(self._call("nvmlSystemGetDriverVersion"))

    def cuda_driver_version(self) -> int:
        return int(self._call("nvmlSystemGetCudaDriverVersion"))

    def device_count(self) -> int:
        return int(self._call("nvmlDeviceGetCount"))

    def uuid(self, index: int) -> str:
        return _text(self._call("nvmlDeviceGetUUID", self._handle(index)))

    def name(self, index: int) -> str:
        return _text(self._call("nvmlDeviceGetName", self._handle(index)))

    def serial(self, index: int) -> str:
        return _text(self._call("nvmlDeviceGetSerial", self._handle(index)))

    def pci_bus_id(self, index: int) -> str:
        return _text(self._call("nvmlDeviceGetPciInfo", self._handle(index)).busId)

    def vbios_version(self, index: int) -> str:
        return _text(self._call("nvmlDeviceGetVbiosVersion", self._handle(index)))

    def temperature(self, index: int) -> int:
        return int(self._call("nvmlDeviceGetTemperature", self._handle(index), self._nv.NVML_TEMPERATURE_GPU))

    def temperature_threshold(self, index: int, kind: ThresholdKind) -> int:
        which = {
            "slowdown": self._nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN,
            "shutdown": self._nv.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN,
        }[kind]
        return int(self._call("nvmlDeviceGetTemperatureThreshold", self._handle(index), which))

    def power_usage_mw(self, index: int) -> int:
        return int(self._call("nvmlDeviceGetPowerUsage", self._handle(index)))

    def power_limit_mw(self, index: int) -> int:
        return int(self._call("nvmlDeviceGetEnforcedPowerLimit", self._handle(index)))

    def utilization(self, index: int) -> tuple[int, int]:
        util = self._call("nvmlDeviceGetUtilizationRates", self._handle(index))
        return int(util.gpu), int(util.memory)

    def memory_info(self, index: int) -> tuple[int, int]:
        mem = self._call("nvmlDeviceGetMemoryInfo", self._handle(index))
        return int(mem.total), int(mem.used)

    def ecc_mode(self, index: int) -> tuple[int, int]:
        current, pending = self._call("nvmlDeviceGetEccMode", self._handle(index))
        return int(current), int(pending)

    def total_ecc_errors(self, index: int, *, uncorrected: bool, aggregate: bool) -> int:
        nv = self._nv
        kind = nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED if uncorrected else nv.NVML_MEMORY_ERROR_TYPE_CORRECTED
        counter = nv.NVML_AGGREGATE_ECC if aggregate else nv.NVML_VOLATILE_ECC
        return int(self._call("nvmlDeviceGetTotalEccErrors", self._handle(index), kind, counter))

    def remapped_rows(self, index: int) -> tuple[int, int, int, int]:
        corr, unc, pending, failure = self._call("nvmlDeviceGetRemappedRows", self._handle(index))
        return int(corr), int(unc), int(pending), int(failure)

    def retired_pages(self, index: int, *, double_bit: bool) -> int:
        nv = self._nv
        cause = (
            nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
            if double_bit
            else nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
        )
        return len(self._call("nvmlDeviceGetRetiredPages", self._handle(index), cause))

    def retired_pages_pending(self, index: int) -> bool:
        return bool(self._call("nvmlDeviceGetRetiredPagesPendingStatus", self._handle(index)))

    def clock_event_reasons(self, index: int) -> int:
        handle = self._handle(index)
        try:
            return int(self._call("nvmlDeviceGetCurrentClocksEventReasons", handle))
        except NvmlError as exc:
            if exc.code != ERROR_FUNCTION_NOT_FOUND:
                raise
        # Drivers before R535 only have the old name for the same bitmask.
        return int(self._call("nvmlDeviceGetCurrentClocksThrottleReasons", handle))

    def nvlink_active(self, index: int, link: int) -> bool:
        return bool(self._call("nvmlDeviceGetNvLinkState", self._handle(index), link))

    def nvlink_error_counter(self, index: int, link: int, counter: int) -> int:
        return int(self._call("nvmlDeviceGetNvLinkErrorCounter", self._handle(index), link, counter))

    def pcie_replay_counter(self, index: int) -> int:
        return int(self._call("nvmlDeviceGetPcieReplayCounter", self._handle(index)))

    def pcie_link_generation(self, index: int, *, maximum: bool) -> int:
        fn = "nvmlDeviceGetMaxPcieLinkGeneration" if maximum else "nvmlDeviceGetCurrPcieLinkGeneration"
        return int(self._call(fn, self._handle(index)))

    def pcie_link_width(self, index: int, *, maximum: bool) -> int:
        fn = "nvmlDeviceGetMaxPcieLinkWidth" if maximum else "nvmlDeviceGetCurrPcieLinkWidth"
        return int(self._call(fn, self._handle(index)))

    def recovery_action(self, index: int) -> int:
        field = getattr(self._nv, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if field is None:
            raise NvmlError(ERROR_FUNCTION_NOT_FOUND, "pynvml lacks NVML_FI_DEV_GET_GPU_RECOVERY_ACTION")
        (value,) = self._call("nvmlDeviceGetFieldValues", self._handle(index), [field])
        if int(value.nvmlReturn) != SUCCESS:
            raise NvmlError(int(value.nvmlReturn), "field GPU_RECOVERY_ACTION")
        return int(value.value.uiVal)

    def register_xid_events(self) -> None:
        """Register every GPU for Xid events; NOT_SUPPORTED if any GPU cannot deliver them."""
        event_set = self._call("nvmlEventSetCreate")
        try:
            for index in range(self.device_count()):
                self._call(
                    "nvmlDeviceRegisterEvents",
                    self._handle(index),
                    self._nv.nvmlEventTypeXidCriticalError,
                    event_set,
                )
        except NvmlError:
            with contextlib.suppress(NvmlError):
                self._call("nvmlEventSetFree", event_set)
            raise
        self._event_set = event_set

    def wait_xid(self, timeout_ms: int) -> XidRaw | None:
        if self._event_set is None:
            raise NvmlError(ERROR_UNINITIALIZED, "register_xid_events was not called")
        try:
            data = self._call("nvmlEventSetWait_v2", self._event_set, max(0, int(timeout_ms)))
        except NvmlError as exc:
            if exc.code == ERROR_TIMEOUT:
                return None
            raise
        if not int(data.eventType) & int(self._nv.nvmlEventTypeXidCriticalError):
            return None
        try:
            gpu_index: int | None = int(self._call("nvmlDeviceGetIndex", data.device))
        except NvmlError:
            gpu_index = None
        return XidRaw(gpu_index=gpu_index, xid=int(data.eventData))
