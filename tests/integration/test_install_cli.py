"""`bcm category install` / `bcm node install` (#30): the real CLI against a real `bcm serve` over HTTP."""

from __future__ import annotations

import json
from pathlib import Path

from bcm.devserver import Server
from tests.integration.test_cli import failed_with, ok

LAYOUT = """\
disks:
  - path: /dev/vda
    partitions:
      - {size: 4G, mount: /}
      - {size: 1G, fs: swap}
      - {size: rest, fs: xfs, mount: /scratch}
"""


def test_install_modes_and_layout_from_the_cli(server: Server, tmp_path: Path) -> None:
    ok(server.cli("category", "add", "disk"))
    ok(server.cli("node", "add", "n01", "--category", "disk"))
    layout = tmp_path / "layout.yaml"
    layout.write_text(LAYOUT)
    shown = ok(server.cli("category", "install", "disk", "--mode", "full", "--layout", str(layout)))
    assert "full" in shown and "/scratch" in shown
    cat = json.loads(ok(server.cli("category", "install", "disk", "--json")))
    assert cat["install_mode"] == "full" and cat["disk_layout"]["disks"][0]["partitions"][2]["fs"] == "xfs"
    node = json.loads(ok(server.cli("node", "install", "n01", "--json")))
    assert node["effective_install_mode"] == "full" and node["install_mode"] is None
    node = json.loads(
        ok(server.cli("node", "install", "n01", "--mode", "nosync", "--next", "auto", "--json"))
    )
    assert (node["effective_install_mode"], node["next_install_mode"]) == ("nosync", "auto")
    assert "nosync" in ok(server.cli("node", "show", "n01"))
    # bad input: one readable line, exit != 0, nothing stored
    failed_with(server.cli("node", "install", "n01", "--mode", "sometimes"), "install_mode")
    bad = tmp_path / "bad.yaml"
    bad.write_text(LAYOUT.replace("size: 4G", "size: 4X"))
    failed_with(
        server.cli("category", "install", "disk", "--layout", str(bad)),
        "disk_layout.disks[0].partitions[0].size",
    )
    failed_with(
        server.cli("category", "install", "disk", "--layout", str(tmp_path / "missing.yaml")), "--layout"
    )
    # a data node: full (inherited on --inherit) needs an admin's --confirm-wipe
    ok(server.cli("node", "add", "n02", "--category", "disk"))
    ok(server.cli("node", "install", "n02", "--mode", "stateless", "--data-node"))
    failed_with(server.cli("node", "install", "n02", "--inherit"), "data node", "--confirm-wipe")
    node = json.loads(ok(server.cli("node", "install", "n02", "--inherit", "--confirm-wipe", "--json")))
    assert node["wipe_confirmed"] is True and node["effective_install_mode"] == "full"
    assert json.loads(ok(server.cli("category", "install", "disk", "--json")))["install_mode"] == "full"
