"""`bcm dept`, `bcm project`, `bcm tenancy` against a real `bcm serve`: tables, JSON, one red line."""

from __future__ import annotations

import json

from bcm.devserver import Server
from tests.integration.test_cli import failed_with, ok


def test_departments_and_projects_from_the_cli(server: Server) -> None:
    ok(server.cli("user", "add", "alice", "--role", "user"))
    ok(server.cli("user", "add", "bob", "--role", "user"))
    assert "created department research" in ok(
        server.cli("dept", "add", "research", "--gpus", "8", "--fairshare", "3")
    )
    ok(server.cli("dept", "add", "ops", "--gpus", "2"))
    ok(server.cli("project", "add", "nlp", "--dept", "research", "--gpus", "6", "--limit", "8"))
    failed_with(
        server.cli("project", "add", "cv", "--dept", "research", "--gpus", "3"), "deserved_gpus", "8", "9"
    )
    failed_with(
        server.cli("project", "add", "cv", "--dept", "research", "--gpus", "2", "--limit", "1"), "limit_gpus"
    )
    failed_with(server.cli("project", "set", "nlp", "--dept", "ops"), "department", "2", "6")
    failed_with(server.cli("dept", "set", "research", "--gpus", "5"), "gpu_quota", "5", "6")
    ok(server.cli("project", "members", "add", "nlp", "alice", "bob"))
    ok(server.cli("dept", "set", "research", "--add-admin", "alice"))
    assert json.loads(ok(server.cli("project", "members", "list", "nlp", "--json"))) == ["alice", "bob"]
    ok(server.cli("project", "members", "rm", "nlp", "bob"))
    table = ok(server.cli("project", "list"))
    assert "nlp" in table and "research" in table and "alice" in table
    depts = {d["name"]: d for d in json.loads(ok(server.cli("dept", "list", "--json")))}
    assert depts["research"]["deserved_gpus"] == 6 and depts["research"]["admins"] == ["alice"]
    usage = json.loads(ok(server.cli("project", "usage", "nlp", "--json")))
    assert usage["limit_gpus"] == 8 and usage["wlm"] is None
    assert "no cluster to ask" in ok(server.cli("project", "usage", "nlp"))
    failed_with(server.cli("tenancy", "plan"), "no workload-manager cluster")
    set_ = json.loads(ok(server.cli("project", "set", "nlp", "--gpus", "7", "--json")))
    assert set_["deserved_gpus"] == 7
    failed_with(server.cli("dept", "rm", "research"), "nlp")
    ok(server.cli("project", "rm", "nlp"))
    ok(server.cli("dept", "rm", "research"))
    assert [d["name"] for d in json.loads(ok(server.cli("dept", "list", "--json")))] == ["ops"]
