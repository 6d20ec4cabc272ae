"""`bcm lab up|down|status`: a lab of real SSH nodes on this machine (needs root), registered with the server;
`bcm lab up --heads N` and `bcm lab head kill|freeze|thaw|start|status N`: several head nodes and drills on them."""

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
    typer.Option(
        help="where the lab keeps its state [default: <BCM_STATE_DIR>/lab/<name>]", show_default=False
    ),
]
Name = Annotated[str, typer.Option(help="lab name (bridge namespace; node namespaces get it as prefix)")]
Subnet = Annotated[str, typer.Option(help="lab subnet, inside 198.18.0.0/15")]
HeadsSubnet = Annotated[
    str | None,
    typer.Option(
        "--subnet",
        help="lab subnet, inside 198.18.0.0/15 [default: 198.18.0.0/24; with --heads 198.18.229.0/24]",
        show_default=False,
    ),
]


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
    vms: Annotated[
        int, typer.Option(help="qemu VMs, each behind a simulated BMC (IPMI and Redfish in turn)")
    ] = 0,
    discover_vms: Annotated[
        bool,
        typer.Option(help="leave the VMs unregistered: PXE discovery finds them (bcm lab vm-power --pxe)"),
    ] = False,
    vm_bmc_password_stdin: Annotated[
        bool,
        typer.Option(
            "--vm-bmc-password-stdin",
            help="one BMC password (read from stdin) for every VM's BMC, as a site's BMCs share the one their "
            "category holds (zero-touch); otherwise each BMC gets its own",
        ),
    ] = False,
    disk: Annotated[
        str | None,
        typer.Option(help="each VM gets a blank disk of this size (8G): a qcow2 in the lab's state dir"),
    ] = None,
    category: Annotated[str | None, typer.Option(help="category for the registered nodes")] = None,
    register: Annotated[bool, typer.Option(help="register the nodes with the running server")] = True,
    heads: Annotated[
        int | None,
        typer.Option(
            help="instead of SSH nodes: N head nodes (2 to 5), each running bcm serve on --database-url, "
            "and keepalived giving the service address (the subnet's .1) to the head that leads",
            show_default=False,
        ),
    ] = None,
    database_url: Annotated[
        str | None,
        typer.Option(
            help="with --heads: the PostgreSQL database the heads share, by its socket "
            "(e.g. postgresql+psycopg://bcm@/bcm?host=/var/run/postgresql)",
            show_default=False,
        ),
    ] = None,
    state_dir: StateDir = None,
    name: Name = "bcmlab",
    subnet: HeadsSubnet = None,
    as_json: JsonOpt = False,
) -> None:
    """Bring up N SSH nodes (node01…) with simulated GPUs, ready for a Slurm deploy, and register them.

    Slurm: every node reaches this machine's MariaDB through its socket (started if it is down), and
    the lab has its own accounting database and user (password 0600 in the lab's state dir), which
    `bcm wlm deploy slurm` uses for clusters made of lab nodes.

    With --heads N: N head namespaces on a bridge of their own, each running `bcm serve` (detached: they
    outlive this command) on one PostgreSQL database, and keepalived holding the service address on the
    head whose bcm leads. Drills: `bcm lab head kill|freeze|thaw|start N`; `bcm lab down` ends it all.
    """
    from bcm.lab import LabError, accounting

    if heads is not None:
        _heads_up(heads, database_url, state_dir, name, subnet, as_json)
        return
    if database_url is not None:
        raise CliError("--database-url goes with --heads N (the SSH nodes use no database)")
    subnet = subnet or "198.18.0.0/24"

    disk_bytes = None
    if disk is not None:
        from bcm.lab import LabError as _LabError
        from bcm.lab.vm import parse_disk_size

        if not vms:
            raise CliError("--disk goes with --vms N")
        try:
            disk_bytes = parse_disk_size(disk)
        except _LabError as exc:
            raise CliError(exc.message) from None
    vm_password = None
    if vm_bmc_password_stdin:
        from cli.power import _read_password

        if not vms:
            raise CliError("--vm-bmc-password-stdin goes with --vms N")
        vm_password = _read_password()
    c = client() if register else None
    keys = [c.get("/api/v1/ssh/public-key")["public_key"]] if c else []
    lab = _lab(state_dir, name, subnet)
    try:
        lab_nodes = lab.up(
            nodes, keys, gpus=gpus, slurm=True, vms=vms, vm_bmc_password=vm_password, vm_disk_bytes=disk_bytes
        )
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

    The lab's heads go too (bcm serve, keepalived, their namespaces and bridge). Nodes stay registered; lab addresses stay unreachable from this machine (no route leaves it).
    """
    from bcm.lab import LabError
    from bcm.lab.heads import Heads

    lab = _lab(state_dir, name)
    try:
        Heads(_heads_dir(lab), name=_heads_name(name)).down()
        lab.down()
    except LabError as exc:
        raise CliError(exc.message) from None
    out.print("lab is down")


# ---- several heads ------------------------------------------------------------------------------------

head_app = typer.Typer(
    help="Drills on the lab's heads (bcm lab up --heads N): kill, freeze, thaw, start, status.",
    no_args_is_help=True,
)
app.add_typer(head_app, name="head")
HeadNumber = Annotated[int, typer.Argument(metavar="N", help="which head: 1 to the number of heads")]


def _heads_dir(lab) -> Path:  # type: ignore[no-untyped-def]
    return Path(lab.state_dir) / "heads"


def _heads_name(name: str) -> str:
    """The heads' namespaces are <name>ha-1…: never <name>-…, which the SSH-node lab sweeps as its own."""
    return f"{name}ha"


def _heads_up(
    count: int, database_url: str | None, state_dir: Path | None, name: str, subnet: str | None, as_json: bool
) -> None:
    from bcm.lab import LabError
    from bcm.lab.heads import DEFAULT_SUBNET, MAX_HEADS, MIN_HEADS, Heads, check_database_url

    if not MIN_HEADS <= count <= MAX_HEADS:
        raise CliError(f"--heads: a lab has {MIN_HEADS} to {MAX_HEADS} heads, not {count}")
    subnet = subnet or DEFAULT_SUBNET
    try:
        check_database_url(database_url, subnet)
        lab = _lab(state_dir, name, subnet)  # the name and the subnet checked as any lab's
        heads = Heads(_heads_dir(lab), count, database_url or "", name=_heads_name(name), subnet=subnet)
        heads.up()
        heads.wait_leader()
    except LabError as exc:
        raise CliError(exc.message) from None
    _show_heads(heads, as_json)


def _loaded_heads(state_dir: Path | None, name: str):  # type: ignore[no-untyped-def]
    from bcm.lab import LabError
    from bcm.lab.heads import Heads

    try:
        heads = Heads.load(_heads_dir(_lab(state_dir, name)))
    except LabError as exc:
        raise CliError(exc.message) from None
    if heads is None or not heads.heads:
        raise CliError(f"lab {name} has no heads up (bcm lab up --heads 2 --database-url …)")
    return heads


def _show_heads(heads, as_json: bool) -> None:  # type: ignore[no-untyped-def]
    from bcm.lab import LabError

    try:
        rows = heads.status()
        token_file = str(heads.token_file())
    except LabError as exc:
        raise CliError(exc.message) from None
    if as_json:
        emit_json({"service_url": heads.url, "token_file": token_file, "heads": rows})
        return
    table(
        None,
        ["HEAD", "URL", "NETNS", "BCM SERVE", "KEEPALIVED", "SERVICE ADDRESS", "LEADS"],
        [
            (
                str(r["head"]),
                r["url"],
                r["netns"],
                r["serve"],
                r["keepalived"],
                heads.vip if r["service_address"] else "",
                "yes" if r["leading"] else "",
            )
            for r in rows
        ],
    )
    leading = [str(r["head"]) for r in rows if r["leading"]]
    out.print(f"service address {heads.url}, leader: head {', '.join(leading) or 'none'}")
    out.print(f"export BCM_URL={heads.url} BCM_TOKEN=$(cat {token_file})")


@head_app.command("status")
def head_status(state_dir: StateDir = None, name: Name = "bcmlab", as_json: JsonOpt = False) -> None:
    """Each head: its URL, its bcm serve and keepalived (up, frozen, down), the service address, the leader."""
    _show_heads(_loaded_heads(state_dir, name), as_json)


def _drill(action: str, number: int, state_dir: Path | None, name: str, done: str) -> None:
    from bcm.lab import LabError

    heads = _loaded_heads(state_dir, name)
    try:
        getattr(heads, action)(number)
    except LabError as exc:
        raise CliError(exc.message) from None
    out.print(f"head {number}: {done}")


@head_app.command("kill")
def head_kill(number: HeadNumber, state_dir: StateDir = None, name: Name = "bcmlab") -> None:
    """kill -9 of head N's bcm serve; another head takes the lease and the service address.

    Its keepalived stays, fails the /leaderz check and gives the address up; `bcm lab head start N`
    brings the server back.
    """
    _drill("kill", number, state_dir, name, "bcm serve killed (SIGKILL)")


@head_app.command("freeze")
def head_freeze(number: HeadNumber, state_dir: StateDir = None, name: Name = "bcmlab") -> None:
    """SIGSTOP head N's bcm serve and keepalived, as if the machine paused.

    Another head takes the lease and the address; the frozen one still holds it too until
    `bcm lab head thaw N`.
    """
    _drill("freeze", number, state_dir, name, "bcm serve and keepalived frozen (SIGSTOP)")


@head_app.command("thaw")
def head_thaw(number: HeadNumber, state_dir: StateDir = None, name: Name = "bcmlab") -> None:
    """SIGCONT head N's bcm serve and keepalived: it finds a newer leader and gives the address up."""
    _drill("thaw", number, state_dir, name, "bcm serve and keepalived running again (SIGCONT)")


@head_app.command("start")
def head_start(number: HeadNumber, state_dir: StateDir = None, name: Name = "bcmlab") -> None:
    """Start head N's bcm serve again after a kill (a new server id, same state dir and database)."""
    _drill("start", number, state_dir, name, "bcm serve running")


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
        target = BmcTarget(
            v.name, BmcProtocol(v.bmc.kind), parse_bmc_address(v.bmc.address), v.bmc.user, v.bmc.password
        )
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
    c.patch(
        f"/api/v1/nodes/{node}",
        {"bmc_address": v.bmc.address, "bmc_protocol": v.bmc.kind, "bmc_user": v.bmc.user},
    )
    c.request("PUT", "/api/v1/nodes/bmc-password", json={"nodes": node, "password": v.bmc.password})
    accounting.add_slurm_nodes(_lab(state_dir, name).state_dir, [node])
    out.print(f"{node}: BMC of {v.name} ({v.bmc.kind} {v.bmc.address})")
