"""`bcm power` against a real `bcm serve`: an operator's address change leaves the password unused until an
admin sets it again; plain http and certificate pins are admin matters (#26)."""

from __future__ import annotations

import json
from typing import Any

from bcm.devserver import Server
from tests.integration.test_cli import failed_with, ok

PASSWORD = "cli-bmc-pw-1"


def status(server: Server, nodes: str) -> dict[str, Any]:
    """`bcm power status --json`: the operation (exit 1 as it did not succeed: no node could be read)."""
    result = server.cli("power", "status", nodes, "--json")
    assert result.returncode == 1, result.stderr
    return dict(json.loads(result.stdout))


def test_bmc_settings_password_binding_http_permission_and_unpin(server: Server) -> None:
    ok(server.cli("category", "add", "rack", "--kernel-args", "quiet"))
    ok(server.cli("node", "add", "b[1-2]", "--category", "rack"))
    out = ok(
        server.cli(
            "power",
            "set",
            "b1",
            "--address",
            "http://127.0.0.1:9",
            "--protocol",
            "redfish",
            "--user",
            "admin",
            "--password-stdin",
            input=PASSWORD + "\n",
        )
    )
    assert "updated 1 node(s)" in out and "set it again" not in out
    # b2 is never contacted (no verb runs on it); the address is loopback all the same
    out = ok(
        server.cli("power", "set", "b2", "--address", "127.0.0.9", "--protocol", "ipmi", "--user", "admin")
    )
    assert "set it again (--password-stdin, admin)" in out

    # plain http: refused until the category allows it; nothing is contacted either way here
    op = status(server, "b1")
    assert op["results"]["b1"]["status"] == "no_bmc" and "--allow-http" in op["results"]["b1"]["message"]
    ok(server.cli("power", "set-category", "rack", "--allow-http"))
    assert json.loads(ok(server.cli("category", "show", "rack", "--json")))["bmc_allow_http"] is True
    ok(server.cli("power", "set-category", "rack", "--no-allow-http"))
    assert json.loads(ok(server.cli("category", "show", "rack", "--json")))["bmc_allow_http"] is False

    # the address moves: the password stays unused, and the error says who must do what
    ok(server.cli("power", "set", "b1", "--address", "https://127.0.0.1:9"))
    op = status(server, "b1")
    message = op["results"]["b1"]["message"]
    assert "were set for redfish+http://127.0.0.1:9; its BMC is now redfish+https://127.0.0.1:9" in message
    assert "an admin must set them again (bcm power set b1 --password-stdin)" in message

    assert "cleared 2 pin(s)" in ok(server.cli("power", "unpin", "b[1-2]"))
    failed_with(server.cli("power", "unpin", "nope1"), "nope1")
    assert PASSWORD not in server.log.read_text()
