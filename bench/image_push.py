"""Benchmark: push a ~500 MB image change to N lab SSH nodes with `bcm image push --apply`, and the same
change onto the same nodes in the same starting state with a plain sequential `rsync` loop.

The image is `pushbench`: the lab nodes' own image (`lab`, what every node already runs) plus a layer
whose `post` writes --size-mb MiB of incompressible data (--files files under /opt/bcm-bench), so the
change pushed is that data. Its layers are cached by content under /var/cache/bcm/images, so only the
first run (or new --size-mb/--files/--parent) builds. bcm's push goes through a real `bcm serve` and
the CLI, after `bcm node inventory` pinned the nodes' host keys. Then the lab is brought down and up
again (fresh node overlays, the same starting state) and the baseline pushes the same tree to each node
in turn with exactly the rsync and ssh command lines bcm runs (bcm.drivers.sync.rsync_argv and
ssh_command: same flags, excludes, key, pinned host keys and ssh options).

Needs root (network namespaces; the lab is `bcmbpush` on 198.18.7.0/24) and, for the first build, the
Debian mirror. Prints times and the ratio; asserts nothing about speed (goal: bcm >= 4x faster on 8).
Usage: .venv/bin/python bench/image_push.py [--nodes 8] [--size-mb 500] [--files 50] [--parent lab]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from bcm.devserver import BCM, REPO, Server
from bcm.domain import image_recipe
from bcm.domain.naming import fold_hostlist
from bcm.drivers import imagebuild, sync
from bcm.lab import Lab, LabNode
from bcm.settings import SshSettings

CACHE = Path(os.environ.get("BCM_IMAGE_CACHE", "/var/cache/bcm/images"))
LAB_NAME = "bcmbpush"  # not the tests' labs (bcmtest, bcmpush, 198.18.1.0/24 and up) nor bench/inventory.py's
SUBNET = "198.18.7.0/24"
IMAGE = "pushbench"
BLOB_DIR = "/opt/bcm-bench"
BUILD_WAIT_S = 3600
PUSH_WAIT_S = 1800
CLI_WAIT_S = 120
# bcm's own defaults for the ssh/rsync command lines (BCM_SSH__* is not set for the server below)
SSH = SshSettings()
RSYNC_ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "HOME": "/nonexistent"}


def recipe(parent: str, size_mb: int, files: int) -> dict[str, Any]:
    per = max(1, size_mb // files)
    return {
        "name": IMAGE,
        "description": f"{parent} plus {files} x {per} MiB of random data (bench/image_push.py)",
        "parent": parent,
        "post": [
            f"mkdir -p {BLOB_DIR}",
            f"for i in $(seq -w 1 {files}); do head -c {per}M /dev/urandom > {BLOB_DIR}/blob$i; done",
        ],
        # what bcm.lab itself writes on its nodes: the keys we log in with and the lab's sshd config
        "push_exclude": ["/root/.ssh/", "/etc/ssh/sshd_config", "/etc/hosts"],
    }


def cli(srv: Server, *args: str, timeout: float = CLI_WAIT_S) -> str:
    done = subprocess.run(
        [*BCM, *args], env=srv.env(), cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        sys.exit(
            f"bcm {' '.join(args)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return done.stdout


def wait_op(http: httpx.Client, op_id: int, limit_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + limit_s
    while True:  # bounded by limit_s
        op: dict[str, Any] = http.get(f"/api/v1/operations/{op_id}").json()
        if op["state"] not in ("pending", "running"):
            return op
        if time.monotonic() > deadline:
            sys.exit(f"operation {op_id} still {op['state']} after {limit_s:.0f} s")
        time.sleep(1)


def warm(tree: Path) -> None:
    """Read the pushed data once (page cache), then flush dirty pages: both pushes start alike."""
    for f in sorted((tree / BLOB_DIR.lstrip("/")).iterdir()):
        with open(f, "rb") as fh:
            while fh.read(1 << 22):
                pass
    os.sync()


def check_nodes(lab: Lab, nodes: list[LabNode], expected: int) -> str:
    """Every node holds the data (sizes only) and kept its own hostname (an excluded path)."""
    bad = []
    for n in nodes:
        sizes = lab.run(n.name, ["sh", "-c", f"stat -c %s {BLOB_DIR}/*"], timeout=30)
        total = sum(int(s) for s in sizes.stdout.split()) if sizes.returncode == 0 else -1
        host = lab.run(n.name, ["cat", "/etc/hostname"], timeout=30).stdout.strip()
        if total != expected or host != n.name:
            bad.append(f"{n.name}: {total} bytes, hostname {host!r}")
    return "all nodes hold the data" if not bad else "MISMATCH: " + "; ".join(bad)


def bcm_push(srv: Server, names: str) -> tuple[float, dict[str, Any]]:
    t = time.perf_counter()
    out = cli(srv, "image", "push", IMAGE, names, "--apply", "--json", timeout=PUSH_WAIT_S)
    dt = time.perf_counter() - t
    return dt, json.loads(out)


def rsync_loop(
    tree: Path, nodes: list[LabNode], excludes: list[str], key_file: Path, tmp: Path
) -> tuple[float, list[sync.PushResult]]:
    """One node after another, with the very argv bcm builds for each node."""
    known_hosts = tmp / "known_hosts"
    targets = [sync.PushTarget(n.name, n.ip, n.host_key_public, SSH.port) for n in nodes]
    known_hosts.write_text("".join(f"{t.name} {' '.join(t.host_key.split()[:2])}\n" for t in targets))
    results = []
    t0 = time.perf_counter()
    for target in targets:
        ssh = sync.ssh_command(
            target,
            key_file=key_file,
            known_hosts=known_hosts,
            username=SSH.username,
            connect_timeout_s=SSH.connect_timeout_s,
        )
        argv = sync.rsync_argv(
            tree, target, excludes, ssh, dry_run=False, io_timeout_s=max(30, int(SSH.connect_timeout_s * 6))
        )
        t = time.perf_counter()
        done = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=RSYNC_ENV,
            timeout=sync.DEFAULT_TIMEOUT_S,
            check=False,
        )
        status, error = sync.classify(done.returncode, done.stderr)
        changed, sample, size = sync.parse_output(done.stdout)
        results.append(
            sync.PushResult(target.name, status, changed, sample, size, error, time.perf_counter() - t)
        )
    return time.perf_counter() - t0, results


def summary(results: list[tuple[str, str, int, int | None, float]]) -> str:
    oks = sum(status == "ok" for _, status, _, _, _ in results)
    changed = {c for _, _, c, _, _ in results}
    sent = {b for _, _, _, b, _ in results}
    slowest = max(d for _, _, _, _, d in results)
    mib = ", ".join(f"{b / 2**20:.0f}" if b is not None else "?" for b in sorted(sent, key=lambda b: b or 0))
    return (
        f"{oks}/{len(results)} ok, {'/'.join(str(c) for c in sorted(changed))} item(s) changed, "
        f"{mib} MiB per node, slowest node {slowest:.1f} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--size-mb", type=int, default=500, help="MiB of random data in the change")
    ap.add_argument("--files", type=int, default=50, help="how many files the data is split into")
    ap.add_argument(
        "--parent", default="lab", help="the layer below pushbench (default: lab, what the nodes run)"
    )
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/image_push.py needs root (network namespaces)")
    if args.files < 1 or args.size_mb < 1 or not 1 <= args.nodes <= 200:
        sys.exit("--nodes 1..200, --size-mb and --files at least 1")
    expected = max(1, args.size_mb // args.files) * args.files * 2**20

    tmp = Path(tempfile.mkdtemp(prefix="bcm-bench-push-"))
    recipes = tmp / "recipes"
    recipes.mkdir()
    for f in (REPO / "images").glob("*.yaml"):
        shutil.copy(f, recipes / f.name)
    (recipes / f"{IMAGE}.yaml").write_text(
        yaml.safe_dump(recipe(args.parent, args.size_mb, args.files), sort_keys=False)
    )
    excludes = image_recipe.push_excludes(image_recipe.chain(image_recipe.load_recipes(recipes), IMAGE))
    srv = Server(
        tmp / "state",
        extra_env={
            "BCM_IMAGES__RECIPES_DIR": str(recipes),
            "BCM_IMAGES__CACHE_DIR": str(CACHE),
            "BCM_POWER__POLL_INTERVAL_S": "0",
        },
    )
    srv.start()
    lab = Lab(tmp / "lab", LAB_NAME, subnet=SUBNET)
    try:
        http = httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {srv.token()}"}, timeout=60)
        layers = CACHE / "layers"
        cached = {p.name for p in layers.iterdir()} if layers.is_dir() else set()
        t = time.perf_counter()
        started = json.loads(cli(srv, "image", "build", IMAGE, "--no-wait", "--json"))
        build = wait_op(http, started["operation_id"], BUILD_WAIT_S)
        if build["state"] != "succeeded":
            sys.exit(f"build of {IMAGE} {build['state']}: {build['error'] or build['log'][-3000:]}")
        image = http.get(f"/api/v1/images/{IMAGE}").json()
        tree = imagebuild.layer_dir(CACHE, image["layer_key"]) / "rootfs"
        how = "its layer was cached" if image["layer_key"] in cached else "its layer built now"
        if not (tree / BLOB_DIR.lstrip("/")).is_dir():
            sys.exit(f"the cached tree {tree} of {IMAGE} is missing or holds no {BLOB_DIR}")
        print(f"image {IMAGE}:{image['version']} ready in {time.perf_counter() - t:.1f} s ({how})")
        print(f"  tree {tree}; change: {args.files} file(s), {expected / 2**20:.0f} MiB of random data")
        print(f"  excludes: {' '.join(sync.ALWAYS_EXCLUDE)} {' '.join(excludes)}")

        pub = http.get("/api/v1/ssh/public-key").json()["public_key"]
        t = time.perf_counter()
        nodes = lab.up(args.nodes, [pub])
        print(f"lab: {len(nodes)} SSH nodes up in {time.perf_counter() - t:.1f} s")
        for n in nodes:  # registered without a key; the first inventory pins it, as in production
            http.post("/api/v1/nodes", json={"name": n.name, "mac": n.mac, "ip": n.ip}).raise_for_status()
        names = fold_hostlist([n.name for n in nodes])
        cli(srv, "node", "inventory", names, "--json")
        print(f"  registered and inventoried {names} (host keys pinned)")

        cpus = os.cpu_count() or 1
        print(f"\npush of the change to {len(nodes)} nodes ({cpus} CPU(s), same machine, one after another):")
        warm(tree)
        t_bcm, op = bcm_push(srv, names)
        bcm_rows = [
            (name, r["status"], r.get("changed", 0), r.get("bytes"), r.get("duration_s", 0.0))
            for name, r in sorted(op["results"].items())
        ]
        print(f"  {'bcm image push --apply':34s} {t_bcm:7.2f} s   op {op['state']}: {summary(bcm_rows)}")
        if "excluded: " in op.get("log", ""):
            logged = op["log"].split("excluded: ", 1)[1].splitlines()[0].split()
            if logged != excludes:
                print(f"  NOTE: bcm excluded {logged}, the rsync loop uses {excludes}")
        print(f"  {'':34s}           {check_nodes(lab, nodes, expected)}")

        nodes = lab.up(args.nodes, [pub])  # down and up: fresh overlays, the same starting state
        warm(tree)
        t_rsync, results = rsync_loop(tree, nodes, excludes, srv.state_dir / "ssh" / "id_ed25519", tmp)
        rows = [(r.name, r.status, r.changed, r.bytes, r.duration_s) for r in results]
        print(f"  {'sequential rsync loop (same argv)':34s} {t_rsync:7.2f} s   {summary(rows)}")
        for r in results:
            if not r.ok:
                print(f"    {r.name}: {r.status}: {r.error}")
        print(f"  {'':34s}           {check_nodes(lab, nodes, expected)}")
        mb = expected * len(nodes) / 2**20
        print(
            f"\nthroughput: bcm {mb / t_bcm:.0f} MiB/s, rsync loop {mb / t_rsync:.0f} MiB/s"
            f"   ratio rsync loop / bcm = {t_rsync / t_bcm:.2f}x   (goal: >= 4x on 8 nodes;"
            f" bcm runs {sync.DEFAULT_CONCURRENCY} rsyncs at once)"
        )
    finally:
        lab.down()
        srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
