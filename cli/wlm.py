"""`bcm wlm …`: deploy a workload manager onto inventoried nodes, show it, verify it."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from cli.client import CliError
from cli.common import JsonOpt, client, follow, print_failure
from cli.render import emit_json, err, kv, out, table

app = typer.Typer(
    help="Workload managers: deploy Slurm or Kubernetes, show status, run the verification job.",
    no_args_is_help=True,
)
deploy_app = typer.Typer(help="Deploy a workload manager.", no_args_is_help=True)
app.add_typer(deploy_app, name="deploy")

Name = Annotated[str | None, typer.Argument(help="cluster name (default: the only one)")]


def _settings(pairs: list[str]) -> dict[str, Any]:
    out_: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CliError(f"--set wants KEY=VALUE, got {pair!r}")
        out_[key.strip()] = {"true": True, "false": False}.get(value.lower(), value)
    return out_


@deploy_app.command("slurm")
def deploy_slurm(
    controller: Annotated[str, typer.Option(help="node that runs slurmctld and slurmdbd")],
    nodes: Annotated[str, typer.Option(help="compute nodes, a hostlist like gpu[01-16]")],
    name: Annotated[str, typer.Option(help="Slurm cluster name")] = "slurm",
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="a Slurm setting KEY=VALUE (repeatable), e.g. storage_loc=acct"),
    ] = None,
    storage_pass_stdin: Annotated[
        bool, typer.Option("--storage-pass-stdin", help="read the accounting database password from stdin")
    ] = False,
    no_verify: Annotated[bool, typer.Option("--no-verify", help="skip the verification job")] = False,
    no_wait: Annotated[bool, typer.Option("--no-wait", help="print the operation id and return")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Render Slurm from the database, run the Ansible roles, wait for the nodes, run the verification job."""
    body: dict[str, Any] = {
        "name": name,
        "controller": controller,
        "nodes": nodes,
        "settings": _settings(set_ or []),
        "verify": not no_verify,
    }
    if storage_pass_stdin:
        body["storage_pass"] = sys.stdin.readline().rstrip("\n")
    _lab_defaults(body)
    c = client()
    started = c.post("/api/v1/wlm/slurm/deploy", body)
    follow(c, started["operation_id"], wait=not no_wait, as_json=as_json, show=_show)


@deploy_app.command("kubernetes")
def deploy_kubernetes(
    control_plane: Annotated[str, typer.Option(help="node that runs the API server, etcd and Kueue")],
    nodes: Annotated[str, typer.Option(help="nodes whose kubelets join, a hostlist like gpu[01-16]")],
    name: Annotated[str, typer.Option(help="cluster name")] = "kubernetes",
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="a setting KEY=VALUE (repeatable), e.g. gpu_quota=16 or mode=lab"),
    ] = None,
    no_verify: Annotated[bool, typer.Option("--no-verify", help="skip the verification job")] = False,
    no_wait: Annotated[bool, typer.Option("--no-wait", help="print the operation id and return")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Render Kubernetes from the database, run the Ansible roles (kubeadm, or the lab's control plane and
    simulated kubelets), label the nodes from the inventory, set up Kueue, run the verification job."""
    body: dict[str, Any] = {
        "name": name,
        "controller": control_plane,
        "nodes": nodes,
        "settings": _settings(set_ or []),
        "verify": not no_verify,
    }
    _lab_kubernetes(body)
    c = client()
    started = c.post("/api/v1/wlm/kubernetes/deploy", body)
    follow(c, started["operation_id"], wait=not no_wait, as_json=as_json, show=_show)


LAB_K8S = {"mode": "lab"}  # the lab's address ranges come with the mode (bcm.domain.kubernetes)


def _lab_kubernetes(body: dict[str, Any]) -> None:
    """A cluster made only of one lab's nodes runs the lab's control plane and kwok kubelets, on the lab's
    address space; explicit ``--set`` values win."""
    from bcm.domain.naming import expand_hostlist
    from bcm.lab import accounting
    from cli.lab import lab_state_root

    wanted = {body["controller"], *expand_hostlist(body["nodes"])}
    root = lab_state_root()
    for found in sorted(root.glob(f"*/{accounting.SETTINGS_FILE}")) if root.is_dir() else []:
        lab_nodes = accounting.slurm_defaults(found.parent)[0]
        if wanted <= set(lab_nodes):
            body["settings"] = {**LAB_K8S, **body["settings"]}
            err.print(f"lab {found.parent.name}: lab control plane and kwok kubelets")
            return


def _lab_defaults(body: dict[str, Any]) -> None:
    """A cluster made only of one lab's nodes gets that lab's Slurm settings and accounting database.

    `bcm lab up` records them (settings in ``slurm.json``, the database password 0600 beside it);
    explicit ``--set`` values and ``--storage-pass-stdin`` win.
    """
    from bcm.domain.naming import expand_hostlist
    from bcm.lab import accounting
    from cli.lab import lab_state_root

    wanted = {body["controller"], *expand_hostlist(body["nodes"])}
    root = lab_state_root()
    for found in sorted(root.glob(f"*/{accounting.SETTINGS_FILE}")) if root.is_dir() else []:
        nodes, settings, password = accounting.slurm_defaults(found.parent)
        if not wanted <= set(nodes):
            continue
        if "storage_user" not in settings and "storage_pass" not in body:
            raise CliError(
                f"lab {found.parent.name} has no accounting database: MariaDB is not installed on this "
                "machine (apt-get install mariadb-server), then run `bcm lab up` again"
            )
        body["settings"] = {**settings, **body["settings"]}
        if password is not None and "storage_pass" not in body:
            body["storage_pass"] = password
        err.print(
            f"lab {found.parent.name}: lab Slurm settings and accounting database {settings.get('storage_loc')}"
        )
        return


def _show(op: dict[str, Any], as_json: bool) -> None:
    if as_json:
        emit_json(op)
    else:
        rows = [
            (
                n,
                r.get("status"),
                r.get("changed", ""),
                r.get("slurm_state") or r.get("kubernetes_state") or r.get("cuda_visible_devices") or "",
                (r.get("error") or "")[:80],
            )
            for n, r in sorted((op.get("results") or {}).items())
        ]
        table(f"{op['kind']} #{op['id']}: {op['state']}", ["HOST", "STATUS", "CHANGED", "WLM", "ERROR"], rows)
        tail = [
            line
            for line in (op.get("log") or "").splitlines()
            if line.startswith(("verify:", "changed=", "error:"))
        ]
        for line in tail:
            out.print(line)
        if op["state"] != "succeeded":
            print_failure(op)


def _pick(name: str | None) -> str:
    if name:
        return name
    clusters = client().get("/api/v1/wlm")
    if len(clusters) == 1:
        return str(clusters[0]["name"])
    if not clusters:
        raise CliError("no workload-manager cluster yet (deploy one with `bcm wlm deploy slurm`)")
    raise CliError(f"several clusters ({', '.join(c['name'] for c in clusters)}); name one")


@app.command("status")
def status(
    name: Name = None,
    sync: Annotated[bool, typer.Option(help="read node states from the workload manager first")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Show a cluster, its last verification and each node's state in its workload manager."""
    c = client()
    cluster = _pick(name)
    if sync:
        c.post(f"/api/v1/wlm/{cluster}/sync")
    info = c.get(f"/api/v1/wlm/{cluster}")
    if as_json:
        emit_json(info)
        return
    verify = info.get("last_verify") or {}
    kv(
        f"{info['kind']} cluster {info['name']}",
        [
            ("state", info["state"]),
            ("controller", info["controller"]),
            ("nodes", info["nodes"]),
            ("last error", info.get("last_error")),
            ("deployed at", info.get("deployed_at")),
            (
                "last verify",
                None
                if info.get("last_verify_ok") is None
                else ("passed" if info["last_verify_ok"] else "FAILED"),
            ),
            ("verify detail", verify.get("message")),
            ("verify allocation", verify.get("alloc_tres")),
            ("synced at", info.get("synced_at")),
        ],
    )
    table(
        None,
        ["NODE", "WLM STATE", "PROVISION STATE", "GPUS"],
        [(m["name"], m.get("wlm_state"), m["provision_state"], m["gpus"]) for m in info["members"]],
    )


@app.command("rm")
def remove(name: Annotated[str, typer.Argument(help="cluster name")]) -> None:
    """Forget a cluster in bcm: its nodes stay registered and may join another one; nothing running on
    them is stopped."""
    client().delete(f"/api/v1/wlm/{name}")
    out.print(f"cluster {name} removed")


@app.command("verify")
def verify(name: Name = None, as_json: JsonOpt = False) -> None:
    """Run one GPU step on every node of the cluster (all or nothing) and record the result."""
    c = client()
    started = c.post(f"/api/v1/wlm/{_pick(name)}/verify")
    follow(c, started["operation_id"], as_json=as_json, show=_show)
