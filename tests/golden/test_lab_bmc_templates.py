"""Golden tests: the emulator configurations bcm renders for lab BMCs, compared with exact text.

Regenerate after an intended change with ``BCM_UPDATE_GOLDEN=1 pytest tests/golden`` and review the diff.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from bcm.lab import bmc

GOLDEN = Path(__file__).parent / "lab_bmc"


def _spec(kind: str) -> bmc.BmcSpec:
    port = 623 if kind == "ipmi" else 8000
    return bmc.BmcSpec(
        kind, "vm01", "198.18.60.201", port, "admin", "pw-1234", "/var/lib/bcm-lab/vms/vm01/bmc"
    )


def _rendered() -> dict[str, str]:
    lan, emu = bmc.render_ipmi(_spec("ipmi"))
    files = {
        "lan.conf": lan.replace(sys.executable, "PYTHON"),
        "bmc.emu": emu,
        "emulator.conf": bmc.render_redfish(_spec("redfish"), "52:54:00:1a:00:01"),
    }
    return files


@pytest.mark.parametrize("name", ["lan.conf", "bmc.emu", "emulator.conf"])
def test_lab_bmc_config_matches_golden(name: str) -> None:
    text = _rendered()[name]
    path = GOLDEN / name
    if os.environ.get("BCM_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text()


def test_sushy_config_is_python_the_emulator_can_load() -> None:
    settings: dict[str, object] = {}
    exec(compile(_rendered()["emulator.conf"], "emulator.conf", "exec"), settings)  # noqa: S102
    systems = settings["SUSHY_EMULATOR_FAKE_SYSTEMS"]
    assert isinstance(systems, list) and systems[0]["name"] == "vm01"
    assert settings["SUSHY_EMULATOR_LISTEN_IP"] == "198.18.60.201"
