"""`bcm lab up|down|status`: a lab of real SSH nodes on this machine (needs root), registered with the server."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.client import CliError
from cli.common import JsonOpt, client
from cli.render import emit_json, err, out, table

app = typer.Typer(
    help="A lab of SSH nodes in network namespaces, to try bcm without hardware (root).", no_args_is_help=True
)
StateDir = Annotated[
    Path | None,
    typer.Option(help="where the lab keeps its state [default: <BCM_STATE_DIR>/lab/<name>]", show_default=False),
]
Name = Annotated[str, typer.Option(help="lab name (bridge namespace; node namespaces get it as prefix)")]
Subnet = Annotated[str, typer.Option(help="lab subnet, inside 198.18.0.0/15")]


def lab_state_root() -> Path:
    """Where labs keep their state by default: beside the server's, so a fresh BCM_STATE_DIR is a fresh lab."""
    from bcm.settings import Settings

    return Settings().state_dir / "lab"


def _lab(state_dir: Path | None, name: str = "bcmlab", subnet: str = "198.18.0.0/24"):  # type: ignore[no-untyped-def]
    from bcm.lab import Lab, LabError

    try:
        return Lab(state_dir or lab_state_root() / name, name, subnet=subnet)
    except LabError as exc:
        raise CliError(exc.message) from None


@app.command("up")
def up(
    nodes: Annotated[int, typer.Option("--nodes", "-n", help="how many SSH nodes")] = 4,
    gpus: Annotated[
        int, typer.Option(help="simulated H100s per node (nvidia-smi, Slurm devices, NVML for the agent)")
    ] = 2,
    vms: Annotated[int, typer.Option(help="qemu VMs, each behind a simulated BMC (IPMI and Redfish in turn)")] = 0,
    discover_vms: Annotated[
        bool, typer.Option(help="leave the VMs unregistered: PXE discovery finds them (bcm lab vm-power --pxe)")
    ] = False,
    category: Annotated[str | None, typer.Option(help="category for the registered nodes")] = None,
    register: Annotated[bool, typer.Option(help="register the nodes with the running server")] = True,
    state_dir: StateDir = None,
    name: Name = "bcmlab",
    subnet: Subnet = "198.18.0.0/24",
    as_json: JsonOpt = False,
) -> None:
    """Bring up N SSH nodes (node01…) with simulated GPUs, ready for a Slurm deploy, and register them.

    Slurm: every node reaches this machine's MariaDB through its socket (started if it is down), and
    the lab has its own accounting database and user (password 0600 in the lab's state dir), which
    `bcm wlm deploy slurm` uses for clusters made of lab nodes.
    """
    from bcm.lab import LabError, accounting

    c = client() if register else None
    keys = [c.get("/api/v1/ssh/public-key")["public_key"]] if c else []
    lab = _lab(state_dir, name, subnet)
    try:
        lab_nodes = lab.up(nodes, keys, gpus=gpus, slurm=True, vms=vms)
    except LabError as exc:
        raise CliError(exc.message) from None
    if not accounting.mariadb_installed():
        err.print(
            "note: MariaDB is not installed, so Slurm in this lab has no accounting database "
            "(apt-get install mariadb-server, then bcm lab up again)",
            style="yellow",
        )
    if c:
        names = [n.name for n in lab_nodes]
        existing = (
            {n["name"] for n in c.get("/api/v1/nodes", nodes=",".join(names), limit=1000)["items"]}
            if names
            else set()
        )
        if existing:  # a previous lab's nodes: their host keys and state are stale
            c.delete("/api/v1/nodes", nodes=",".join(sorted(existing)))
        for n in lab_nodes:
            c.post(
                "/api/v1/nodes",
                {
                    "name": n.name,
                    "mac": n.mac,
                    "ip": n.ip,
                    "category": category,
                    "ssh_host_key": n.host_key_public,
                },
            )
        err.print(f"registered {len(lab_nodes)} node(s) with {c.url}")
        if vms and not discover_vms:
            from cli.power import register_lab_vms

            register_lab_vms(c, lab.state_dir, category)
    _show(lab_nodes, as_json)


@app.command("down")
def down(state_dir: StateDir = None, name: Name = "bcmlab") -> None:
    """Remove every namespace, mount, process and bridge the lab made, and its accounting database.

    Nodes stay registered; lab addresses stay unreachable from this machine (no route leaves it).
    """
    _lab(state_dir, name).down()
    out.print("lab is down")


@app.command("inject")
def inject(
    node: Annotated[str, typer.Argument(help="lab node, e.g. node03")],
    fault: Annotated[str, typer.Argument(help="xid (then its number, e.g. 79) or recover")],
    number: Annotated[int | None, typer.Argument(help="the Xid, e.g. 79 (GPU fallen off the bus)")] = None,
    gpu: Annotated[int, typer.Option(help="which simulated GPU")] = 0,
    wait: Annotated[
        bool, typer.Option(help="wait until bcm has acted on it (drained, or healthy and resumed)")
    ] = True,
    timeout: Annotated[float, typer.Option(help="give up waiting after this many seconds")] = 300,
    state_dir: StateDir = None,
    name: Name = "bcmlab",
) -> None:
    """Make a node's simulated GPU fail (`xid 79`) or heal (`recover`), and watch what bcm does.

    The node's agent (`bcm agent deploy`) reports the fault at once; a FAIL verdict drains the node
    (in Slurm too, when it is in a cluster). After `recover`, bcm resumes its own drain once the node
    has reported healthy for a few intervals.
    """
    from bcm.lab import LabError, fakegpu

    if fault not in ("xid", "recover") or (fault == "xid") != (number is not None):
        raise CliError("say `xid NUMBER` (e.g. xid 79) or `recover`")
    try:
        lab_node = _lab(state_dir, name).node(node)
        if number is not None:
            fakegpu.inject_xid(lab_node, number, gpu)
        else:
            fakegpu.recover(lab_node)
    except LabError as exc:
        raise CliError(exc.message) from None
    what = f"Xid {number} on GPU {gpu}" if number is not None else "healthy GPUs"
    err.print(f"{node}: simulated {what}")
    if wait:
        _watch(node, failing=number is not None, timeout_s=timeout)


def _watch(node: str, *, failing: bool, timeout_s: float) -> None:
    """Poll the server until it shows the node drained (failing) or healthy and in service again."""
    import time
    from datetime import UTC, datetime

    c = client()
    since = datetime.now(UTC)
    deadline = time.monotonic() + timeout_s
    while True:  # bounded by timeout_s
        item = c.get("/api/v1/health/nodes", nodes=node)["items"][0]
        reported = item["last_report_at"] is not None and datetime.fromisoformat(
            item["last_report_at"].replace("Z", "+00:00")
        ).replace(tzinfo=UTC) >= since.replace(microsecond=0)
        if failing:
            done = reported and (
                item["verdict"] != "FAIL" or item["provision_state"] in ("drained", "draining")
            )
        else:
            done = reported and item["verdict"] == "OK" and not item["drained_by_bcm"]
        if done:
            reason = f" ({item['drain_reason']})" if item.get("drain_reason") else ""
            out.print(f"{node}: {item['verdict']}, {item['provision_state']}{reason}")
            return
        if time.monotonic() > deadline:
            raise CliError(
                f"{node} is still {item['verdict']}, {item['provision_state']} after {timeout_s:.0f}s; "
                "is its agent running (bcm agent deploy) and reporting?"
            )
        time.sleep(1)


@app.command("status")
def status(state_dir: StateDir = None, name: Name = "bcmlab", as_json: JsonOpt = False) -> None:
    """Lab nodes and whether their sshd runs."""
    _show(_lab(state_dir, name).status(), as_json)


def _show(nodes: list, as_json: bool) -> None:  # type: ignore[type-arg]
    if as_json:
        emit_json([n.to_dict() for n in nodes])
    else:
        table(
            None,
            ["NAME", "IP", "MAC", "NETNS", "SSHD"],
            [(n.name, n.ip, n.mac, n.netns, "up" if n.alive else "down") for n in nodes],
        )


def _vms(state_dir: Path | None, name: str, wanted: list[str]) -> list:  # type: ignore[type-arg]
    from bcm.lab import vm

    lab = _lab(state_dir, name)
    found = {v.name: v for v in vm.load(lab.state_dir)}
    if not found:
        raise CliError(f"lab {name} has no VMs (bcm lab up --vms N)")
    unknown = [w for w in wanted if w not in found]
    if unknown:
        raise CliError(f"no lab VM named {', '.join(unknown)} (VMs: {', '.join(sorted(found))})")
    return [found[w] for w in wanted] or list(found.values())


@app.command("vm-power")
def vm_power(
    action: Annotated[str, typer.Argument(help="on, off or cycle")],
    vms: Annotated[list[str] | None, typer.Argument(help="lab VMs (default: all)")] = None,
    pxe: Annotated[bool, typer.Option(help="boot from the network this once")] = False,
    state_dir: StateDir = None,
    name: Name = "bcmlab",
) -> None:
    """Press the power button of lab VMs through their BMCs, as an admin does for machines bcm does not know yet."""
    import asyncio

    from bcm.domain.power import BmcProtocol, BmcTarget, BootDevice, parse_bmc_address
    from bcm.drivers.power import BmcError, CallLimits, driver_for

    if action not in ("on", "off", "cycle"):
        raise CliError(f"action: {action!r} is not on, off or cycle")

    async def press(v) -> str:  # type: ignore[no-untyped-def]
        target = BmcTarget(v.name, BmcProtocol(v.bmc.kind), parse_bmc_address(v.bmc.address), v.bmc.user, v.bmc.password)
        driver = driver_for(target, CallLimits(timeout_s=10, retries=1))
        try:
            if pxe:
                await driver.set_next_boot(BootDevice.PXE)
            await {"on": driver.on, "off": driver.off, "cycle": driver.cycle}[action]()
        except BmcError as exc:
            return f"{v.name}: {exc.message}"
        return ""

    async def all_of(targets: list) -> list[str]:  # type: ignore[type-arg]
        return list(await asyncio.gather(*(press(v) for v in targets)))

    targets = _vms(state_dir, name, vms or [])
    failures = [f for f in asyncio.run(all_of(targets)) if f]
    if failures:
        raise CliError("; ".join(failures))
    out.print(f"{action}{' (network boot)' if pxe else ''}: {', '.join(v.name for v in targets)}")


@app.command("vm-bmc")
def vm_bmc(
    vm_name: Annotated[str, typer.Argument(metavar="VM", help="lab VM, e.g. vm01")],
    node: Annotated[str, typer.Argument(help="the node that VM became (bcm node assign)")],
    state_dir: StateDir = None,
    name: Name = "bcmlab",
) -> None:
    """Give a node the BMC settings of the lab VM it is (address, protocol, user, password); the node
    counts among the lab's own from then on (a Slurm deploy onto lab nodes takes the lab's settings)."""
    from bcm.lab import accounting

    v = _vms(state_dir, name, [vm_name])[0]
    c = client()
    c.patch(f"/api/v1/nodes/{node}", {"bmc_address": v.bmc.address, "bmc_protocol": v.bmc.kind, "bmc_user": v.bmc.user})
    c.request("PUT", "/api/v1/nodes/bmc-password", json={"nodes": node, "password": v.bmc.password})
    accounting.add_slurm_nodes(_lab(state_dir, name).state_dir, [node])
    out.print(f"{node}: BMC of {v.name} ({v.bmc.kind} {v.bmc.address})")
