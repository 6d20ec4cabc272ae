"""Redfish through OpenStack's ``sushy``, the only module that uses it.

Each call opens the service root, finds the BMC's one ComputerSystem and acts on it
(``reset_system``, ``set_system_boot_options``). sushy is synchronous, so calls run in a worker
thread; requests' connect and read timeouts bound them, and sushy's own retries are off (ours are
in ``bounded``, and never retry a rejected password).

TLS (``CallLimits.tls``): with "pin" every https connection is checked right after its handshake,
before a byte of the request (and so the password) is sent: its certificate's sha256 must be the
target's pin, or, on first contact, becomes the pin for the rest of the call and is reported as
``tls_pin_seen`` for the caller to store. With "ca" requests verifies the chain and the host name.
Proxies from the environment are never used: a BMC is reached directly.
"""

from __future__ import annotations

import hashlib
import logging
import ssl
from collections.abc import Callable
from typing import Any, TypeVar

import requests
import sushy
import urllib3
from requests.adapters import HTTPAdapter
from sushy import exceptions as sx
from sushy.connector import Connector

from bcm.domain.power import BmcTarget, BootDevice, PowerState
from bcm.drivers import offload
from bcm.drivers.power.base import (
    BmcAuthFailed,
    BmcBadAnswer,
    BmcCertChanged,
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


class _Pin:
    """The certificate one driver call accepts: the stored pin, or the first one seen (first contact)."""

    def __init__(self, pinned: str | None) -> None:
        self.pinned = pinned
        self.seen: str | None = None
        self.mismatch: str | None = None

    def check(self, der: bytes | None) -> None:
        if not der:  # anonymous TLS: nothing to pin, nothing to trust
            raise ssl.SSLError("the BMC presented no certificate")
        fingerprint = hashlib.sha256(der).hexdigest()
        self.seen = self.seen or fingerprint
        if self.pinned is None:
            self.pinned = fingerprint
        if fingerprint != self.pinned:
            self.mismatch = fingerprint
            raise ssl.SSLError(f"certificate sha256 {fingerprint} is not the pinned one")


class _PinningAdapter(HTTPAdapter):
    """requests' adapter whose https connections check the peer certificate against a ``_Pin``."""

    def __init__(self, pin: _Pin) -> None:
        self._pin = pin  # before HTTPAdapter's __init__, which builds the pool manager
        super().__init__()

    def init_poolmanager(self, connections: int, maxsize: int, block: bool = False, **kwargs: Any) -> None:
        super().init_poolmanager(connections, maxsize, block, **kwargs)
        pin = self._pin

        class PinnedConnection(urllib3.connection.HTTPSConnection):
            def connect(self) -> None:
                super().connect()  # the handshake, without CA verification (verify=False)
                sock: Any = self.sock
                pin.check(sock.getpeercert(binary_form=True))
                self.is_verified = True  # by its pin

        class PinnedPool(urllib3.HTTPSConnectionPool):
            ConnectionCls = PinnedConnection

        self.poolmanager.pool_classes_by_scheme = {"http": urllib3.HTTPConnectionPool, "https": PinnedPool}


class RedfishDriver:
    def __init__(self, target: BmcTarget, limits: CallLimits) -> None:
        self.target = target
        self.limits = limits
        self._seen: str | None = None

    @property
    def tls_pin_seen(self) -> str | None:
        return self._seen

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
            pin = _Pin(self.target.tls_pin)
            try:
                root = sushy.Sushy(
                    self.target.address.url(self.target.protocol),
                    auth=sushy.auth.BasicAuth(self.target.user, self.target.password),
                    connector=self._connector(pin),
                )
                return act(root.get_system())
            except BmcError:
                raise
            except Exception as exc:  # sushy raises its own tree, requests' and plain ValueErrors
                if pin.mismatch:
                    raise BmcCertChanged(
                        f"{self.target.describe()} presented a TLS certificate (sha256 {pin.mismatch}) that is "
                        f"not the one pinned for it: nothing was sent; if its certificate was replaced, an "
                        f"admin clears the pin (bcm power unpin {self.target.node})"
                    ) from None
                raise _classify(self.target, what, exc) from None
            finally:
                self._seen = self._seen or pin.seen

        async def in_thread() -> T:
            return await offload.run("bmc", run, abandon_on_cancel=True)  # never a request thread (#27)

        return await bounded(self.target, self.limits, what, in_thread)

    def _connector(self, pin: _Pin) -> Connector:
        connector = Connector(
            self.target.address.url(self.target.protocol),
            verify=self.limits.tls == "ca",
            server_side_retries=0,
            default_request_timeout=self.limits.timeout_s,
            connect_timeout=self.limits.timeout_s,
        )
        session = connector._session  # sushy builds it; there is no public way to reach its adapters
        session.trust_env = False  # no proxies or .netrc from the environment between bcm and a BMC
        if self.limits.tls == "pin":
            session.mount("https://", _PinningAdapter(pin))
        return connector


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
