"""A Redfish BMC for one lab machine: sushy-tools' emulator with a systems driver that powers a real process.

Run as ``python -m bcm.lab.redfish_bmc CONFIG MACHINE_DIR``. CONFIG is the emulator's own config file
(rendered from ``templates/lab/sushy/emulator.conf.j2``); MACHINE_DIR is what ``bcm.lab.chassis``
controls, the same code ipmi_sim drives, so both kinds of BMC switch the same kind of machine. With
``tls.crt`` and ``tls.key`` in MACHINE_DIR (``bcm.lab.bmc.make_certificate``) it serves https.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from bcm.lab.chassis import Machine


def make_driver(machine_dir: Path) -> type:
    from sushy_tools import error
    from sushy_tools.emulator.resources.systems import fakedriver

    class MachineDriver(fakedriver.FakeDriver):  # type: ignore[misc]
        """The fake driver's inventory, with power and next boot taken from the machine itself."""

        machine = Machine(machine_dir)

        def get_power_state(self, identity: str) -> str:
            self._get(identity)
            return "On" if self.machine.is_on() else "Off"

        def set_power_state(self, identity: str, state: str) -> None:
            self._get(identity)
            if state in ("On", "ForceOn"):
                self.machine.power_on()
            elif state == "ForceOff":
                self.machine.power_off()
            elif state == "GracefulShutdown":
                self.machine.power_off(graceful=True)
            elif state in ("ForceRestart", "GracefulRestart", "PowerCycle"):
                self.machine.reset()
            else:
                raise error.NotSupportedError(f"Power state {state} is not supported")

        def get_boot_device(self, identity: str) -> str:
            self._get(identity)
            return "Pxe" if self.machine.boot() == "pxe" else "Hdd"

        def set_boot_device(self, identity: str, boot_source: str) -> None:
            self._get(identity)
            self.machine.set_boot("pxe" if boot_source == "Pxe" else "default")

    return MachineDriver


def main(argv: list[str]) -> int:
    config, machine_dir = argv[0], Path(argv[1])
    from sushy_tools.emulator import main as emulator
    from sushy_tools.emulator.resources.systems import fakedriver

    fakedriver.FakeDriver = make_driver(machine_dir)  # the emulator looks it up at first use
    sys.argv = ["sushy-emulator", "--config", config, "--fake"]
    if (machine_dir / "tls.crt").exists():
        sys.argv += [
            "--ssl-certificate",
            str(machine_dir / "tls.crt"),
            "--ssl-key",
            str(machine_dir / "tls.key"),
        ]
    result: Any = emulator.main()
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
