"""Images through a real `bcm serve` and the real CLI: build the real `base` recipe, publish, serve, roll back.

The layer cache (BCM_IMAGES__CACHE_DIR, default /var/cache/bcm/images) is kept between runs, so only a
cold machine pays for mmdebstrap; every version still packs and verifies its own artifacts.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bcm.devserver import BCM, REPO, Server

pytestmark = pytest.mark.lab

CACHE = Path(os.environ.get("BCM_IMAGE_CACHE", "/var/cache/bcm/images"))
BUILD_WAIT_S = 3600


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, (result.stdout, result.stderr)
    return result.stdout


def one_error_line(result: subprocess.CompletedProcess[str], *words: str) -> str:
    assert result.returncode != 0, result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def recipes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped recipes, plus a layer whose package does not exist."""
    d = tmp_path_factory.mktemp("recipes")
    for f in (REPO / "images").glob("*.yaml"):
        shutil.copy(f, d / f.name)
    (d / "broken-layer.yaml").write_text(
        "name: broken-layer\nparent: base\npackages: [bcm-no-such-package]\n"
    )
    return d


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, recipes: Path) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("images-server")
    srv = Server(
        root / "state",
        extra_env={
            "BCM_IMAGES__RECIPES_DIR": str(recipes),
            "BCM_IMAGES__CACHE_DIR": str(CACHE),
            "BCM_POWER__POLL_INTERVAL_S": "0",
        },
    )
    srv.start()
    yield srv
    srv.stop()


def api(server: Server) -> httpx.Client:
    return httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {server.token()}"}, timeout=60
    )


def build(server: Server, recipe: str, *extra: str) -> dict[str, Any]:
    """Start a build with the CLI (no wait), then wait for its operation (bounded) and return it."""
    started = json.loads(ok(server.cli("image", "build", recipe, "--no-wait", "--json", *extra)))
    op_id = started["operation_id"]
    deadline = time.monotonic() + BUILD_WAIT_S
    with api(server) as c:
        while True:  # bounded by BUILD_WAIT_S
            op: dict[str, Any] = c.get(f"/api/v1/operations/{op_id}").json()
            if op["state"] not in ("pending", "running"):
                return op
            assert time.monotonic() < deadline, f"build {op_id} still {op['state']}"
            time.sleep(2)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def test_recipes_are_listed_and_a_broken_recipe_is_one_line(server: Server, recipes: Path) -> None:
    rows = json.loads(ok(server.cli("image", "recipes", "--json")))
    chains = {r["name"]: r["chain"] for r in rows}
    assert chains["cuda-toolkit"] == ["base", "nvidia-driver", "cuda-toolkit"]
    one_error_line(server.cli("image", "build", "no-such-recipe"), "no-such-recipe")
    # a recipe that does not parse is named, with its field and the allowed values, and nothing starts
    bad = recipes / "bad-variant.yaml"
    bad.write_text("name: bad-variant\nvariant: huge\nmirrors: []\n")
    try:
        one_error_line(server.cli("image", "build", "base"), "bad-variant.yaml", "variant", "minbase")
    finally:
        bad.unlink()
    assert json.loads(ok(server.cli("image", "list", "--json"))) == []


def test_base_builds_publishes_serves_and_rolls_back(server: Server) -> None:
    state = server.state_dir
    first = build(server, "base")
    assert first["state"] == "succeeded", first["error"] or first["log"][-3000:]
    shown = json.loads(ok(server.cli("image", "show", "base", "--json")))
    assert shown["version"] == "1" and shown["state"] == "ready" and shown["current"]
    assert shown["kernel_version"] and shown["packages"] > 100
    kinds = {a["kind"]: a for a in shown["artifacts"]}
    assert set(kinds) == {"kernel", "initramfs", "rootfs", "manifest"}
    published = state / "images" / "base" / "1"
    for a in shown["artifacts"]:
        f = published / a["filename"]
        assert f.stat().st_size == a["size"] and sha256(f) == a["sha256"], a
    table = ok(server.cli("image", "show", "base"))
    assert "rootfs" in table and kinds["rootfs"]["sha256"][:16] in table
    with api(server) as c:
        full = c.get("/api/v1/images/base/manifest").json()
    assert full["kernel_version"] == shown["kernel_version"] and "openssh-server" in full["packages"]
    assert not list((state / "images" / ".staging").glob("*")), "staging left behind"

    # served to PXE clients without a token: Range, ETag = sha256
    kernel = kinds["kernel"]
    r = httpx.get(f"{server.url}{kernel['url']}", headers={"Range": "bytes=0-99"}, timeout=60)
    assert r.status_code == 206 and len(r.content) == 100
    assert r.headers["etag"].strip('"') == kernel["sha256"]
    assert r.content == (published / kernel["filename"]).read_bytes()[:100]

    # an unchanged recipe reuses its cached layer: version 2 is built from the same tree
    layer = CACHE / "layers" / shown["layer_key"]
    before = layer.stat().st_mtime_ns
    second = build(server, "base", "--version", "2")
    assert second["state"] == "succeeded", second["error"]
    v2 = json.loads(ok(server.cli("image", "show", "base", "--json")))
    assert v2["version"] == "2" and v2["current"] and v2["layer_key"] == shown["layer_key"]
    assert layer.stat().st_mtime_ns == before, "the cached layer was rebuilt"

    # roll back: version 1 is current again; the oldest cannot roll back further
    ok(server.cli("image", "rollback", "base"))
    assert json.loads(ok(server.cli("image", "show", "base", "--json")))["version"] == "1"
    one_error_line(server.cli("image", "rollback", "base"), "oldest")

    # an image a node uses cannot be removed
    ok(server.cli("node", "add", "img1", "--image", "base"))
    one_error_line(server.cli("image", "rm", "base"), "used by 1 node")
    one_error_line(server.cli("image", "rm", "base", "--version", "1"), "current")
    ok(server.cli("image", "rm", "base", "--version", "2"))
    assert not (state / "images" / "base" / "2").exists()


def test_a_corrupted_artifact_is_never_sent_as_whole(server: Server) -> None:
    shown = json.loads(ok(server.cli("image", "show", "base", "--json")))
    rootfs = next(a for a in shown["artifacts"] if a["kind"] == "rootfs")
    path = server.state_dir / "images" / "base" / shown["version"] / rootfs["filename"]
    with open(path, "ab") as f:
        f.write(b"x")  # a half-written or replaced file: its size no longer matches
    try:
        r = httpx.get(f"{server.url}{rootfs['url']}", timeout=60)
        assert r.status_code == 500 and "published size" in r.json()["message"]
        with api(server) as c:
            events = c.get("/api/v1/events", params={"action": "image.artifact"}).json()
        assert events and events[0]["severity"] == "error"
    finally:
        with open(path, "r+b") as f:
            f.truncate(rootfs["size"])
    assert (
        httpx.get(f"{server.url}/boot/v1/images/base/{shown['version']}/nothing.img", timeout=10).status_code
        == 404
    )


def test_a_layer_that_cannot_install_fails_and_leaves_the_current_version(server: Server) -> None:
    before = json.loads(ok(server.cli("image", "show", "base", "--json")))
    op = build(server, "broken-layer")
    assert op["state"] == "failed" and "Unable to locate package bcm-no-such-package" in (op["error"] or "")
    failed = json.loads(ok(server.cli("image", "show", "broken-layer", "--json")))
    assert failed["state"] == "failed" and failed["artifacts"] == []
    assert not list((server.state_dir / "images" / ".staging").glob("*")), "staging left behind"
    assert not (server.state_dir / "images" / "broken-layer").exists()
    after = json.loads(ok(server.cli("image", "show", "base", "--json")))
    assert (after["version"], after["current"]) == (before["version"], True)
    # the streamed log holds apt's own words
    shown = subprocess.run(
        [*BCM, "op", "show", str(op["id"]), "--follow"],
        env=server.env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert "Unable to locate package" in shown.stdout
