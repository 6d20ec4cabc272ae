"""The real `bcm` CLI against a real `bcm serve` process over HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from bcm.devserver import Server
from bcm.lab.fakegpu import RECORDED_NVML


def ok(result) -> str:  # type: ignore[no-untyped-def]
    assert result.returncode == 0, (result.stdout, result.stderr)
    return str(result.stdout)


def failed_with(result, *words: str) -> str:  # type: ignore[no-untyped-def]
    assert result.returncode != 0, result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr  # one readable line, no traceback
    assert lines[0].startswith("error: ")
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def test_readme_flow_add_list_and_401(server: Server) -> None:
    out = ok(
        server.cli(
            "node",
            "add",
            "gpu[01-04]",
            "--mac",
            "52:54:00:00:00:01",
            "--ip",
            "198.18.0.11",
            "--category",
            "gpu",
        )
    )
    assert "registered 4 node(s)" in out
    table = ok(server.cli("node", "list"))
    for i in range(1, 5):
        assert f"gpu0{i}" in table and f"52:54:00:00:00:0{i}" in table and f"198.18.0.1{i}" in table
    nodes = json.loads(ok(server.cli("node", "list", "--json")))
    assert [(n["name"], n["interfaces"][0]["mac"], n["interfaces"][0]["ip"]) for n in nodes] == [
        (f"gpu0{i}", f"52:54:00:00:00:0{i}", f"198.18.0.1{i}") for i in range(1, 5)
    ]
    assert httpx.get(f"{server.url}/api/v1/nodes").status_code == 401


def test_data_survives_restart(server: Server) -> None:
    ok(server.cli("category", "add", "h100", "--kernel-args", "quiet"))
    ok(server.cli("node", "add", "h[1-3]", "--category", "h100"))
    token = server.token()
    server.stop()
    server.start()
    assert server.token() == token  # no second bootstrap token
    names = [n["name"] for n in json.loads(ok(server.cli("node", "list", "--json")))]
    assert names == ["h1", "h2", "h3"]
    cat = json.loads(ok(server.cli("category", "show", "h100", "--json")))
    assert cat["kernel_args"] == "quiet" and cat["node_count"] == 3


def test_errors_are_one_red_line(server: Server) -> None:
    ok(server.cli("node", "add", "gpu01", "--mac", "52:54:00:00:00:01"))
    failed_with(server.cli("node", "add", "gpu02", "--mac", "52:54:00:zz:00:01"), "mac")
    failed_with(server.cli("node", "add", "gpu01"), "gpu01", "already in use")
    failed_with(server.cli("node", "add", "gpu[01-"), "hostlist")
    failed_with(server.cli("node", "show", "nope"), "nope", "not found")
    failed_with(server.cli("node", "drain", "gpu01"), "gpu01", "registered", "drain")
    failed_with(server.cli("--token", "bcm_wrong", "node", "list"), "invalid or revoked token")
    failed_with(server.cli("node", "list", BCM_URL="http://127.0.0.1:9"), "cannot reach")
    assert len(json.loads(ok(server.cli("node", "list", "--json")))) == 1
    # a bad setting stops `bcm serve` with the variable named, before anything is started
    bad = {"BCM_HEALTH__INGEST_LINGER_MS": "-1", "BCM_STATE_DIR": str(server.state_dir / "never")}
    failed_with(
        server.cli("serve", "--port", "1", **bad),
        "BCM_HEALTH__INGEST_LINGER_MS",
        "greater than or equal to 0",
    )
    never = {"BCM_STATE_DIR": str(server.state_dir / "never")}
    failed_with(server.cli("serve", "--port", "70000", **never), "option --port", "65535")
    failed_with(server.cli("serve", "--log-level", "loud", **never), "option --log-level", "use debug, info")
    failed_with(
        server.cli("serve", **never, BCM_LOG_LEVEL="loud"), "setting BCM_LOG_LEVEL", "use debug, info"
    )
    assert not (server.state_dir / "never").exists()  # nothing was started


def test_tokens_and_roles_from_the_cli(server: Server) -> None:
    ok(server.cli("user", "add", "alice", "--role", "viewer"))
    failed_with(
        server.cli("token", "create", "alice-op", "--role", "operator", "--user", "alice"), "role", "alice"
    )
    viewer = (
        ok(server.cli("token", "create", "alice", "--role", "viewer", "--user", "alice"))
        .strip()
        .splitlines()[-1]
    )
    assert [u["tokens"] for u in json.loads(ok(server.cli("user", "list", "--json")))] == [1]
    assert viewer.startswith("bcm_")
    failed_with(server.cli("node", "add", "v1", BCM_TOKEN=viewer), "viewer")
    ok(server.cli("node", "list", BCM_TOKEN=viewer))
    listed = json.loads(ok(server.cli("token", "list", "--json")))
    assert viewer not in json.dumps(listed)
    tid = next(t["id"] for t in listed if t["name"] == "alice")
    ok(server.cli("token", "revoke", str(tid)))
    failed_with(server.cli("node", "list", BCM_TOKEN=viewer), "invalid or revoked")


def test_verbs_set_and_rm(server: Server) -> None:
    ok(server.cli("node", "add", "n[1-3]"))
    ok(server.cli("node", "set", "n[1-2]", "--kernel-args", "quiet", "--comment", "rack 4"))
    shown = json.loads(ok(server.cli("node", "show", "n1", "--json")))
    assert shown["effective"]["kernel_args"] == "quiet" and shown["comment"] == "rack 4"
    failed_with(server.cli("node", "set", "n1", "--image", "rocky9"), "image", "rocky9")
    res = json.loads(ok(server.cli("node", "retire", "n3", "--json")))
    assert res["nodes"][0]["state"] == "retired"
    ok(server.cli("node", "rm", "n[2-3]", "--yes"))
    assert [n["name"] for n in json.loads(ok(server.cli("node", "list", "--json")))] == ["n1"]
    retired = ok(server.cli("node", "list", "--state", "retired", "--json"))
    assert json.loads(retired) == []  # the retired node was removed


def test_server_process_on_postgresql(tmp_path: Path, pg_url: str) -> None:
    """BCM_DATABASE_URL switches a real server process to PostgreSQL with the same code."""
    srv = Server(tmp_path / "pgstate", database_url=pg_url)
    srv.start()
    try:
        ok(srv.cli("node", "add", "p[1-2]", "--mac", "52:54:00:00:30:01"))
        srv.stop()
        srv.start()
        assert [n["name"] for n in json.loads(ok(srv.cli("node", "list", "--json")))] == ["p1", "p2"]
        assert "postgresql" in (srv.log.read_text() if srv.log else "")
    finally:
        srv.stop()


def test_operations_from_the_cli(tmp_path: Path) -> None:
    """An inventory operation whose nodes cannot be reached: per-node results, op list/show/wait."""
    from bcm.devserver import free_port

    srv = Server(
        tmp_path / "state", extra_env={"BCM_SSH__PORT": str(free_port()), "BCM_SSH__CONNECT_TIMEOUT_S": "3"}
    )
    srv.start()
    try:
        ok(srv.cli("node", "add", "dead1", "--ip", "127.0.0.1"))  # nothing listens on the SSH port
        ok(srv.cli("node", "add", "noaddr1"))
        res = srv.cli("node", "inventory", "dead1,noaddr1", "--json")
        assert res.returncode == 1
        op = json.loads(res.stdout)
        assert op["state"] == "failed" and op["progress_done"] == op["progress_total"] == 2
        assert op["results"]["dead1"]["status"] == "unreachable"
        assert op["results"]["noaddr1"]["status"] == "no_address"
        listed = json.loads(ok(srv.cli("op", "list", "--json")))
        assert [(o["id"], o["kind"], o["state"]) for o in listed] == [(op["id"], "inventory", "failed")]
        assert "dead1" in ok(srv.cli("op", "show", str(op["id"])))
        waited = srv.cli("op", "wait", str(op["id"]))
        assert waited.returncode == 1 and "unreachable" in waited.stdout
        failed_with(srv.cli("op", "show", "999"), "operation 999 not found")
        nodes = {n["name"]: n for n in json.loads(ok(srv.cli("node", "list", "--json")))}
        assert nodes["dead1"]["provision_state"] == "unreachable" and nodes["dead1"]["locked_by"] is None
        assert "no IP address" in nodes["noaddr1"]["last_error"]
        # the server log: one line per start, end and failed node; no SSH library chatter at INFO
        log = srv.log.read_text() if srv.log else ""
        assert f"operation {op['id']} inventory started" in log, log
        assert f"operation {op['id']} inventory: dead1 unreachable" in log, log
        assert f"operation {op['id']} inventory failed" in log, log
        assert "asyncssh" not in log, log
    finally:
        srv.stop()


def test_health_from_the_cli(server: Server) -> None:
    """A node's agent token, a failing report, and what `bcm health …` shows for it."""
    import copy

    from bcm.agent.collector import collect
    from bcm.agent.fake_nvml import FakeNvml

    nv = FakeNvml.from_file(RECORDED_NVML / "h100_sxm_565.json")
    nv.init()
    rep = copy.deepcopy(dict(collect(nv, None, hostname="gpu01")))
    nv.shutdown()
    g = rep["gpus"][0]
    rep["xid_events"] = [
        {
            "xid": 79,
            "gpu_index": 0,
            "uuid": g["uuid"],
            "pci_bus_id": g["pci_bus_id"],
            "time": rep["collected_at"],
            "source": "nvml",
            "message": None,
            "recovery_action": None,
        }
    ]
    ok(server.cli("node", "add", "gpu[01-02]"))
    token = ok(server.cli("node", "token", "gpu01")).strip().splitlines()[-1]
    assert token.startswith("bcm_")
    bad = httpx.post(
        f"{server.url}/boot/v1/agent/report", json=rep, headers={"Authorization": "Bearer bcm_nope"}
    )
    assert bad.status_code == 401
    r = httpx.post(
        f"{server.url}/boot/v1/agent/report", json=rep, headers={"Authorization": f"Bearer {token}"}
    )
    assert r.status_code == 202, r.text
    summary = json.loads(ok(server.cli("health", "--json")))
    assert [n["name"] for n in summary["failing"]] == ["gpu01"]
    assert "gpu01" in ok(server.cli("health"))
    assert [
        n["name"] for n in json.loads(ok(server.cli("health", "nodes", "--verdict", "fail", "--json")))
    ] == ["gpu01"]
    events = ok(server.cli("health", "events", "--json"))
    assert "79" in events
    gpus = json.loads(ok(server.cli("health", "gpus", "gpu01", "--json")))
    assert gpus[0]["uuid"] == g["uuid"] and gpus[0]["verdict"].lower() == "fail"
    watch = server.cli("health", "watch", "--count", "1", "--interval", "0.2")
    assert watch.returncode == 0 and "gpu01" in watch.stdout
    failed_with(server.cli("health", "gpus", "nope"), "nope")


HOSTILE = {
    "title": "\x1b]0;pwned\x07",  # sets the terminal's window title
    "link": "\x1b]8;;http://evil.example/\x1b\\click\x1b]8;;\x1b\\",  # an OSC-8 hyperlink
    "markup": "[bold]x[/bold]",
    "emoji": "node:ab:",
    "bidi": "abc\u202edcb",
}


def test_data_from_unauthenticated_machines_is_printed_as_text_never_as_markup_or_escapes(
    server: Server,
) -> None:
    """A discovered machine's facts hold terminal escapes, rich markup and emoji codes; the CLI shows them
    escaped and literal. Control characters are refused at discovery now, so they are written into the
    database as facts stored before that check would be; markup and ``:ab:`` pass discovery as they are."""
    import sqlite3

    mac = "52:54:00:ab:cd:ef"  # ':ab:' is an emoji code for rich
    facts = {
        "cpu": {"model": HOSTILE["markup"], "threads": 4},
        "dmi": {"sys_vendor": HOSTILE["emoji"], "product_name": HOSTILE["markup"]},
        "memory_bytes": 1 << 30,
        "nics": [{"name": "eth0", "mac": mac}],
    }
    r = httpx.post(f"{server.url}/boot/v1/discover", json={"mac": mac, "facts": facts})
    assert r.status_code == 202, r.text
    with sqlite3.connect(server.state_dir / "bcm.db") as db:
        (stored,) = db.execute("SELECT facts FROM node WHERE name = ?", ("mac-525400abcdef",)).fetchone()
        facts = json.loads(stored)
        facts["cpu"]["model"] = HOSTILE["title"] + HOSTILE["markup"]
        facts["dmi"]["product_name"] = HOSTILE["link"] + HOSTILE["bidi"]
        facts["kernel"] = "6.1\x9b31m"  # an 8-bit CSI
        facts["nics"][0]["name"] = "eth0" + HOSTILE["title"]
        facts["memory_bytes"] = int("9" * 4000)  # crashed `bcm node discovered` (no float holds it)
        db.execute("UPDATE node SET facts = ? WHERE name = ?", (json.dumps(facts), "mac-525400abcdef"))

    listed = ok(server.cli("node", "discovered"))
    shown = ok(server.cli("node", "show", "mac-525400abcdef"))
    for text in (listed, shown):
        assert "\x1b" not in text and "\x07" not in text and "\x9b" not in text and "\u202e" not in text
        assert r"\x1b]0;pwned\x07[bold]x[/bold]" in text  # escaped, and the markup literal
        assert "52:54:00:ab:cd:ef" in text and "\U0001f18e" not in text  # no emoji (rich's :ab:)
    assert (
        "?" in listed.split("mac-525400abcdef", 1)[1].splitlines()[0]
    )  # the 4,000-digit memory, not a crash
    assert r"\x1b]8;;http://evil.example/\x1b\click\x1b]8;;\x1b\abc\u202edcb" in shown
    assert "node:ab:" in shown and r"6.1\x9b31m" in shown
    # an error naming the value prints it as text too
    bad = server.cli("node", "show", "[bold]x[/bold]")
    assert bad.returncode != 0 and "\x1b" not in bad.stderr
    # --json escapes control characters as JSON does
    raw = ok(server.cli("node", "show", "mac-525400abcdef", "--json"))
    assert "\x1b" not in raw and json.loads(raw)["hardware"]["facts"]["cpu"]["model"].startswith(
        "\x1b]0;pwned"
    )
