"""Each external system has one module that talks to it: BMCs only through bcm/drivers/power/."""

from __future__ import annotations

import ast
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


# ---- workload managers: Slurm only behind bcm/drivers/wlm/ ---------------------------------------------

WLM_PACKAGE = "bcm.drivers.wlm"
SLURM_DRIVER = {"bcm.drivers.wlm.slurm", "bcm.drivers.slurm"}  # the module, and where it used to live
# who may import the Slurm driver, and why
SLURM_IMPORTERS = {
    "bcm/drivers/wlm/__init__.py": "the registry: get('slurm') hands out its implementation",
}
SLURM_DRIVER_FILES = re.compile(r"bcm/drivers/wlm/slurm\w*\.py|bcm/lab/.*\.py")  # the driver itself; the lab
SLURM_TOOLS = re.compile(r"[\"'](scontrol|sinfo|srun|sacct|sacctmgr|sbatch|squeue)\b")


def _sources(*tops: str) -> list[Path]:
    return [
        p
        for top in tops
        for p in sorted((ROOT / top).rglob("*.py"))
        if "migrations/versions" not in p.as_posix()
    ]


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _may_name_slurm(rel: str) -> bool:
    return rel in SLURM_IMPORTERS or bool(SLURM_DRIVER_FILES.fullmatch(rel))


def _imports(tree: ast.AST) -> list[tuple[str, str | None, str]]:
    """(module, name imported from it or None, local alias) for every import in a module."""
    out: list[tuple[str, str | None, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None, a.asname or a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(node.module, a.name, a.asname or a.name) for a in node.names]
    return out


def _slurm_imports(tree: ast.AST) -> list[str]:
    found = []
    for module, name, _alias in _imports(tree):
        if module in SLURM_DRIVER or (name and f"{module}.{name}" in SLURM_DRIVER):
            found.append(f"{module}.{name}" if name else module)
    return found


def _private_uses(tree: ast.AST) -> list[str]:
    """Private names of bcm.drivers.wlm (any of its modules) used here: imported, or reached as attributes."""
    aliases: dict[str, str] = {}  # local name -> the wlm module it stands for
    found = []
    for module, name, alias in _imports(tree):
        if module == WLM_PACKAGE or module.startswith(WLM_PACKAGE + "."):
            if name is None:
                aliases[alias] = module
            elif name.startswith("_"):
                found.append(f"{module}.{name}")
            else:
                aliases[alias] = f"{module}.{name}"  # a submodule, or a class whose privates count too
        elif module == "bcm.drivers" and name in ("wlm", "slurm"):
            aliases[alias] = f"bcm.drivers.{name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            dotted = []
            while isinstance(base, ast.Attribute):
                dotted.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in aliases:
                found.append(".".join([aliases[base.id], *reversed(dotted), node.attr]))
    return found


def test_only_the_wlm_package_and_the_lab_import_the_slurm_driver() -> None:
    offenders = {}
    for path in _sources("bcm", "cli", "bench"):
        rel = _rel(path)
        hits = _slurm_imports(ast.parse(path.read_text()))
        if hits and not _may_name_slurm(rel):
            offenders[rel] = hits
    assert offenders == {}, (
        f"Slurm driver imported outside bcm/drivers/wlm/ (use bcm.drivers.wlm.get): {offenders}"
    )


def test_no_caller_uses_a_private_name_of_the_wlm_drivers() -> None:
    offenders = {}
    for path in _sources("bcm", "cli", "bench", "tests"):
        rel = _rel(path)
        if rel.startswith("bcm/drivers/wlm/"):
            continue
        hits = _private_uses(ast.parse(path.read_text()))
        if hits:
            offenders[rel] = hits
    assert offenders == {}, f"private names of bcm.drivers.wlm used outside it: {offenders}"


def test_only_the_slurm_driver_runs_slurm_tools() -> None:
    offenders = [
        _rel(p)
        for p in _sources("bcm", "cli")
        if SLURM_TOOLS.search(p.read_text()) and not _may_name_slurm(_rel(p))
    ]
    assert offenders == [], f"Slurm commands run outside bcm/drivers/wlm/slurm*.py: {offenders}"


def test_the_wlm_checks_see_what_they_look_for() -> None:
    """The checks above are not vacuous: the driver matches them, and the old wiring would have failed."""
    driver = (ROOT / "bcm/drivers/wlm/slurm.py").read_text()
    assert SLURM_TOOLS.search(driver)
    assert _slurm_imports(ast.parse((ROOT / "bcm/drivers/wlm/__init__.py").read_text()))
    assert _may_name_slurm("bcm/lab/slurm.py") and _may_name_slurm("bcm/drivers/wlm/slurm_accounts.py")
    assert not _may_name_slurm("bcm/workers/wlm.py") and not _may_name_slurm("bcm/drivers/wlm/base.py")
    old = ast.parse(
        "from bcm.drivers import ansible, slurm\n"
        "from bcm.drivers.wlm.slurm import _ok\n"
        "import bcm.drivers.wlm.slurm as s\n"
        "ok = slurm._responding(None) or s._VERIFY_MARK\n"
    )
    assert _slurm_imports(old) == ["bcm.drivers.slurm", "bcm.drivers.wlm.slurm._ok", "bcm.drivers.wlm.slurm"]
    assert sorted(_private_uses(old)) == [
        "bcm.drivers.slurm._responding",
        "bcm.drivers.wlm.slurm._VERIFY_MARK",
        "bcm.drivers.wlm.slurm._ok",
    ]
