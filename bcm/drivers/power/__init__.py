"""Power control through a node's BMC: one narrow interface, an IPMI and a Redfish implementation.

These modules are the only ones in bcm that talk to BMCs.
"""

from __future__ import annotations

from bcm.domain.power import BmcProtocol, BmcTarget
from bcm.drivers.power.base import (
    BmcAuthFailed,
    BmcBadAnswer,
    BmcCertChanged,
    BmcError,
    BmcRefused,
    BmcUnreachable,
    CallLimits,
    PowerDriver,
)

__all__ = [
    "BmcAuthFailed",
    "BmcBadAnswer",
    "BmcCertChanged",
    "BmcError",
    "BmcRefused",
    "BmcUnreachable",
    "CallLimits",
    "PowerDriver",
    "driver_for",
]


def driver_for(target: BmcTarget, limits: CallLimits) -> PowerDriver:
    """The driver for the target's protocol."""
    if target.protocol is BmcProtocol.IPMI:
        from bcm.drivers.power.ipmi import IpmiDriver

        return IpmiDriver(target, limits)
    from bcm.drivers.power.redfish import RedfishDriver

    return RedfishDriver(target, limits)
