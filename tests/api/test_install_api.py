"""Install to disk (#30) through the API, on SQLite and PostgreSQL: install modes per category and node, one
boot's mode, data nodes and the admin's wipe confirmation, disk layouts checked against the inventoried disks
(422 naming what does not fit, nothing stored), and a provisioning boot's purposes: ``install`` with its plan
and report, then ``local`` with the disk's callback. A real install on a VM disk is tests/lab/test_install.py.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.test_power_api import bmcs  # noqa: F401 - fixture
from tests.api.test_pxe_api import (
    FACTS,
    MAC,
    add_with_bmc,
    node,
    provision_op,
    publish_image,
    script,
    token_of,
)

LAYOUT = {
    "disks": [
        {
            "path": "/dev/vda",
            "partitions": [
                {"size": "4G", "mount": "/"},
                {"size": "1G", "fs": "swap"},
                {"size": "rest", "fs": "xfs", "mount": "/scratch"},
            ],
        }
    ]
}
NO_AUTH = {"Authorization": ""}


@pytest.fixture(autouse=True)
def fresh_event_throttle(monkeypatch: pytest.MonkeyPatch) -> None:
    from bcm.services import events as events_svc

    monkeypatch.setattr(events_svc, "_throttle", events_svc._Throttle())


def make_token(api: TestClient, role: str) -> str:
    r = api.post("/api/v1/tokens", json={"name": f"t-{role}", "role": role})
    assert r.status_code == 201, r.text
    return str(r.json()["token"])


def discovered_node(api: TestClient, name: str = "n01", category: str = "disk") -> None:
    """A machine that reported its disks (a 10 GiB vda) at discovery, assigned to ``category``."""
    r = api.post("/boot/v1/discover", json={"mac": MAC, "facts": FACTS}, headers=NO_AUTH)
    assert r.status_code == 202, r.text
    r = api.post("/api/v1/discovered/assign", json={"mac": MAC, "name": name, "category": category})
    assert r.status_code == 200, r.text


def provision(api: TestClient, name: str) -> None:
    """`bcm node provision` (reimage once booted) when the node is free: its callback starts an SSH inventory
    that holds it a while (409 LockHeld meanwhile, as `bcm node wait --idle` waits out)."""
    deadline = time.monotonic() + 60
    while True:
        verb = "provision" if node(api, name)["provision_state"] == "registered" else "reimage"
        r = api.post(f"/api/v1/nodes/actions/{verb}", json={"nodes": name})
        if r.status_code == 409 and "locked" in r.json()["message"] and time.monotonic() < deadline:
            time.sleep(0.2)
            continue
        assert r.status_code == 200, r.text
        break
    provision_op(api, name)


def put_cat(api: TestClient, body: dict[str, Any], name: str = "disk", **kw: Any) -> Any:
    return api.put(f"/api/v1/categories/{name}/install", json=body, **kw)


def test_modes_and_layouts_are_checked_against_the_inventoried_disks(api: TestClient) -> None:
    assert api.post("/api/v1/categories", json={"name": "disk"}).status_code == 201
    discovered_node(api)
    assert node(api, "n01")["effective"]["install_mode"] == "stateless"
    # bad layouts: 422 naming the field, nothing stored
    bad = [
        (
            {"disks": [{"path": "/dev/vda", "partitions": [{"size": "4X", "mount": "/"}]}]},
            "disk_layout.disks[0].partitions[0].size",
        ),
        (
            {"disks": [{"path": "/dev/vda", "partitions": [{"size": "rest", "mount": "/"}, {"size": "1G"}]}]},
            "disk_layout.disks[0].partitions[0].size",
        ),
        ({"disks": [{"path": "/dev/vda", "partitions": [{"size": "1G", "mount": "/data"}]}]}, "disk_layout"),
        (
            {"disks": [{"path": "vda", "partitions": [{"size": "1G", "mount": "/"}]}]},
            "disk_layout.disks[0].path",
        ),
        (
            {"disks": [{"path": "/dev/vda", "partitions": [{"size": "1G", "mount": "/", "fs": "btrfs"}]}]},
            "disk_layout.disks[0].partitions[0].fs",
        ),
        (
            {"disks": [{"path": "/dev/vda", "partitions": [{"size": "1G", "mount": "/"}]}] * 2},
            "disk_layout.disks",
        ),
        (
            {
                "disks": [
                    {
                        "path": "/dev/vda",
                        "partitions": [{"size": "1G", "mount": "/"}, {"size": "1G", "fs": "raid"}],
                    }
                ]
            },
            "disk_layout.disks[0].partitions[1].fs",
        ),
    ]
    for layout, field in bad:
        r = put_cat(api, {"install_mode": "full", "disk_layout": layout})
        assert r.status_code == 422 and r.json()["field"] == field, (layout, r.text)
    r = put_cat(api, {"install_mode": "sometimes"})
    assert r.status_code == 422 and r.json()["field"] == "install_mode"
    # a layout bigger than the node's 10 GiB disk: 422 naming the partition that does not fit, and the node
    big = {
        "disks": [
            {
                "path": "/dev/vda",
                "partitions": [
                    {"size": "4G", "mount": "/"},
                    {"size": "4G", "fs": "swap"},
                    {"size": "4G", "mount": "/scratch"},
                ],
            }
        ]
    }
    r = put_cat(api, {"install_mode": "full", "disk_layout": big})
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "disk_layout.disks[0].partitions[2].size" and "n01" in r.json()["message"]
    # a disk the node does not have, or one chosen by a model none of its disks has
    r = put_cat(
        api,
        {
            "install_mode": "full",
            "disk_layout": {"disks": [{"path": "/dev/sdb", "partitions": [{"size": "1G", "mount": "/"}]}]},
        },
    )
    assert r.status_code == 422 and r.json()["field"] == "disk_layout.disks[0].path"
    r = put_cat(
        api,
        {
            "install_mode": "full",
            "disk_layout": {"disks": [{"model": "Samsung", "partitions": [{"size": "1G", "mount": "/"}]}]},
        },
    )
    assert r.status_code == 422 and r.json()["field"] == "disk_layout.disks[0].model"
    cat = api.get("/api/v1/categories/disk").json()
    assert cat["install_mode"] is None and cat["disk_layout"] is None  # nothing stored
    # full without a layout: 422
    assert put_cat(api, {"install_mode": "full"}).json()["field"] == "disk_layout"
    # a layout that fits, chosen by size
    by_size = {
        "disks": [
            {"min_size": "8G", "partitions": [{"size": "4G", "mount": "/"}, {"size": "rest", "fs": "swap"}]}
        ]
    }
    r = put_cat(api, {"install_mode": "full", "disk_layout": by_size})
    assert r.status_code == 200, r.text
    assert r.json()["install_mode"] == "full" and r.json()["disk_layout"]["disks"][0]["min_size"] == "8G"
    n = node(api, "n01")
    assert n["effective"]["install_mode"] == "full" and n["install_mode"] is None
    # the node's own mode overrides the category's; null inherits again; one boot's mode is shown as such
    r = api.put("/api/v1/nodes/n01/install", json={"install_mode": "nosync", "next_install_mode": "auto"})
    assert r.status_code == 200, r.text
    assert (
        r.json()["install_mode"],
        r.json()["next_install_mode"],
        r.json()["effective"]["install_mode"],
    ) == ("nosync", "auto", "nosync")
    r = api.put("/api/v1/nodes/n01/install", json={"install_mode": None, "next_install_mode": None})
    assert (r.json()["install_mode"], r.json()["effective"]["install_mode"]) == (None, "full")
    assert (
        api.put("/api/v1/nodes/n01/install", json={"next_install_mode": "x"}).json()["field"]
        == "next_install_mode"
    )
    assert api.put("/api/v1/nodes/nope/install", json={"install_mode": "full"}).status_code == 404


def test_a_data_node_refuses_full_unless_an_admin_confirms(api: TestClient) -> None:
    assert api.post("/api/v1/categories", json={"name": "disk"}).status_code == 201
    discovered_node(api)
    operator = {"Authorization": f"Bearer {make_token(api, 'operator')}"}
    # an operator may mark a data node, and set nosync
    r = api.put("/api/v1/nodes/n01/install", json={"data_node": True}, headers=operator)
    assert r.status_code == 200 and r.json()["data_node"] is True
    assert put_cat(api, {"disk_layout": LAYOUT}, headers=operator).status_code == 200
    # full for the category (so for the data node): 409 naming the node; the operator may not confirm
    r = put_cat(api, {"install_mode": "full"}, headers=operator)
    assert r.status_code == 409 and "n01" in r.json()["message"] and r.json()["field"] == "install_mode"
    r = put_cat(api, {"install_mode": "full", "confirm_wipe": True}, headers=operator)
    assert r.status_code == 403 and r.json()["field"] == "confirm_wipe"
    assert api.get("/api/v1/categories/disk").json()["install_mode"] is None
    r = api.put("/api/v1/nodes/n01/install", json={"next_install_mode": "full"}, headers=operator)
    assert r.status_code == 409 and r.json()["field"] == "next_install_mode"
    assert node(api, "n01")["next_install_mode"] is None  # nothing stored
    # the admin confirms: once (the node records it)
    r = api.put("/api/v1/nodes/n01/install", json={"next_install_mode": "full", "confirm_wipe": True})
    assert r.status_code == 200, r.text
    assert r.json()["wipe_confirmed"] is True and r.json()["effective"]["install_mode"] == "stateless"
    # a data node set anew needs a new confirmation
    r = api.put("/api/v1/nodes/n01/install", json={"data_node": True})
    assert r.status_code == 409


def test_install_boot_then_disk_boot(
    api: TestClient,
    engine: Any,
    settings: Any,
    bmcs: dict[str, Any],  # noqa: F811
) -> None:
    publish_image(engine, settings)
    assert api.post("/api/v1/categories", json={"name": "disk", "image": "img"}).status_code == 201
    assert put_cat(api, {"install_mode": "full", "disk_layout": LAYOUT}).status_code == 200
    add_with_bmc(api, "n01", MAC, bmcs["ipmi"], category="disk")
    provision(api, "n01")
    purpose, text = script(api, MAC)
    assert purpose == "install"
    assert "/boot/v1/install/" + MAC in text and "bcm.initrd=" in text
    token = token_of(text)
    auth = {"Authorization": f"Bearer {token}"}
    # the plan: only with the boot's token; from then on the disk is installing
    assert (
        api.get(
            f"/boot/v1/install/{MAC}", headers={"Authorization": "Bearer bcmboot_" + "x" * 43}
        ).status_code
        == 401
    )
    assert node(api, "n01")["install_state"] is None
    plan = api.get(f"/boot/v1/install/{MAC}", headers=auth)
    assert plan.status_code == 200, plan.text
    assert (
        "BCM_MODE=full" in plan.text
        and "BCM_ROOT=/dev/vda2" in plan.text
        and "/dev/vda4 /scratch xfs defaults" in plan.text
    )
    layout_hash = next(
        line.split("=", 1)[1] for line in plan.text.splitlines() if line.startswith("BCM_LAYOUT=")
    )
    assert node(api, "n01")["install_state"] == "installing"
    # a power cut here: the next boot installs again (never local on a half-written disk)
    assert script(api, MAC)[0] == "install"
    bad = api.post(
        "/boot/v1/installed",
        json={"mac": MAC, "image": "img:1", "layout": "ZZ", "mode": "full"},
        headers=auth,
    )
    assert bad.status_code == 422 and bad.json()["field"] == "layout"
    done = {"mac": MAC, "image": "img:1", "layout": layout_hash, "mode": "full", "bytes_written": 12345}
    assert api.post("/boot/v1/installed", json=done, headers=NO_AUTH).status_code == 401
    r = api.post("/boot/v1/installed", json=done, headers=auth)
    assert r.status_code == 200, r.text
    n = node(api, "n01")
    assert (n["install_state"], n["installed_image"], n["install_bytes"]) == ("installed", "img:1", 12345)
    r = api.post("/boot/v1/hello", json={"mac": MAC}, headers=auth)
    assert r.status_code == 200, r.text
    agent = r.json()["agent_token"]
    n = node(api, "n01")
    assert (n["provision_state"], n["booted_from"], n["booted_image"]) == ("booted", "disk", "img:1")
    # nosync: the next provisioning boots the disk as it is (local purpose); the disk calls back with its agent token
    assert api.put("/api/v1/nodes/n01/install", json={"install_mode": "nosync"}).status_code == 200
    provision(api, "n01")
    purpose, text = script(api, MAC)
    assert purpose == "local" and "sanboot --no-describe --drive 0x80" in text and "bcm.token" not in text
    hello = {"mac": MAC}
    assert (
        api.post("/boot/v1/hello/disk", json=hello, headers={"Authorization": "Bearer nope"}).status_code
        == 401
    )
    assert (
        api.post(
            "/boot/v1/hello/disk",
            json={"mac": "52:54:00:aa:00:09"},
            headers={"Authorization": f"Bearer {agent}"},
        ).status_code
        == 403
    )
    r = api.post("/boot/v1/hello/disk", json=hello, headers={"Authorization": f"Bearer {agent}"})
    assert r.status_code == 200 and r.json() == {"node": "n01", "state": "booted"}
    # auto with the same layout installed: a sync (not a repartition)
    r = api.put("/api/v1/nodes/n01/install", json={"next_install_mode": "auto"})
    assert r.status_code == 200 and r.json()["effective"]["install_mode"] == "nosync"
    provision(api, "n01")
    purpose, text = script(api, MAC)
    assert purpose == "install"
    plan = api.get(f"/boot/v1/install/{MAC}", headers={"Authorization": f"Bearer {token_of(text)}"})
    assert "BCM_MODE=auto" in plan.text
    r = api.post("/boot/v1/hello", json={"mac": MAC}, headers={"Authorization": f"Bearer {token_of(text)}"})
    assert r.status_code == 200
    assert node(api, "n01")["next_install_mode"] is None  # one boot's mode is spent at its callback


def test_a_data_node_whose_confirmation_was_used_is_refused_at_boot(
    api: TestClient,
    engine: Any,
    settings: Any,
    bmcs: dict[str, Any],  # noqa: F811
) -> None:
    publish_image(engine, settings)
    assert api.post("/api/v1/categories", json={"name": "disk", "image": "img"}).status_code == 201
    add_with_bmc(api, "n01", MAC, bmcs["ipmi"], category="disk")
    assert api.put("/api/v1/nodes/n01/install", json={"data_node": True}).status_code == 200
    assert (
        put_cat(api, {"install_mode": "full", "disk_layout": LAYOUT, "confirm_wipe": True}).status_code == 200
    )
    provision(api, "n01")
    purpose, text = script(api, MAC)
    auth = {"Authorization": f"Bearer {token_of(text)}"}
    plan = api.get(f"/boot/v1/install/{MAC}", headers=auth).text
    layout_hash = next(line.split("=", 1)[1] for line in plan.splitlines() if line.startswith("BCM_LAYOUT="))
    done = {"mac": MAC, "image": "img:1", "layout": layout_hash, "mode": "full"}
    assert api.post("/boot/v1/installed", json=done, headers=auth).status_code == 200
    assert node(api, "n01")["wipe_confirmed"] is False  # used up by the full install
    assert api.post("/boot/v1/hello", json={"mac": MAC}, headers=auth).status_code == 200
    # the category still says full: the data node's next provisioning is refused, before anything runs
    provision(api, "n01")
    purpose, text = script(api, MAC)
    assert purpose == "noimage" and "data node" in text
    n = node(api, "n01")
    assert (
        n["provision_state"] == "failed"
        and "data node" in n["last_error"]
        and n["install_state"] == "installed"
    )


def test_metrics_count_artifact_fetches(api: TestClient, engine: Any, settings: Any) -> None:
    import re

    publish_image(engine, settings)

    def fetched(kind: str) -> float:
        text = api.get("/metrics").text
        m = re.search(rf'bcm_boot_artifact_fetches_total{{kind="{kind}"}} (\S+)', text)
        assert m, text[-2000:]
        return float(m.group(1))

    before = {k: fetched(k) for k in ("kernel", "initramfs", "rootfs")}
    assert api.get("/boot/v1/images/img/1/vmlinuz", headers=NO_AUTH).status_code == 200
    assert api.head("/boot/v1/images/img/1/rootfs.squashfs", headers=NO_AUTH).status_code == 200
    after = {k: fetched(k) for k in ("kernel", "initramfs", "rootfs")}
    assert after == {**before, "kernel": before["kernel"] + 1}


def publish_tree(engine: Any, settings: Any, tree: Any, name: str = "img") -> str:
    """Publish the next version of ``name`` with ``tree`` as its root image (a real squashfs)."""
    import hashlib
    import subprocess

    from sqlmodel import Session

    from bcm.drivers import imagebuild
    from bcm.services import images as image_svc

    with Session(engine) as s:
        image = image_svc.begin_build(s, name, None, "test")
        staging = image_svc.staging_dir(settings.images_dir, name, image.version, 1)
        staging.mkdir(parents=True)
        subprocess.run(
            [
                "mksquashfs",
                str(tree),
                str(staging / "rootfs.squashfs"),
                "-quiet",
                "-no-progress",
                "-noappend",
            ],
            check=True,
        )
        (staging / "vmlinuz").write_bytes(b"kernel")
        (staging / "initramfs.img").write_bytes(b"initramfs")
        found = [
            imagebuild.Artifact(
                kind,
                fn,
                (staging / fn).stat().st_size,
                hashlib.sha256((staging / fn).read_bytes()).hexdigest(),
            )
            for kind, fn in (
                ("kernel", "vmlinuz"),
                ("initramfs", "initramfs.img"),
                ("rootfs", "rootfs.squashfs"),
            )
        ]
        image_svc.publish(s, image, staging, settings.images_dir, found, {}, 3)
        s.commit()
        return image.version


@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="image deltas unpack root images as root")
def test_an_auto_install_onto_an_older_version_fetches_only_the_changes(
    api: TestClient,
    engine: Any,
    settings: Any,
    tmp_path: Any,
    bmcs: dict[str, Any],  # noqa: F811
) -> None:
    import io
    import re
    import tarfile

    from bcm.drivers.imagedelta import REMOVED

    tree = tmp_path / "tree"
    (tree / "usr/bin").mkdir(parents=True)
    (tree / "usr/bin/big").write_bytes(b"\x01" * 300_000)
    (tree / "etc").mkdir()
    (tree / "etc/app.conf").write_text("v1\n")
    assert publish_tree(engine, settings, tree) == "1"
    assert api.post("/api/v1/categories", json={"name": "disk", "image": "img"}).status_code == 201
    assert put_cat(api, {"install_mode": "full", "disk_layout": LAYOUT}).status_code == 200
    add_with_bmc(api, "n01", MAC, bmcs["ipmi"], category="disk")
    provision(api, "n01")
    purpose, text = script(api, MAC)
    auth = {"Authorization": f"Bearer {token_of(text)}"}
    plan = api.get(f"/boot/v1/install/{MAC}", headers=auth).text
    assert "BCM_DELTA" not in plan  # a full install: nothing on the disk to start from
    layout_hash = next(line.split("=", 1)[1] for line in plan.splitlines() if line.startswith("BCM_LAYOUT="))
    done = {"mac": MAC, "image": "img:1", "layout": layout_hash, "mode": "full", "bytes_written": 300_000}
    assert api.post("/boot/v1/installed", json=done, headers=auth).status_code == 200
    assert api.post("/boot/v1/hello", json={"mac": MAC}, headers=auth).status_code == 200

    # the same version again in auto: nothing to send (the init syncs as before), and no delta to ask for
    assert api.put("/api/v1/nodes/n01/install", json={"install_mode": "auto"}).status_code == 200
    provision(api, "n01")
    purpose, text = script(api, MAC)
    auth = {"Authorization": f"Bearer {token_of(text)}"}
    assert "BCM_DELTA" not in api.get(f"/boot/v1/install/{MAC}", headers=auth).text
    r = api.get(f"/boot/v1/install/{MAC}/delta", headers=auth)
    assert r.status_code == 409 and "no older ready version" in r.json()["message"], r.text
    assert api.post("/boot/v1/installed", json={**done, "mode": "auto"}, headers=auth).status_code == 200
    assert api.post("/boot/v1/hello", json={"mac": MAC}, headers=auth).status_code == 200

    # version 2 changes one small file: the plan names the delta, which holds that file alone
    (tree / "etc/app.conf").write_text("v2\n")
    assert publish_tree(engine, settings, tree) == "2"
    provision(api, "n01")
    purpose, text = script(api, MAC)
    assert purpose == "install"
    auth = {"Authorization": f"Bearer {token_of(text)}"}
    plan = api.get(f"/boot/v1/install/{MAC}", headers=auth).text
    assert "BCM_MODE=auto" in plan and "BCM_DELTA_FROM=img:1" in plan, plan
    assert re.search(rf"^BCM_DELTA_URL=\S+/boot/v1/install/{MAC}/delta$", plan, re.MULTILINE), plan
    initrd_sha = __import__("hashlib").sha256(b"initramfs").hexdigest()
    assert f"BCM_INITRD_SHA256={initrd_sha}" in plan

    def delta_metrics() -> tuple[float, float]:
        text = api.get("/metrics").text
        fetches = re.search(r'bcm_boot_artifact_fetches_total\{kind="delta"\} (\S+)', text)
        sent = re.search(r"^bcm_image_delta_bytes_total (\S+)$", text, re.MULTILINE)
        assert fetches and sent, text[-2000:]
        return float(fetches.group(1)), float(sent.group(1))

    before = delta_metrics()
    assert api.get(f"/boot/v1/install/{MAC}/delta", headers=NO_AUTH).status_code == 401
    assert (
        api.get(
            f"/boot/v1/install/{MAC}/delta", headers={"Authorization": "Bearer bcmboot_" + "x" * 43}
        ).status_code
        == 401
    )
    r = api.get(f"/boot/v1/install/{MAC}/delta", headers=auth)
    assert r.status_code == 200 and r.headers["content-type"] == "application/gzip", r.text[:300]
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        assert tar.getnames() == [REMOVED, "etc/app.conf"]
        assert tar.extractfile("etc/app.conf").read() == b"v2\n"  # type: ignore[union-attr]
    assert len(r.content) < 10_000  # the 300 kB binary stayed home
    after = delta_metrics()
    assert after == (before[0] + 1, before[1] + len(r.content))
    again = api.get(f"/boot/v1/install/{MAC}/delta", headers=auth)  # the one build, kept beside version 2
    assert again.status_code == 200 and again.content == r.content
    assert list((settings.images_dir / "img" / "2" / "delta").iterdir()) == [
        settings.images_dir / "img" / "2" / "delta" / f"from-1-{layout_hash}.tar.gz"
    ]
