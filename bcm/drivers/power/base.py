"""The power driver interface, its errors and the one bounded-retry loop both drivers use.

BmcError (DriverError)                 every failure names the node and its BMC
├── BmcUnreachable (Retryable)         no answer within the timeout, connection refused: retried
├── BmcAuthFailed (Fatal)              user or password rejected: never retried (no lock-out storms)
├── BmcBadAnswer (Fatal)               the BMC answered something that is not its protocol
├── BmcRefused (Fatal)                 the BMC understood and said no (unsupported, invalid request)
└── BmcCertChanged (Fatal)             Redfish over https: not the certificate pinned on first contact;
                                       the connection is dropped after the handshake, nothing is sent
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

from bcm.domain.power import BmcTarget, BootDevice, PowerState
from bcm.errors import DriverError, FatalDriverError, RetryableDriverError

log = logging.getLogger("bcm.power")
T = TypeVar("T")


class BmcError(DriverError):
    """A BMC call failed; ``attempts`` says how many times it was tried."""

    attempts: int = 1


class BmcUnreachable(BmcError, RetryableDriverError):
    """No (usable) answer in time."""


class BmcAuthFailed(BmcError, FatalDriverError):
    """The BMC rejected the user or password."""


class BmcBadAnswer(BmcError, FatalDriverError):
    """The other end does not speak the protocol (garbage, wrong service)."""


class BmcRefused(BmcError, FatalDriverError):
    """The BMC refused the request (unsupported command or invalid data)."""


class BmcCertChanged(BmcError, FatalDriverError):
    """The BMC presented another TLS certificate than the one pinned for it."""


@dataclass(frozen=True)
class CallLimits:
    timeout_s: float = 10.0  # one try, end to end
    retries: int = 2  # extra tries after BmcUnreachable only
    cipher_suite: int = 3  # IPMI RMCP+ cipher suite
    # Redfish over https: "pin" trusts the certificate seen first and only it from then on (BMCs' own
    # self-signed ones); "ca" needs one that chains to a CA the head node trusts and names the host
    tls: Literal["pin", "ca"] = "pin"


class PowerDriver(Protocol):
    """One node's BMC. Every method returns within ``(retries + 1) * timeout_s`` or raises BmcError.

    ``on``/``off``/``cycle`` ask the BMC and return once it accepted (the machine may take longer);
    ``soft_off`` asks the OS to shut down (ACPI); ``set_next_boot`` applies to the next boot only.
    """

    async def status(self) -> PowerState: ...

    async def on(self) -> None: ...

    async def off(self) -> None: ...

    async def soft_off(self) -> None: ...

    async def cycle(self) -> None: ...

    async def set_next_boot(self, device: BootDevice) -> None: ...

    @property
    def tls_pin_seen(self) -> str | None:
        """The sha256 of the certificate the BMC presented (Redfish over https with pinning), else None."""
        ...


async def bounded(target: BmcTarget, limits: CallLimits, what: str, call: Callable[[], Awaitable[T]]) -> T:
    """Run one BMC call with a hard timeout per try and retries for BmcUnreachable only."""
    tries = limits.retries + 1
    for attempt in range(1, tries + 1):
        try:
            return await asyncio.wait_for(call(), timeout=limits.timeout_s + 2)
        except TimeoutError:
            err: BmcError = BmcUnreachable(
                f"{target.describe()} did not answer {what} within {limits.timeout_s:g}s"
            )
        except BmcUnreachable as exc:
            err = exc
        except BmcError as exc:
            exc.attempts = attempt
            raise
        err.attempts = attempt
        if attempt == tries:
            if tries > 1:
                err.message += f" (tried {tries} times)"
                err.args = (err.message,)
            raise err
        log.info("%s: %s, try %d of %d", target.describe(), err.message, attempt + 1, tries)
        await asyncio.sleep(min(0.5 * attempt, 2.0))
    raise AssertionError("unreachable")
