"""`bcm image push` onto real lab nodes through the real server and CLI: dry run, apply, a changed host key, a dead node.

The image is the shipped `base` plus a tiny `pushtest` layer (a marker file, and a file at an excluded
path); its layers are cached by content under BCM_IMAGES__CACHE_DIR (default /var/cache/bcm/images),
so only a cold machine pays for mmdebstrap. The nodes are the lab's SSH nodes; their host keys are
pinned by `bcm node inventory` (first contact), as in production.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bcm.devserver import REPO, Server

pytestmark = pytest.mark.lab

CACHE = Path(os.environ.get("BCM_IMAGE_CACHE", "/var/cache/bcm/images"))
BUILD_WAIT_S = 3600
PUSH_WAIT_S = 1200
MARKER = "bcm image push test: marker 1\n"
NODES = "node[01-04]"
PUSHTEST = {
    "name": "pushtest",
    "description": "base plus a marker file (tests/lab/test_image_push.py)",
    "parent": "base",
    "files": [
        {"path": "/etc/bcm-push-test", "content": MARKER},
        {"path": "/var/log/bcm-push-test", "content": "under an excluded path: never pushed\n"},
    ],
    # what bcm.lab itself writes on its nodes: the keys we log in with and the lab's sshd config
    "push_exclude": ["/root/.ssh/", "/etc/ssh/sshd_config", "/etc/hosts"],
}


def api(srv: Server) -> httpx.Client:
    return httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {srv.token()}"}, timeout=60)


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, (result.stdout, result.stderr)
    return result.stdout


def wait_op(http: httpx.Client, op_id: int, limit_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + limit_s
    while True:  # bounded by limit_s
        op: dict[str, Any] = http.get(f"/api/v1/operations/{op_id}").json()
        if op["state"] not in ("pending", "running"):
            return op
        assert time.monotonic() < deadline, f"operation {op_id} still {op['state']} after {limit_s:.0f} s"
        time.sleep(1)


def push(srv: Server, http: httpx.Client, nodes: str, *extra: str) -> dict[str, Any]:
    started = json.loads(ok(srv.cli("image", "push", "pushtest", nodes, "--no-wait", "--json", *extra)))
    return wait_op(http, started["operation_id"], PUSH_WAIT_S)


def snapshot(upper: str) -> dict[str, tuple[int, int, int]]:
    """Every entry of a node's overlay upper dir (what the node changed), except logs sshd writes."""
    root = Path(upper)
    seen = {}
    for path in root.rglob("*"):
        rel = path.relative_to(root).as_posix()
        if rel == "var/log" or rel.startswith("var/log/"):
            continue
        st = path.lstat()
        seen[rel] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return seen


def cat(built: Any, name: str, path: str) -> str | None:
    done = built.run(name, ["cat", path])
    return done.stdout if done.returncode == 0 else None


@pytest.fixture(scope="module")
def recipes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("push-recipes")
    for f in (REPO / "images").glob("*.yaml"):
        shutil.copy(f, d / f.name)
    (d / "pushtest.yaml").write_text(yaml.safe_dump(PUSHTEST, sort_keys=False))
    return d


def test_image_push_dry_run_apply_changed_key_and_dead_node(lab: Any, tmp_path: Path, recipes: Path) -> None:
    srv = Server(
        tmp_path / "state",
        extra_env={
            "BCM_IMAGES__RECIPES_DIR": str(recipes),
            "BCM_IMAGES__CACHE_DIR": str(CACHE),
            "BCM_POWER__POLL_INTERVAL_S": "0",
            "BCM_SSH__CONNECT_TIMEOUT_S": "4",
        },
    )
    srv.start()
    built = None
    try:
        http = api(srv)
        started = json.loads(ok(srv.cli("image", "build", "pushtest", "--no-wait", "--json")))
        build = wait_op(http, started["operation_id"], BUILD_WAIT_S)
        assert build["state"] == "succeeded", build["error"] or build["log"][-3000:]

        pubkey = http.get("/api/v1/ssh/public-key").json()["public_key"]
        built = lab(4, [pubkey], name="bcmpush", subnet="198.18.23.0/24")
        nodes = {n.name: n for n in built.status()}
        for n in nodes.values():  # registered without a host key: nothing is pinned yet
            r = http.post("/api/v1/nodes", json={"name": n.name, "mac": n.mac, "ip": n.ip})
            assert r.status_code == 201, r.text

        # a push is never first contact: nodes without a pinned key are refused, nothing is sent
        refused = push(srv, http, NODES)
        assert refused["state"] == "failed"
        assert {r["status"] for r in refused["results"].values()} == {"no_host_key"}
        assert all(cat(built, name, "/etc/bcm-push-test") is None for name in nodes)

        # pinned the way the product does it: the first inventory pins the key each node presents
        ok(srv.cli("node", "inventory", NODES))
        pinned = http.get("/api/v1/events", params={"action": "node.host_key_pinned"}).json()
        assert sorted(e["target"] for e in pinned) == sorted(nodes)

        # dry run (the default): every node would change, and nothing on any node does
        before = {name: snapshot(n.upper) for name, n in nodes.items()}
        dry = push(srv, http, NODES)
        assert dry["state"] == "succeeded", dry
        for name, r in dry["results"].items():
            assert r["status"] == "ok" and r["dry_run"] is True, (name, r)
            assert r["changed"] > 0 and r["sample"], (name, r)
            assert "image" not in r
        assert any("etc/bcm-push-test" in line for line in dry["results"]["node01"]["sample"]) or (
            dry["results"]["node01"]["changed"] > len(dry["results"]["node01"]["sample"])
        )
        for name, n in nodes.items():
            assert snapshot(n.upper) == before[name], f"the dry run changed {name}"
            assert cat(built, name, "/etc/bcm-push-test") is None
        table = ok(srv.cli("image", "push", "pushtest", "node01"))  # the table view of a dry run
        assert "CHANGED" in table and "node01" in table and "would change" in table

        # apply, with one node whose pin no longer matches and one node dead
        other = tmp_path / "other_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
        other_line = " ".join(other.with_suffix(".pub").read_text().split()[:2])
        ok(srv.cli("node", "rekey", "node03", "--key", other_line))
        before_node03 = snapshot(nodes["node03"].upper)
        built.kill("node04")

        applied = push(srv, http, NODES, "--apply")
        assert applied["state"] == "partial", applied
        status = {name: r["status"] for name, r in applied["results"].items()}
        assert status == {
            "node01": "ok",
            "node02": "ok",
            "node03": "host_key_changed",
            "node04": "unreachable",
        }
        for name in ("node01", "node02"):
            r = applied["results"][name]
            assert r["dry_run"] is False and r["changed"] > 0
            assert r["image"] == "pushtest" and r["version"] == build_version(http)
            assert cat(built, name, "/etc/bcm-push-test") == MARKER
            assert cat(built, name, "/etc/hostname") == f"{name}\n"  # excluded: stays the node's own
            assert cat(built, name, "/var/log/bcm-push-test") is None  # under an excluded directory
            assert "bcm node agent" in (cat(built, name, "/etc/systemd/system/bcm-agent.service") or "")
        assert snapshot(nodes["node03"].upper) == before_node03, "a node with a changed key was written to"
        assert cat(built, "node03", "/etc/bcm-push-test") is None
        assert not (Path(nodes["node04"].upper) / "etc/bcm-push-test").exists()
        events = http.get("/api/v1/events", params={"action": "image.push"}).json()
        assert sorted((e["target"], e["message"]) for e in events) == [
            ("node01", f"pushtest:{build_version(http)}"),
            ("node02", f"pushtest:{build_version(http)}"),
        ]
        running = {n["name"]: n["running_image"] for n in http.get("/api/v1/nodes").json()["items"]}
        assert running == {
            "node01": f"pushtest:{build_version(http)}",
            "node02": f"pushtest:{build_version(http)}",
            "node03": None,
            "node04": None,
        }

        # the nodes that took the image still answer over SSH, and now match it
        again = push(srv, http, "node[01-02]")
        assert again["state"] == "succeeded", again
        for name, r in again["results"].items():
            assert r["changed"] == 0, (name, r["sample"])
    finally:
        if built is not None:
            built.down()
        srv.stop()


def build_version(http: httpx.Client) -> str:
    return str(http.get("/api/v1/images/pushtest").json()["version"])
