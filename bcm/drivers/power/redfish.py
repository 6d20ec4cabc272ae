"""Redfish through OpenStack's ``sushy``, the only module that uses it.

Each call opens the service root, finds the BMC's one ComputerSystem and acts on it
(``reset_system``, ``set_system_boot_options``). sushy is synchronous, so calls run in a worker
thread; requests' connect and read timeouts bound them, and sushy's own retries are off (ours are
in ``bounded``, and never retry a rejected password).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import requests
import sushy
from sushy import exceptions as sx

from bcm.domain.power import BmcTarget, BootDevice, PowerState
from bcm.drivers.power.base import (
    BmcAuthFailed,
    BmcBadAnswer,
    BmcError,
    BmcRefused,
    BmcUnreachable,
    CallLimits,
    bounded,
)

T = TypeVar("T")
logging.getLogger("sushy").setLevel(logging.CRITICAL)  # it logs URLs, retries and whole bodies

_STATES = {
    "On": PowerState.ON,
    "PoweringOff": PowerState.ON,
    "Off": PowerState.OFF,
    "PoweringOn": PowerState.OFF,
}
_BOOT = {BootDevice.PXE: sushy.BootSource.PXE, BootDevice.DISK: sushy.BootSource.HDD}


class RedfishDriver:
    def __init__(self, target: BmcTarget, limits: CallLimits) -> None:
        self.target = target
        self.limits = limits

    async def status(self) -> PowerState:
        def read(system: Any) -> PowerState:
            value = system.power_state
            state = _STATES.get(getattr(value, "value", value))
            if state is None:
                raise BmcBadAnswer(f"{self.target.describe()}: unknown PowerState {value!r}")
            return state

        return await self._call("power status", read)

    async def on(self) -> None:
        await self._reset("power on", sushy.ResetType.ON)

    async def off(self) -> None:
        await self._reset("power off", sushy.ResetType.FORCE_OFF)

    async def soft_off(self) -> None:
        await self._reset("soft power off", sushy.ResetType.GRACEFUL_SHUTDOWN)

    async def cycle(self) -> None:
        if await self.status() is PowerState.OFF:
            await self.on()
        else:
            await self._reset("power cycle", sushy.ResetType.FORCE_RESTART)

    async def set_next_boot(self, device: BootDevice) -> None:
        def act(system: Any) -> None:
            system.set_system_boot_options(target=_BOOT[device], enabled=sushy.BootSourceOverrideEnabled.ONCE)

        await self._call(f"next boot {device.value}", act)

    async def _reset(self, what: str, value: Any) -> None:
        await self._call(what, lambda system: system.reset_system(value))

    async def _call(self, what: str, act: Callable[[Any], T]) -> T:
        def run() -> T:
            try:
                root = sushy.Sushy(
                    self.target.address.url(self.target.protocol),
                    auth=sushy.auth.BasicAuth(self.target.user, self.target.password),
                    verify=self.limits.verify_tls,
                    server_side_retries=0,
                    connect_timeout=self.limits.timeout_s,
                    read_timeout=self.limits.timeout_s,
                )
                return act(root.get_system())
            except BmcError:
                raise
            except Exception as exc:  # sushy raises its own tree, requests' and plain ValueErrors
                raise _classify(self.target, what, exc) from None

        async def in_thread() -> T:
            return await anyio.to_thread.run_sync(run, abandon_on_cancel=True)

        return await bounded(self.target, self.limits, what, in_thread)


def _classify(target: BmcTarget, what: str, exc: Exception) -> BmcError:
    where = target.describe()
    if isinstance(exc, sx.AccessError):
        return BmcAuthFailed(f"{where} rejected user {target.user!r} or its password ({what})")
    if isinstance(exc, sx.ServerSideError):
        return BmcUnreachable(f"{where} failed {what} with a server error ({exc.status_code})")
    if isinstance(exc, sx.ResourceNotFoundError):
        return BmcBadAnswer(f"{where}: no Redfish service or system there ({what}: 404)")
    if isinstance(exc, sx.HTTPError):
        return BmcRefused(f"{where} refused {what}: {exc.status_code} {_short(exc.detail)}")
    if isinstance(exc, sx.ConnectionError):
        return BmcUnreachable(f"{where} did not answer {what} ({_short(str(exc))})")
    if isinstance(exc, ValueError | sx.SushyError | KeyError | TypeError | AttributeError):
        # before RequestException: requests' JSONDecodeError is both
        return BmcBadAnswer(
            f"{where} answered {what} with something that is not Redfish ({type(exc).__name__})"
        )
    if isinstance(exc, requests.exceptions.RequestException):
        return BmcUnreachable(f"{where} did not answer {what} ({type(exc).__name__})")
    return BmcBadAnswer(f"{where}: {what} failed: {type(exc).__name__}")


def _short(value: Any) -> str:
    text = str(value or "")
    return text if len(text) <= 200 else text[:200] + "…"
