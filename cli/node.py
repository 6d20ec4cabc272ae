"""`bcm node …`: register, list, show, change, remove nodes and send them verbs."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cli.client import CliError
from cli.common import JsonOpt, client, follow
from cli.render import emit_json, err, gib, kv, out, table

app = typer.Typer(
    help="Nodes: register, list, show, change, remove, and lifecycle verbs.", no_args_is_help=True
)
Nodes = Annotated[str, typer.Argument(help="node name or hostlist, e.g. gpu[01-16]")]


@app.command("add")
def add(
    nodes: Nodes,
    mac: Annotated[str | None, typer.Option(help="MAC of the first node; the rest count up")] = None,
    ip: Annotated[str | None, typer.Option(help="IP of the first node; the rest count up")] = None,
    category: Annotated[str | None, typer.Option()] = None,
    image: Annotated[str | None, typer.Option()] = None,
    as_json: JsonOpt = False,
) -> None:
    """Register one node or a hostlist of nodes."""
    body = {"nodes": nodes, "mac": mac, "ip": ip, "category": category, "image": image}
    created = client().post("/api/v1/nodes/bulk", {k: v for k, v in body.items() if v is not None})
    if as_json:
        emit_json(created)
    else:
        out.print(f"registered {len(created)} node(s)")
        _node_table(created)


def _node_table(items: list[dict[str, Any]]) -> None:
    rows = []
    for n in items:
        iface = n["interfaces"][0] if n["interfaces"] else {}
        state = n["provision_state"] + (f"→{n['target_state']}" if n.get("target_state") else "")
        rows.append(
            (
                n["name"],
                state,
                n.get("category"),
                iface.get("mac"),
                iface.get("ip"),
                n.get("gpu_count") or "",
                n.get("wlm_state"),
                n.get("power_state"),
                (n.get("last_error") or "")[:60],
            )
        )
    table(None, ["NAME", "STATE", "CATEGORY", "MAC", "IP", "GPUS", "WLM", "POWER", "LAST ERROR"], rows)


@app.command("list")
def list_nodes(
    nodes: Annotated[str | None, typer.Argument(help="hostlist filter")] = None,
    state: Annotated[str | None, typer.Option(help="only nodes in this state")] = None,
    category: Annotated[str | None, typer.Option()] = None,
    limit: Annotated[int, typer.Option(help="at most this many rows (0: all)")] = 0,
    as_json: JsonOpt = False,
) -> None:
    """List nodes (all pages unless --limit)."""
    c, offset = client(), 0
    items: list[dict[str, Any]] = []
    while True:
        page_size = 1000 if not limit else min(1000, limit - len(items))
        page = c.get(
            "/api/v1/nodes", nodes=nodes, state=state, category=category, limit=page_size, offset=offset
        )
        items += page["items"]
        offset += len(page["items"])
        if not page["items"] or offset >= page["total"] or (limit and len(items) >= limit):
            break
    if as_json:
        emit_json(items)
    else:
        _node_table(items)


@app.command("show")
def show(name: str, as_json: JsonOpt = False) -> None:
    """One node with its hardware."""
    c = client()
    node = c.get(f"/api/v1/nodes/{name}")
    hw = c.get(f"/api/v1/nodes/{name}/hardware")
    if as_json:
        emit_json({**node, "hardware": hw})
        return
    iface = ", ".join(f"{i['name']} {i['mac'] or '-'} {i['ip'] or '-'}" for i in node["interfaces"])
    facts = hw.get("facts") or {}
    cpu, mem = facts.get("cpu") or {}, facts.get("memory_bytes")
    os_, dmi, bmc = facts.get("os") or {}, facts.get("dmi") or {}, facts.get("bmc") or {}
    kv(
        node["name"],
        [
            (
                "state",
                node["provision_state"] + (f" → {node['target_state']}" if node["target_state"] else ""),
            ),
            ("category", node["category"]),
            ("interfaces", iface),
            ("wlm", node["wlm_state"]),
            ("power", node.get("power_state")),
            ("running image", node.get("running_image")),
            ("installed", _installed(node)),
            (
                "runs",
                f"{node['booted_image']} from {node['booted_from']}" if node.get("booted_image") else None,
            ),
            (
                "bmc",
                " ".join(filter(None, [node.get("bmc_address"), node["effective"].get("bmc_protocol")]))
                or None,
            ),
            ("last error", node["last_error"]),
            *[(f"effective {k}", v) for k, v in node["effective"].items()],
            (
                "system",
                " ".join(
                    filter(None, [dmi.get("sys_vendor"), dmi.get("product_name"), dmi.get("product_serial")])
                )
                or None,
            ),
            (
                "cpu",
                f"{cpu.get('model')} ({cpu.get('sockets')} sockets, {cpu.get('cores')} cores, "
                f"{cpu.get('threads')} threads)"
                if cpu.get("model")
                else None,
            ),
            ("memory", f"{gib(mem)} GiB" if mem else None),
            (
                "os",
                f"{os_.get('pretty_name') or os_.get('name')}, kernel {facts.get('kernel')}" if os_ else None,
            ),
            ("bmc", bmc.get("ip_address")),
            ("gpu tool", facts.get("gpu_tool")),
            ("inventoried", hw.get("inventoried_at")),
        ],
    )
    if facts.get("nics"):
        table(
            "NICs",
            ["NAME", "MAC", "STATE", "SPEED Mb/s", "ADDRESSES"],
            [
                (n["name"], n["mac"], n["state"], n["speed_mbps"], " ".join(n["addresses"]))
                for n in facts["nics"]
            ],
        )
    if facts.get("disks"):
        table(
            "Disks",
            ["NAME", "SIZE GiB", "TYPE", "MODEL", "SERIAL"],
            [
                (
                    d["name"],
                    gib(d.get("size_bytes"), 0) if d.get("size_bytes") else None,
                    d["type"],
                    d["model"],
                    d["serial"],
                )
                for d in facts["disks"]
            ],
        )
    if hw.get("gpus"):
        table(
            "GPUs",
            ["IDX", "NAME", "UUID", "MEMORY MiB", "PCI", "DRIVER", "HEALTH"],
            [
                (
                    g["index"],
                    g["name"],
                    g["uuid"],
                    g["memory_mib"],
                    g["pci_bus_id"],
                    g["driver_version"],
                    g.get("verdict"),
                )
                for g in hw["gpus"]
            ],
        )


@app.command("set")
def set_node(
    nodes: Nodes,
    category: Annotated[str | None, typer.Option()] = None,
    image: Annotated[str | None, typer.Option()] = None,
    kernel_args: Annotated[str | None, typer.Option()] = None,
    wlm_role: Annotated[str | None, typer.Option()] = None,
    comment: Annotated[str | None, typer.Option()] = None,
) -> None:
    """Change settings of one or more nodes."""
    body = {
        k: v
        for k, v in dict(
            category=category, image=image, kernel_args=kernel_args, wlm_role=wlm_role, comment=comment
        ).items()
        if v is not None
    }
    c = client()
    names = [n["name"] for n in c.get("/api/v1/nodes", nodes=nodes, limit=1000)["items"]]
    for name in names:
        c.patch(f"/api/v1/nodes/{name}", body)
    out.print(f"updated {len(names)} node(s)")


def _installed(node: dict[str, Any]) -> str | None:
    """What the node's disk holds (#30): image:version and its state, or nothing."""
    if not node.get("install_state"):
        return None
    what = node.get("installed_image") or "-"
    when = f", {str(node['installed_at'])[:19]}" if node.get("installed_at") else ""
    return f"{what} ({node['install_state']}{when})"


@app.command("install")
def install(
    name: str,
    mode: Annotated[str | None, typer.Option("--mode", help="stateless, full, auto or nosync (#30)")] = None,
    inherit: Annotated[bool, typer.Option("--inherit", help="use the category's mode again")] = False,
    next_mode: Annotated[str | None, typer.Option("--next", help="the mode of the next boot only")] = None,
    data_node: Annotated[
        bool | None,
        typer.Option("--data-node/--no-data-node", help="a data node refuses full without --confirm-wipe"),
    ] = None,
    confirm_wipe: Annotated[bool, typer.Option(help="admin: this data node may be wiped (once)")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Set (or show) the node's install mode: what its disk holds and what it runs."""
    body: dict[str, Any] = {}
    if mode is not None:
        body["install_mode"] = mode
    elif inherit:
        body["install_mode"] = None
    if next_mode is not None:
        body["next_install_mode"] = next_mode
    if data_node is not None:
        body["data_node"] = data_node
    if confirm_wipe:
        body["confirm_wipe"] = True
    c = client()
    node = c.put(f"/api/v1/nodes/{name}/install", body) if body else c.get(f"/api/v1/nodes/{name}")
    fields = (
        "install_mode",
        "next_install_mode",
        "data_node",
        "wipe_confirmed",
        "install_state",
        "installed_image",
        "installed_at",
        "install_bytes",
        "booted_image",
        "booted_from",
    )
    if as_json:
        emit_json(
            {"effective_install_mode": node["effective"]["install_mode"], **{f: node.get(f) for f in fields}}
        )
        return
    kv(
        name,
        [
            (
                "install mode",
                node["effective"]["install_mode"] + ("" if node["install_mode"] else " (inherited)"),
            ),
            ("next boot", node["next_install_mode"]),
            (
                "data node",
                "yes" + (" (wipe confirmed)" if node["wipe_confirmed"] else "")
                if node["data_node"]
                else None,
            ),
            ("installed", _installed(node)),
            (
                "last install wrote",
                f"{node['install_bytes']} bytes" if node.get("install_bytes") is not None else None,
            ),
            (
                "runs",
                f"{node['booted_image']} from {node['booted_from']}" if node.get("booted_image") else None,
            ),
        ],
    )


@app.command("rm")
def remove(
    nodes: Nodes, yes: Annotated[bool, typer.Option("--yes", "-y", help="do not ask")] = False
) -> None:
    """Remove nodes from the database."""
    if not yes:
        typer.confirm(f"remove {nodes}?", abort=True)
    gone = client().delete("/api/v1/nodes", nodes=nodes)
    out.print(f"removed {len(gone['deleted'])} node(s)")


@app.command("rekey")
def rekey(
    name: Annotated[str, typer.Argument(help="one node")],
    key: Annotated[
        str | None, typer.Option(help="the node's new host key line; without it the pin is cleared")
    ] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="do not ask")] = False,
) -> None:
    """Replace a node's pinned SSH host key (admin; audited). Without --key, the next contact pins anew."""
    if key is None and not yes:
        typer.confirm(
            f"clear the pinned host key of {name}? the next host to answer there is trusted", abort=True
        )
    client().post(f"/api/v1/nodes/{name}/rekey", {"ssh_host_key": key})
    out.print(f"{name}: host key {'replaced' if key else 'cleared; the next contact pins it'}")


@app.command("trust")
def trust(
    nodes: Nodes,
    password_stdin: Annotated[
        bool, typer.Option("--password-stdin", help="read the root password from stdin")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Install the server's SSH key on nodes, logging in once with a root password."""
    import sys

    from cli.client import CliError

    if not password_stdin:
        raise CliError("give the password on stdin with --password-stdin (it is never taken as an argument)")
    password = sys.stdin.readline().rstrip("\n")
    if not password:
        raise CliError("no password on stdin")
    res = client().post("/api/v1/nodes/trust", {"nodes": nodes, "password": password})
    if as_json:
        emit_json(res)
    else:
        table(
            None,
            ["NODE", "RESULT", "DETAIL"],
            [(n, r["status"], r["message"]) for n, r in sorted(res["nodes"].items())],
        )
    if any(r["status"] != "ok" for r in res["nodes"].values()):
        raise typer.Exit(1)


def _verb(verb: str, help_text: str) -> None:
    def command(
        nodes: Nodes,
        reason: Annotated[str | None, typer.Option(help="recorded with the action")] = None,
        wait: Annotated[bool, typer.Option(help="follow a started operation to its end")] = True,
        as_json: JsonOpt = False,
    ) -> None:
        c = client()
        res = c.post(f"/api/v1/nodes/actions/{verb}", {"nodes": nodes, "reason": reason})
        if res.get("operation_id") is None:
            if as_json:
                emit_json(res)
            else:
                table(
                    None,
                    ["NODE", "RESULT", "STATE"],
                    [(n["name"], n["status"], n.get("state")) for n in res["nodes"]],
                )
            return
        follow(c, res["operation_id"], wait=wait, as_json=as_json)

    command.__doc__ = help_text
    app.command(verb)(command)


def _boot_verb(verb: str, help_text: str) -> None:
    def command(
        nodes: Nodes,
        reason: Annotated[str | None, typer.Option(help="recorded with the action")] = None,
        wait: Annotated[bool, typer.Option(help="wait until every node has booted or failed")] = False,
        timeout: Annotated[float, typer.Option(help="seconds --wait waits at most", min=1, max=86400)] = 2400,
        rekey: Annotated[
            bool,
            typer.Option(
                "--rekey",
                help="admin: bcm makes new SSH host keys (audited as node.rekey); else a pinned key is kept",
            ),
        ] = False,
        as_json: JsonOpt = False,
    ) -> None:
        c = client()
        body: dict[str, Any] = {"nodes": nodes, "reason": reason}
        if rekey:
            body["rekey"] = True
        res = c.post(f"/api/v1/nodes/actions/{verb}", body)
        if not wait:
            if as_json:
                emit_json(res)
            else:
                table(
                    None,
                    ["NODE", "RESULT", "STATE"],
                    [(n["name"], n["status"], n.get("state")) for n in res["nodes"]],
                )
            return
        names = [n["name"] for n in res["nodes"]]
        deadline = time.monotonic() + timeout
        states: dict[str, dict[str, Any]] = {}
        columns = (
            TextColumn("{task.description}", style="bold", markup=False),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=err, disable=as_json) as bar:
            task = bar.add_task(f"{verb} {nodes}", total=len(names))
            while True:
                page = c.get("/api/v1/nodes", nodes=nodes, limit=1000)
                states = {n["name"]: n for n in page["items"]}
                done = [n for n in names if states.get(n, {}).get("provision_state") != "provisioning"]
                bar.update(task, completed=len(done))
                if len(done) == len(names) or time.monotonic() > deadline:
                    break
                time.sleep(2)
        rows = [
            (n, states.get(n, {}).get("provision_state"), states.get(n, {}).get("last_error") or "")
            for n in names
        ]
        if as_json:
            emit_json(
                {
                    "verb": verb,
                    "nodes": [dict(zip(("name", "state", "last_error"), r, strict=True)) for r in rows],
                }
            )
        else:
            table(None, ["NODE", "STATE", "ERROR"], rows)
        if any(state != "booted" and state != "ready" for _, state, _ in rows):
            err.print(
                f"error: not every node booted ({sum(1 for r in rows if r[1] == 'provisioning')} still "
                "provisioning)",
                style="red",
                soft_wrap=True,
            )
            raise typer.Exit(1)

    command.__doc__ = help_text
    app.command(verb)(command)


@app.command("discovered")
def discovered(
    wait: Annotated[
        int, typer.Option(help="wait until at least this many machines were discovered", min=0)
    ] = 0,
    timeout: Annotated[float, typer.Option(help="seconds --wait waits at most", min=1, max=86400)] = 1200,
    as_json: JsonOpt = False,
) -> None:
    """Machines that PXE-booted the discovery image and wait to be assigned."""
    c = client()
    deadline = time.monotonic() + timeout
    items = c.get("/api/v1/discovered")
    while len(items) < wait:
        if time.monotonic() > deadline:
            raise CliError(f"{len(items)} machine(s) discovered after {timeout:.0f}s, not {wait}")
        time.sleep(2)
        items = c.get("/api/v1/discovered")
    if as_json:
        emit_json(items)
        return
    table(
        None,
        ["NAME", "MAC", "CPU", "THREADS", "MEMORY GiB", "DISKS", "NVIDIA PCI", "PRODUCT"],
        [
            (
                d["name"],
                d["mac"],
                d.get("cpu_model"),
                d.get("threads"),
                gib(d.get("memory_bytes")) if d.get("memory_bytes") else None,
                d["disks"],
                d["nvidia_pci_devices"],
                d.get("product"),
            )
            for d in items
        ],
    )


@app.command("wait")
def wait_for(
    nodes: Annotated[str, typer.Argument(help="node name or hostlist, e.g. zt[01-03]")],
    state: Annotated[
        str, typer.Option(help="the state every node must reach (ready, booted, failed, …)")
    ] = "ready",
    timeout: Annotated[float, typer.Option(help="seconds to wait at most", min=1, max=86400)] = 1800,
    inventoried: Annotated[bool, typer.Option(help="…and inventoried (its hardware facts stored)")] = False,
    idle: Annotated[
        bool, typer.Option(help="…and held by no running operation (an inventory, a deploy)")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Wait until every named node is in STATE (nodes that do not exist yet, e.g. zero-touch names not handed
    out, are waited for too); exit non-zero naming each node that failed meanwhile or when time runs out."""
    from bcm.domain.naming import expand_hostlist

    c = client()
    try:
        wanted = expand_hostlist(nodes)
    except Exception as exc:  # noqa: BLE001  (InvalidInput: one readable line)
        raise CliError(str(getattr(exc, "message", exc))) from None
    if len(wanted) > 1000:
        raise CliError(f"{len(wanted)} nodes: wait for at most 1000 at once")
    deadline = time.monotonic() + timeout
    seen: dict[str, str] = {}
    while True:  # bounded by timeout
        items = c.get("/api/v1/nodes", nodes=nodes, limit=len(wanted))["items"]
        by_name = {n["name"]: n for n in items}
        for name, n in sorted(by_name.items()):
            if seen.get(name) != n["provision_state"]:
                seen[name] = n["provision_state"]
                if not as_json:
                    err.print(f"{name}: {n['provision_state']}")
        failed = {k: v for k, v in by_name.items() if v["provision_state"] == "failed" and state != "failed"}
        if failed:
            raise CliError(
                "; ".join(
                    f"{k} failed: {(v.get('last_error') or '').splitlines()[0][:200]}"
                    for k, v in sorted(failed.items())
                )
            )

        def done(n: dict[str, Any]) -> bool:
            return (
                n["provision_state"] == state
                and (not inventoried or bool(n.get("inventoried_at")))
                and (not idle or not n.get("locked_by"))
            )

        if len(by_name) == len(wanted) and all(done(n) for n in by_name.values()):
            break
        if time.monotonic() > deadline:
            late = [f"{k} ({seen.get(k, 'not there yet')})" for k in wanted if seen.get(k) != state]
            raise CliError(f"not {state} after {timeout:.0f}s: {', '.join(late[:20])}")
        time.sleep(3)
    if as_json:
        emit_json([by_name[n] for n in wanted])
    else:
        out.print(f"{nodes}: {state}")


@app.command("assign")
def assign(
    mac: Annotated[str, typer.Argument(help="the discovered machine's MAC (bcm node discovered)")],
    name: Annotated[str, typer.Option(help="the node's name")],
    category: Annotated[str | None, typer.Option(help="its category")] = None,
    image: Annotated[str | None, typer.Option(help="the image it boots (else its category's)")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Accept a discovered machine as a node: it becomes registered, ready to provision."""
    node = client().post(
        "/api/v1/discovered/assign", {"mac": mac, "name": name, "category": category, "image": image}
    )
    if as_json:
        emit_json(node)
    else:
        out.print(f"{mac} is node {node['name']} ({node['provision_state']})")


_boot_verb(
    "provision",
    "Network-boot nodes into their image (BMC: next boot PXE, power-cycle; wait for the callback).",
)
_boot_verb("reimage", "Network-boot running nodes into a fresh copy of their image.")

for _v, _h in [
    ("register", "Accept discovered nodes."),
    ("inventory", "Collect hardware facts over SSH (an operation with a progress bar)."),
    ("drain", "Stop scheduling jobs on nodes."),
    ("resume", "Return drained nodes to service."),
    ("retire", "Take nodes out of service for good."),
]:
    _verb(_v, _h)
