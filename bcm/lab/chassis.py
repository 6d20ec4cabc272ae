"""A lab machine's power, as its simulated BMC sees it: "on" is "its process runs".

Both emulators drive the same code: OpenIPMI's ``ipmi_sim`` runs this module as its
``chassis_control`` program (``python -m bcm.lab.chassis DIR get power`` / ``set power "1"`` …) and the
Redfish emulator (``bcm.lab.redfish_bmc``) calls ``Machine`` directly. ``DIR/machine.json`` holds the
command line; ``{boot}`` in it becomes ``n`` (network) for a one-time PXE boot, else ``c``.
Off is the plug pulled (SIGKILL); a graceful shutdown is SIGTERM (qemu exits cleanly on it).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

STOP_WAIT_S = 10.0
BOOT_ONCE = "next_boot"  # file: "pxe" until the next power on consumes it


class Machine:
    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        spec = json.loads((self.dir / "machine.json").read_text())
        self.argv: list[str] = spec["argv"]
        self.log = self.dir / "machine.log"

    # ---- power --------------------------------------------------------------------------------------

    def pid(self) -> int | None:
        """The running machine's pid (checked against its recorded start time), or None."""
        try:
            pid_s, started = (self.dir / "machine.pid").read_text().split()
            pid = int(pid_s)
        except (FileNotFoundError, ValueError):
            return None
        return pid if _start_time(pid) == started else None

    def is_on(self) -> bool:
        return self.pid() is not None

    def power_on(self) -> None:
        if self.is_on():
            return
        boot = "n" if self._take_boot_once() == "pxe" else "c"
        argv = [a.replace("{boot}", boot) for a in self.argv]
        if boot == "n" or "-drive" in argv:  # a network boot runs, a machine with a disk boots it (#30);
            argv = [a for a in argv if a != "-S"]  # otherwise the machine waits, paused, needing no CPU
        with open(self.log, "ab") as log:
            proc = subprocess.Popen(  # own session, no inherited descriptors: the BMC must not wait on it
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True
            )
        started = None
        for _ in range(100):
            started = _start_time(proc.pid)
            if started:
                break
            time.sleep(0.01)
        (self.dir / "machine.pid").write_text(f"{proc.pid} {started}\n")

    def power_off(self, *, graceful: bool = False) -> None:
        pid = self.pid()
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM if graceful else signal.SIGKILL)
        deadline = time.monotonic() + STOP_WAIT_S
        while self.pid() is not None and time.monotonic() < deadline:
            _reap(pid)
            time.sleep(0.05)
        if graceful:
            return
        if self.pid() is not None:
            raise RuntimeError(f"machine process {pid} did not stop")
        (self.dir / "machine.pid").unlink(missing_ok=True)

    def reset(self) -> None:
        self.power_off()
        self.power_on()

    # ---- next boot ----------------------------------------------------------------------------------

    def set_boot(self, device: str) -> None:
        """``pxe`` for the next power on only; anything else clears it."""
        path = self.dir / BOOT_ONCE
        if device == "pxe":
            path.write_text("pxe\n")
        else:
            path.unlink(missing_ok=True)

    def boot(self) -> str:
        path = self.dir / BOOT_ONCE
        return "pxe" if path.exists() else "default"

    def _take_boot_once(self) -> str:
        value = self.boot()
        (self.dir / BOOT_ONCE).unlink(missing_ok=True)
        return value


def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":  # a zombie is off
        return None
    return fields[19]


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def main(argv: list[str]) -> int:
    """ipmi_sim's chassis_control protocol: ``DIR get PARM…`` prints ``parm:value``; ``DIR set PARM VAL…``."""
    if len(argv) < 2:
        print("usage: chassis DIR get|set …")
        return 1
    machine, op, args = Machine(Path(argv[0])), argv[1], argv[2:]
    if op == "get":
        for parm in args:
            if parm == "power":
                print(f"power:{int(machine.is_on())}")
            elif parm == "boot":
                print(f"boot:{machine.boot()}")
            else:
                print(f"unsupported parameter {parm}")
                return 1
        return 0
    if op == "set":
        pairs = list(zip(args[::2], args[1::2], strict=False))
        for parm, value in pairs:
            if parm == "power":
                machine.power_on() if value == "1" else machine.power_off()
            elif parm == "reset":
                machine.reset()
            elif parm == "shutdown":
                machine.power_off(graceful=True)
            elif parm == "boot":
                machine.set_boot(value)
            else:
                print(f"unsupported parameter {parm}")
                return 1
        return 0
    print(f"unsupported operation {op}")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
