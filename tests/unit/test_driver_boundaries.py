"""Each external system has one module that talks to it: BMCs only through bcm/drivers/power/."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# who may name a BMC client, and why
BMC_CLIENTS = {
    "bcm/drivers/power/ipmi.py": "the IPMI driver (ipmitool over LAN)",
    "bcm/drivers/power/redfish.py": "the Redfish driver (sushy)",
    "bcm/lab/redfish_bmc.py": "the lab's Redfish BMC itself (sushy-tools' emulator), not a client",
    "bcm/agent/facts.py": "the node's agent reads its own BMC's LAN settings in-band (`ipmitool lan print`)",
}
SUSHY = re.compile(r"^\s*(import|from)\s+sushy\b", re.MULTILINE)
IPMITOOL_RUN = re.compile(r"[\"']ipmitool[\"']|\bipmitool\s+(-I|lan|chassis|power)")


def test_only_the_power_drivers_talk_to_bmcs() -> None:
    offenders = []
    for path in sorted((ROOT / "bcm").rglob("*.py")) + sorted((ROOT / "cli").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        if (SUSHY.search(text) or IPMITOOL_RUN.search(text)) and rel not in BMC_CLIENTS:
            offenders.append(rel)
    assert offenders == [], f"BMC clients outside bcm/drivers/power/: {offenders}"


def test_the_drivers_do_talk_to_bmcs() -> None:
    """The check above looks for the right thing: the drivers themselves match it."""
    assert SUSHY.search((ROOT / "bcm/drivers/power/redfish.py").read_text())
    assert IPMITOOL_RUN.search((ROOT / "bcm/drivers/power/ipmi.py").read_text())
