"""IPMI v2.0 over LAN (RMCP+) through ``ipmitool``, the only module that runs it.

Why ipmitool and not pyghmi: it is the client every BMC vendor tests against (and what Ironic's
default IPMI driver runs), so its quirk handling is the widest; a subprocess per call gives each call
a hard bound (we kill it), and fan-out is plain asyncio with no library-global session thread.
The cost is parsing its text, which is confined to ``_classify`` below.

Secrets: the password is written to ipmitool's stdin and read with ``-f /dev/stdin``, so it is in no
command line (``ps``), environment (``ps e``) or file.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil

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

AUTH_MARKERS = (
    "RAKP 2 HMAC is invalid",
    "unauthorized name",
    "RAKP 2 message indicates an error",
    "Invalid user name",
    "Activate Session error",
    "password is invalid",
)
GARBAGE_MARKERS = ("IPMI Request Match NOT FOUND", "Invalid RMCP", "Unsupported RMCP")
NO_SESSION_MARKERS = (
    "Unable to establish",
    "Get Auth Capabilities error",
    "No response from remote controller",
)
NOISE = (
    "Loading IANA PEN Registry",
    "Running Get PICMG",
    "Discovered IPMB",
    "Invalid completion code received",
)


class IpmiDriver:
    def __init__(self, target: BmcTarget, limits: CallLimits) -> None:
        self.target = target
        self.limits = limits

    # ---- the PowerDriver interface ----------------------------------------------------------------

    @property
    def tls_pin_seen(self) -> str | None:
        return None

    async def status(self) -> PowerState:
        out = await self._call("power status", ["chassis", "power", "status"])
        if "Chassis Power is on" in out:
            return PowerState.ON
        if "Chassis Power is off" in out:
            return PowerState.OFF
        raise BmcBadAnswer(f"{self.target.describe()}: unexpected power status answer: {_last_line(out)!r}")

    async def on(self) -> None:
        await self._call("power on", ["chassis", "power", "on"])

    async def off(self) -> None:
        await self._call("power off", ["chassis", "power", "off"])

    async def soft_off(self) -> None:
        await self._call("soft power off", ["chassis", "power", "soft"])

    async def cycle(self) -> None:
        # a BMC may refuse to cycle a machine that is off; "cycle" means "end up freshly on"
        if await self.status() is PowerState.OFF:
            await self.on()
        else:
            await self._call("power cycle", ["chassis", "power", "cycle"])

    async def set_next_boot(self, device: BootDevice) -> None:
        await self._call(f"next boot {device.value}", ["chassis", "bootdev", device.value])

    # ---- one ipmitool run -------------------------------------------------------------------------

    def argv(self, command: list[str]) -> list[str]:
        addr = self.target.address
        per_try = max(1, int(self.limits.timeout_s / 2))
        return [
            shutil.which("ipmitool") or "ipmitool",
            "-I",
            "lanplus",
            "-C",
            str(self.limits.cipher_suite),
            "-H",
            addr.host,
            "-p",
            str(addr.port or 623),
            "-U",
            self.target.user,
            "-f",
            "/dev/stdin",  # the password, from our pipe
            "-N",
            str(per_try),
            "-R",
            "1",
            "-v",  # makes ipmitool say why a session failed (auth vs. no answer)
            *command,
        ]

    async def _call(self, what: str, command: list[str]) -> str:
        return await bounded(self.target, self.limits, what, lambda: self._run(what, command))

    async def _run(self, what: str, command: list[str]) -> str:
        proc = await asyncio.create_subprocess_exec(
            *self.argv(command),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"},
        )
        try:
            raw, _ = await proc.communicate((self.target.password + "\n").encode())
        finally:
            if proc.returncode is None:  # cancelled by the timeout: leave no ipmitool behind
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        out = raw.decode(errors="replace")
        if proc.returncode != 0:
            raise _classify(self.target, what, out)
        return out


def _classify(target: BmcTarget, what: str, out: str) -> BmcError:
    where = target.describe()
    if any(m in out for m in AUTH_MARKERS):
        return BmcAuthFailed(f"{where} rejected user {target.user!r} or its password ({what})")
    no_session = any(m in out for m in NO_SESSION_MARKERS)
    if no_session and any(m in out for m in GARBAGE_MARKERS):
        # packets came back, none of them IPMI (late answers to a slow BMC also miss, but after a session)
        return BmcBadAnswer(f"{where} answered {what} with something that is not IPMI")
    if "failed:" in out:
        return BmcRefused(f"{where} refused {what}: {_last_line(out)}")
    if no_session:
        return BmcUnreachable(f"{where} did not answer {what} (no IPMI session)")
    if "Unable to " in out:
        return BmcUnreachable(f"{where} did not answer {what} in time")
    return BmcBadAnswer(f"{where}: ipmitool failed on {what}: {_last_line(out)}")


def _last_line(out: str) -> str:
    lines = [ln.strip() for ln in out.splitlines() if ln.strip() and not ln.startswith(NOISE)]
    return (lines[-1] if lines else "no output")[:300]
