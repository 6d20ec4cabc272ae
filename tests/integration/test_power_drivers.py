"""The IPMI and Redfish drivers against real BMC emulators on loopback (ipmi_sim, sushy-tools).

Each emulator powers a stand-in machine (a sleeping process): power on must start it, off must
kill it, and a one-time PXE boot must reach the machine's next start (its command line).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from bcm.domain.power import BmcProtocol, BmcTarget, BootDevice, PowerState, parse_bmc_address
from bcm.drivers.power import (
    BmcAuthFailed,
    BmcBadAnswer,
    BmcCertChanged,
    BmcUnreachable,
    CallLimits,
    driver_for,
)
from bcm.lab import bmc
from bcm.lab.chassis import Machine

pytestmark = pytest.mark.integration
PASSWORD = "s3cret-pw"
LIMITS = CallLimits(timeout_s=8, retries=1)  # the stand-in BMC runs a Python program per command


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def machine_argv() -> list[str]:
    # $0 carries the boot device the machine was started with: machine-n (network) or machine-c
    return [sys.executable, "-c", "import time; time.sleep(3600)", "machine-{boot}"]


@pytest.fixture(params=["ipmi", "redfish"])
def emulator(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[bmc.BmcSpec]:
    kind = request.param
    if kind == "ipmi" and not (shutil.which("ipmi_sim") and shutil.which("ipmitool")):
        pytest.skip("needs ipmi_sim (openipmi) and ipmitool")
    port = free_port(socket.SOCK_DGRAM if kind == "ipmi" else socket.SOCK_STREAM)
    spec = bmc.BmcSpec(kind, "tbmc", "127.0.0.1", port, "admin", PASSWORD, str(tmp_path / kind))
    bmc.write_machine(spec, machine_argv())
    proc = bmc.start(spec)
    try:
        yield spec
    finally:
        bmc.stop(proc.pid, spec.dir)


def target(spec: bmc.BmcSpec, *, password: str = PASSWORD, address: str | None = None) -> BmcTarget:
    return BmcTarget(
        node="n1",
        protocol=BmcProtocol(spec.kind),
        address=parse_bmc_address(address or spec.address),
        user=spec.user,
        password=password,
    )


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def test_power_on_off_cycle_and_pxe_move_the_real_machine(emulator: bmc.BmcSpec) -> None:
    machine = Machine(emulator.dir)
    driver = driver_for(target(emulator), LIMITS)

    async def scenario() -> None:
        assert await driver.status() is PowerState.OFF
        await driver.on()
        first = machine.pid()
        assert first is not None and await driver.status() is PowerState.ON
        assert "machine-c" in cmdline(first)

        await driver.off()
        assert machine.pid() is None and await driver.status() is PowerState.OFF

        await driver.set_next_boot(BootDevice.PXE)
        await driver.on()
        pxe_boot = machine.pid()
        assert pxe_boot is not None and "machine-n" in cmdline(pxe_boot)

        await driver.cycle()  # the one-time PXE boot was used up: a plain boot now
        for _ in range(100):  # ipmi_sim powers back on one second after a cycle's off
            again = machine.pid()
            if again is not None and again != pxe_boot:
                break
            await asyncio.sleep(0.1)
        assert again is not None and again != pxe_boot and "machine-c" in cmdline(again)
        assert await driver.status() is PowerState.ON

        await driver.soft_off()
        for _ in range(100):
            if machine.pid() is None:
                break
            await asyncio.sleep(0.1)
        assert await driver.status() is PowerState.OFF

    asyncio.run(scenario())


def test_wrong_password_is_an_auth_error_tried_once(emulator: bmc.BmcSpec) -> None:
    driver = driver_for(target(emulator, password="wrong-pw"), CallLimits(timeout_s=8, retries=3))
    with pytest.raises(BmcAuthFailed) as caught:
        asyncio.run(driver.on())
    assert caught.value.attempts == 1
    assert "n1" in caught.value.message and emulator.listen in caught.value.message
    assert "wrong-pw" not in caught.value.message
    assert Machine(emulator.dir).pid() is None


@pytest.mark.parametrize("kind", ["ipmi", "redfish"])
def test_nothing_listening_is_a_bounded_timeout_naming_node_and_bmc(kind: str) -> None:
    if kind == "ipmi" and not shutil.which("ipmitool"):
        pytest.skip("needs ipmitool")
    port = free_port(socket.SOCK_DGRAM if kind == "ipmi" else socket.SOCK_STREAM)
    address = f"127.0.0.1:{port}" if kind == "ipmi" else f"http://127.0.0.1:{port}"
    spec = bmc.BmcSpec(kind, "x", "127.0.0.1", port, "admin", PASSWORD, "/nonexistent")
    driver = driver_for(target(spec, address=address), CallLimits(timeout_s=1, retries=1))
    with pytest.raises(BmcUnreachable) as caught:
        asyncio.run(driver.status())
    assert caught.value.attempts == 2
    assert "node n1" in caught.value.message and f"127.0.0.1:{port}" in caught.value.message


def _garbage_udp(sock: socket.socket, stop: threading.Event) -> None:
    sock.settimeout(0.1)
    while not stop.is_set():
        try:
            _data, peer = sock.recvfrom(4096)
        except TimeoutError:
            continue
        sock.sendto(b"\x06\x00\xff\x07" + b"not ipmi at all" * 4, peer)


def _garbage_http(sock: socket.socket, stop: threading.Event) -> None:
    sock.settimeout(0.1)
    while not stop.is_set():
        try:
            conn, _ = sock.accept()
        except TimeoutError:
            continue
        with conn:
            conn.settimeout(1)
            with contextlib.suppress(TimeoutError):
                conn.recv(65536)
            body = b"<html>this is a printer, not a BMC</html>"
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\nConnection: close\r\n\r\n"
                + body
            )


@pytest.mark.parametrize("kind", ["ipmi", "redfish"])
def test_a_bmc_that_answers_garbage_is_a_clear_error(kind: str) -> None:
    if kind == "ipmi" and not shutil.which("ipmitool"):
        pytest.skip("needs ipmitool")
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM if kind == "ipmi" else socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    if kind == "redfish":
        sock.listen(8)
    port = sock.getsockname()[1]
    stop = threading.Event()
    server = threading.Thread(target=_garbage_udp if kind == "ipmi" else _garbage_http, args=(sock, stop))
    server.start()
    try:
        address = f"127.0.0.1:{port}" if kind == "ipmi" else f"http://127.0.0.1:{port}"
        spec = bmc.BmcSpec(kind, "x", "127.0.0.1", port, "admin", PASSWORD, "/nonexistent")
        driver = driver_for(target(spec, address=address), CallLimits(timeout_s=1, retries=1))
        with pytest.raises(BmcBadAnswer) as caught:
            asyncio.run(driver.status())
        assert "node n1" in caught.value.message and "not" in caught.value.message
    finally:
        stop.set()
        server.join()
        sock.close()


def test_the_password_is_in_no_command_line_or_environment(emulator: bmc.BmcSpec) -> None:
    """While a driver call runs, no process on the machine shows the password in ps or ps e."""
    driver = driver_for(target(emulator), LIMITS)
    seen: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                for name in ("cmdline", "environ"):
                    try:
                        data = Path(f"/proc/{pid}/{name}").read_bytes()
                    except OSError:
                        continue
                    if PASSWORD.encode() in data:
                        seen.append(f"{pid}/{name}")

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for _ in range(3):
            asyncio.run(driver.status())
    finally:
        stop.set()
        watcher.join()
    assert seen == []


def test_redfish_over_https_pins_the_certificate_and_refuses_another(tmp_path: Path) -> None:
    """First contact reports the certificate to pin; with another pin nothing is sent (the machine stays
    off, one try); "ca" mode does not trust the BMC's self-signed certificate at all."""
    spec = bmc.BmcSpec("redfish", "tls", "127.0.0.1", free_port(), "admin", PASSWORD, str(tmp_path / "bmc"))
    bmc.write_machine(spec, machine_argv())
    proc = bmc.start(spec)
    try:
        first = driver_for(target(spec), LIMITS)
        assert asyncio.run(first.status()) is PowerState.OFF
        assert first.tls_pin_seen == bmc.certificate_sha256(spec.dir / "tls.crt")
        pinned = replace(target(spec), tls_pin=first.tls_pin_seen)
        assert asyncio.run(driver_for(pinned, LIMITS).status()) is PowerState.OFF

        other = replace(target(spec), tls_pin="0" * 64)
        with pytest.raises(BmcCertChanged) as caught:
            asyncio.run(driver_for(other, CallLimits(timeout_s=8, retries=3)).on())
        assert caught.value.attempts == 1 and "not the one pinned" in caught.value.message
        assert PASSWORD not in caught.value.message and Machine(spec.dir).pid() is None

        with pytest.raises(BmcUnreachable) as refused:
            asyncio.run(driver_for(target(spec), CallLimits(timeout_s=4, retries=0, tls="ca")).on())
        assert "CERTIFICATE_VERIFY_FAILED" in refused.value.message or "SSL" in refused.value.message
        assert Machine(spec.dir).pid() is None
    finally:
        bmc.stop(proc.pid, spec.dir)
