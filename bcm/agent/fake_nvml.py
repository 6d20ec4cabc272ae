"""The one fake NVML: an :class:`~bcm.agent.nvml.NvmlBackend` that answers from a recorded JSON fixture.

Fixture layout (see ``bcm/lab/recorded_nvml/README.md`` for where the recorded values come from)::

    {"driver_version": "565.57.01", "cuda_driver_version": 12070,
     "init_error": "LIBRARY_NOT_FOUND",            # optional: init() raises this
     "event_registration": "NOT_SUPPORTED",        # optional: register_xid_events() raises this
     "event_wait": "GPU_IS_LOST",                  # optional: wait_xid() raises this
     "gpus": [{"uuid": "GPU-…", "name": "NVIDIA H100 80GB HBM3", "serial": "…", "pci_bus_id": "00000000:18:00.0",
               "vbios_version": "…", "temperature": 30, "temperature_threshold": {"slowdown": 89, "shutdown": 95},
               "power_usage_mw": 100890, "power_limit_mw": 700000, "utilization": [0, 0],
               "memory_info": [total_bytes, used_bytes], "ecc_mode": [1, 1],
               "ecc_errors": {"volatile": {"corrected": 0, "uncorrected": 0}, "aggregate": {…}},
               "remapped_rows": [correctable, uncorrectable, pending, failure],
               "retired_pages": {"single_bit": 0, "double_bit": 0, "pending": false},
               "clock_event_reasons": 1, "nvlinks": [{"active": true, "errors": [0, 0, 0, 0, 0]}, …],
               "pcie": {"replay_counter": 7, "gen_current": 5, "gen_max": 5, "width_current": 16, "width_max": 16},
               "recovery_action": 0}],
     "xid_events": [{"gpu_index": 0, "xid": 79}]}

Any value (or whole section) may instead be an NVML error name such as ``"NOT_SUPPORTED"`` or
``"GPU_IS_LOST"``; the getter then raises that error, as the real library would. A missing key is a
fixture bug and raises ``KeyError``.
"""

from __future__ import annotations

import copy
import json
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bcm.agent.nvml import (
    ERROR_CODES,
    ERROR_INVALID_ARGUMENT,
    ERROR_UNINITIALIZED,
    NvmlError,
    ThresholdKind,
    XidRaw,
)

# Where a lab node keeps its simulated GPUs' values (written by `bcm lab up --gpus N`); real nodes have none.
SIMULATED_NVML_PATH = "/var/lib/bcm-fakegpu/nvml.json"


def _check(value: Any) -> Any:
    if isinstance(value, str) and value in ERROR_CODES:
        raise NvmlError(ERROR_CODES[value])
    return value


class FakeNvml:
    """Answers every :class:`~bcm.agent.nvml.NvmlBackend` call from a fixture dict."""

    def __init__(self, fixture: dict[str, Any]) -> None:
        self.fixture = copy.deepcopy(fixture)
        self.blocking = False
        self.initialized = False
        self.registered = False
        self._xids: deque[XidRaw] = deque(
            XidRaw(gpu_index=e.get("gpu_index"), xid=int(e["xid"]))
            for e in self.fixture.get("xid_events", [])
        )

    @classmethod
    def from_file(cls, path: str | Path, *, blocking: bool = False) -> FakeNvml:
        """The fixture in ``path``; ``blocking``: ``wait_xid`` waits out its timeout when nothing is queued,
        as the real NVML blocks (what a running agent needs, or its loop spins)."""
        fake = cls(json.loads(Path(path).read_text()))
        fake.blocking = blocking
        return fake

    def push_xid(self, xid: int, gpu_index: int | None) -> None:
        """Queue one Xid event, as the driver would on a fault."""
        self._xids.append(XidRaw(gpu_index=gpu_index, xid=xid))

    def _gpu(self, index: int) -> dict[str, Any]:
        if not self.initialized:
            raise NvmlError(ERROR_UNINITIALIZED)
        gpus = _check(self.fixture["gpus"])
        if not 0 <= index < len(gpus):
            raise NvmlError(ERROR_INVALID_ARGUMENT, f"no GPU {index}")
        return dict(_check(gpus[index]))

    def _value(self, index: int, *path: str | int) -> Any:
        node: Any = self._gpu(index)
        for key in path:
            node = _check(node)[key]
        return _check(node)

    def init(self) -> None:
        _check(self.fixture.get("init_error"))
        self.initialized = True

    def shutdown(self) -> None:
        self.initialized = False

    def driver_version(self) -> str:
        return str(_check(self.fixture["driver_version"]))

    def cuda_driver_version(self) -> int:
        return int(_check(self.fixture["cuda_driver_version"]))

    def device_count(self) -> int:
        if not self.initialized:
            raise NvmlError(ERROR_UNINITIALIZED)
        return len(_check(self.fixture["gpus"]))

    def uuid(self, index: int) -> str:
        return str(self._value(index, "uuid"))

    def name(self, index: int) -> str:
        return str(self._value(index, "name"))

    def serial(self, index: int) -> str:
        return str(self._value(index, "serial"))

    def pci_bus_id(self, index: int) -> str:
        return str(self._value(index, "pci_bus_id"))

    def vbios_version(self, index: int) -> str:
        return str(self._value(index, "vbios_version"))

    def temperature(self, index: int) -> int:
        return int(self._value(index, "temperature"))

    def temperature_threshold(self, index: int, kind: ThresholdKind) -> int:
        return int(self._value(index, "temperature_threshold", kind))

    def power_usage_mw(self, index: int) -> int:
        return int(self._value(index, "power_usage_mw"))

    def power_limit_mw(self, index: int) -> int:
        return int(self._value(index, "power_limit_mw"))

    def utilization(self, index: int) -> tuple[int, int]:
        gpu, memory = self._value(index, "utilization")
        return int(gpu), int(memory)

    def memory_info(self, index: int) -> tuple[int, int]:
        total, used = self._value(index, "memory_info")
        return int(total), int(used)

    def ecc_mode(self, index: int) -> tuple[int, int]:
        current, pending = self._value(index, "ecc_mode")
        return int(current), int(pending)

    def total_ecc_errors(self, index: int, *, uncorrected: bool, aggregate: bool) -> int:
        counter = "aggregate" if aggregate else "volatile"
        kind = "uncorrected" if uncorrected else "corrected"
        return int(self._value(index, "ecc_errors", counter, kind))

    def remapped_rows(self, index: int) -> tuple[int, int, int, int]:
        corr, unc, pending, failure = self._value(index, "remapped_rows")
        return int(corr), int(unc), int(pending), int(failure)

    def retired_pages(self, index: int, *, double_bit: bool) -> int:
        return int(self._value(index, "retired_pages", "double_bit" if double_bit else "single_bit"))

    def retired_pages_pending(self, index: int) -> bool:
        return bool(self._value(index, "retired_pages", "pending"))

    def clock_event_reasons(self, index: int) -> int:
        return int(self._value(index, "clock_event_reasons"))

    def _link(self, index: int, link: int) -> dict[str, Any]:
        links = self._value(index, "nvlinks")
        if not 0 <= link < len(links):
            raise NvmlError(ERROR_INVALID_ARGUMENT, f"no NVLink {link}")
        return dict(_check(links[link]))

    def nvlink_active(self, index: int, link: int) -> bool:
        return bool(_check(self._link(index, link)["active"]))

    def nvlink_error_counter(self, index: int, link: int, counter: int) -> int:
        return int(_check(_check(self._link(index, link)["errors"])[counter]))

    def pcie_replay_counter(self, index: int) -> int:
        return int(self._value(index, "pcie", "replay_counter"))

    def pcie_link_generation(self, index: int, *, maximum: bool) -> int:
        return int(self._value(index, "pcie", "gen_max" if maximum else "gen_current"))

    def pcie_link_width(self, index: int, *, maximum: bool) -> int:
        return int(self._value(index, "pcie", "width_max" if maximum else "width_current"))

    def recovery_action(self, index: int) -> int:
        return int(self._value(index, "recovery_action"))

    def register_xid_events(self) -> None:
        if not self.initialized:
            raise NvmlError(ERROR_UNINITIALIZED)
        _check(self.fixture.get("event_registration"))
        self.registered = True

    def wait_xid(self, timeout_ms: int) -> XidRaw | None:
        """The next queued event, or None: at once, or after the timeout when ``blocking`` (a running agent)."""
        if not self.registered:
            raise NvmlError(ERROR_UNINITIALIZED, "register_xid_events was not called")
        _check(self.fixture.get("event_wait"))
        if self._xids:
            return self._xids.popleft()
        if self.blocking and timeout_ms > 0:
            time.sleep(timeout_ms / 1000)
        return None


class SimulatedNvml(FakeNvml):
    """A lab node's simulated GPUs: a :class:`FakeNvml` over a file that ``bcm lab inject`` rewrites.

    The file (a fixture, plus ``seq`` numbers on its ``xid_events``) is read again whenever it changes;
    each Xid is delivered once, however often the file is rewritten. Unlike ``FakeNvml``, ``wait_xid``
    waits out its timeout (checking the file a few times a second), as the real NVML blocks, so an agent
    on it does not spin.
    """

    POLL_S = 0.25

    def __init__(
        self,
        path: str | Path = SIMULATED_NVML_PATH,
        *,
        sleep: Callable[[float], None] = time.sleep,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int] | None = None
        self._seen_seq = 0
        self._sleep = sleep
        self._mono = monotonic
        super().__init__({})
        self._reload()

    def _reload(self) -> None:
        try:
            st = self.path.stat()
            if (st.st_ino, st.st_mtime_ns) == self._stamp:
                return
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return  # keep the last values; the writer replaces the file whole
        self._stamp = (st.st_ino, st.st_mtime_ns)
        self.fixture = data
        for event in data.get("xid_events", []):
            seq = int(event.get("seq", 0))
            if seq > self._seen_seq:
                self._xids.append(XidRaw(gpu_index=event.get("gpu_index"), xid=int(event["xid"])))
                self._seen_seq = seq

    def init(self) -> None:
        self._reload()
        if not self.fixture:
            raise NvmlError(ERROR_CODES["LIBRARY_NOT_FOUND"], f"no simulated GPUs in {self.path}")
        super().init()

    def device_count(self) -> int:
        self._reload()
        return super().device_count()

    def wait_xid(self, timeout_ms: int) -> XidRaw | None:
        deadline = self._mono() + timeout_ms / 1000
        while True:  # bounded by timeout_ms
            self._reload()
            event = super().wait_xid(0)
            if event is not None:
                return event
            left = deadline - self._mono()
            if left <= 0:
                return None
            self._sleep(min(self.POLL_S, left))
