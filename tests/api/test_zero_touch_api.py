"""Zero-touch through the API (#29): a category's discovery rule registers a machine, takes the BMC its
discovery image reported, binds the category's BMC password to it only inside the range an admin set with
that password, and provisions it at once: a real IPMI BMC emulator on loopback powers the stand-in machine
on with a one-time network boot. What an unauthenticated discovery may claim is bounded: another node's BMC
is never taken, and outside the range no password goes anywhere."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient
from sqlmodel import Session, select

from bcm.lab.chassis import Machine
from bcm.models.category import Category
from tests.api.test_power_api import PASSWORD, bmcs  # noqa: F401  (fixture)
from tests.api.test_pxe_api import FACTS, events, node, provision_op, publish_image

NOAUTH = {"Authorization": ""}


def discover(api: TestClient, mac: str, bmc: dict[str, str] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"mac": mac, "facts": FACTS}
    if bmc is not None:
        body["bmc"] = bmc
    r = api.post("/boot/v1/discover", json=body, headers=NOAUTH)
    assert r.status_code == 202, r.text
    return dict(r.json())


def zero_touch_category(api: TestClient, discover_range: str | None = "127.0.0.0/24") -> None:
    r = api.post(
        "/api/v1/categories",
        json={
            "name": "zt",
            "image": "img",
            "discover_mac_prefix": "52:54:00:ab",
            "discover_names": "zt[01-04]",
            "auto_provision": True,
            "wlm_cluster": "slurm",
            "bmc_user": "admin",
            "bmc_protocol": "ipmi",
        },
    )
    assert r.status_code == 201, r.text
    assert r.json()["auto_provision"] is True and r.json()["wlm_cluster"] == "slurm"
    body: dict[str, Any] = {"password": PASSWORD}
    if discover_range:
        body["discover_range"] = discover_range
    r = api.put("/api/v1/categories/zt/bmc-password", json=body)
    assert r.status_code == 200, r.text


def test_a_discovered_machine_is_provisioned_at_once_through_the_bmc_it_reported(
    api: TestClient,
    engine: Any,
    settings: Any,
    bmcs: dict[str, Any],  # noqa: F811
) -> None:
    publish_image(engine, settings)
    zero_touch_category(api)
    spec = bmcs["ipmi"]
    machine = Machine(spec.dir)
    assert not machine.is_on()

    answer = discover(api, "52:54:00:ab:00:01", {"protocol": "ipmi", "address": spec.address})
    assert answer == {"node": "zt01", "state": "provisioning", "assigned": True, "provisioning": True}, answer
    n = node(api, "zt01")
    assert n["bmc_address"] == spec.address and n["bmc_protocol"] == "ipmi" and n["category"] == "zt"
    with Session(engine) as s:
        cat = s.exec(select(Category).where(Category.name == "zt")).one()
        assert cat.bmc_password_targets == {"zt01": f"ipmi://127.0.0.1:{spec.port}"}
    op = provision_op(api, "zt01")  # the provisioner took it from the queue: no admin command
    assert op["state"] == "succeeded" and op["results"]["zt01"]["status"] == "ok", op
    assert machine.is_on() and machine.boot() == "default"  # powered on, its one-time network boot used
    assert any(
        "reported at discovery" in e.message and "password bound" in e.message
        for e in events(engine, "node.bmc")
    )

    # its boot dies (a kernel panic with panic=-1 powers it off): the power poll fails it at once, rather
    # than after the provisioning deadline; within the grace after the power-on it is not judged yet
    import asyncio
    from datetime import timedelta

    from bcm.models.node import Node
    from bcm.services import power as power_svc
    from bcm.workers import power as power_worker

    machine.power_off()
    assert asyncio.run(power_worker.poll_once(engine, settings)) == 1
    assert node(api, "zt01")["provision_state"] == "provisioning"
    with Session(engine) as s:
        row = s.exec(select(Node).where(Node.name == "zt01")).one()
        row.provision_started_at = row.provision_started_at - timedelta(seconds=power_svc.BOOT_GRACE_S + 1)  # type: ignore[operator]
        s.add(row)
        s.commit()
    asyncio.run(power_worker.poll_once(engine, settings))
    n = node(api, "zt01")
    assert n["provision_state"] == "failed" and "powered off before it called back" in n["last_error"], n


def test_no_password_outside_the_admins_range_and_never_another_nodes_bmc(
    api: TestClient,
    engine: Any,
    settings: Any,
    bmcs: dict[str, Any],  # noqa: F811
) -> None:
    publish_image(engine, settings)
    zero_touch_category(api, discover_range="198.19.255.0/24")  # lab space, not where its BMC is
    spec = bmcs["ipmi"]
    # the BMC lies outside the range: the node is registered with it, but no password goes there
    answer = discover(api, "52:54:00:ab:00:01", {"protocol": "ipmi", "address": spec.address})
    assert answer["node"] == "zt01" and answer["state"] == "registered" and answer["provisioning"] is False
    assert node(api, "zt01")["bmc_address"] == spec.address
    assert not Machine(spec.dir).is_on()
    warned = [e.message for e in events(engine, "node.provision")]
    assert any("not this node" in m and "password" in m for m in warned), warned
    with Session(engine) as s:
        assert "zt01" not in (
            s.exec(select(Category).where(Category.name == "zt")).one().bmc_password_targets or {}
        )

    # a second machine claims the BMC zt01 has: not taken (it must not power-cycle someone else's node)
    answer = discover(api, "52:54:00:ab:00:02", {"protocol": "ipmi", "address": spec.address})
    assert answer["node"] == "zt02" and answer["provisioning"] is False
    assert node(api, "zt02")["bmc_address"] is None
    assert any("node zt01 has that BMC" in e.message for e in events(engine, "node.bmc"))

    # a machine without a BMC report waits registered, as before zero-touch
    answer = discover(api, "52:54:00:ab:00:03", None)
    assert answer["node"] == "zt03" and answer["state"] == "registered" and answer["provisioning"] is False


def test_bad_bmc_reports_and_ranges_are_refused_naming_the_field(
    api: TestClient, engine: Any, settings: Any
) -> None:
    publish_image(engine, settings)
    zero_touch_category(api, discover_range=None)
    r = api.post(
        "/boot/v1/discover",
        json={
            "mac": "52:54:00:ab:00:09",
            "facts": FACTS,
            "bmc": {"protocol": "telnet", "address": "127.0.0.1"},
        },
        headers=NOAUTH,
    )
    assert r.status_code == 422 and r.json()["field"] == "bmc.protocol", r.text
    r = api.post(
        "/boot/v1/discover",
        json={"mac": "52:54:00:ab:00:09", "facts": FACTS, "bmc": {"protocol": "ipmi", "address": "x" * 300}},
        headers=NOAUTH,
    )
    assert r.status_code == 422 and r.json()["field"].startswith("bmc.address"), r.text
    assert api.get("/api/v1/nodes/zt01").status_code == 404  # nothing stored
    for bad, why in (("not-a-net", "is not a network"), ("0.0.0.0/0", "more than 65536")):
        r = api.put("/api/v1/categories/zt/bmc-password", json={"password": PASSWORD, "discover_range": bad})
        assert (
            r.status_code == 422 and r.json()["field"] == "discover_range" and why in r.json()["message"]
        ), r.text
    r = api.patch("/api/v1/categories/zt", json={"wlm_cluster": "Bad Name"})
    assert r.status_code == 422 and r.json()["field"] == "wlm_cluster"
    # an operator changes the category but never the password's range (it is set only with the password)
    r = api.patch("/api/v1/categories/zt", json={"bmc_discover_range": "127.0.0.0/8"})
    assert r.status_code in (200, 422)
    assert api.get("/api/v1/categories/zt").json()["bmc_discover_range"] is None


class Recorder:
    """Stands in for the operations runner: records the deploys the zero-touch round starts."""

    def __init__(self, settings: Any) -> None:
        self.settings, self.started = settings, []  # type: ignore[var-annotated]

    async def submit(
        self, verb: str, names: list[str], actor: str, reason: Any, *, spec: Any = None, extra: Any = None
    ) -> int:
        self.started.append((verb, spec, extra))
        return len(self.started)


def test_booted_nodes_join_their_categorys_cluster_in_one_batch(
    api: TestClient, engine: Any, settings: Any
) -> None:
    import asyncio

    from bcm.models.node import Node
    from bcm.models.wlm import WlmCluster, WlmMember
    from bcm.services import wlm as wlm_svc
    from bcm.workers import autojoin

    assert api.post("/api/v1/categories", json={"name": "zt", "wlm_cluster": "zc"}).status_code == 201
    for i, name in enumerate(("ctl", "zt01", "zt02", "zt03", "zt04"), 1):
        body = {"name": name, "mac": f"52:54:00:ab:01:{i:02x}", "ip": f"198.18.90.{i}"}
        assert (
            api.post("/api/v1/nodes", json=body | ({} if name == "ctl" else {"category": "zt"})).status_code
            == 201
        )
    with Session(engine) as s:
        nodes = {n.name: n for n in s.exec(select(Node))}
        from bcm.models.base import utcnow

        for name, state, inventoried in (
            ("ctl", "ready", True),
            ("zt01", "booted", True),
            ("zt02", "provisioning", False),
            ("zt03", "booted", False),
            ("zt04", "failed", True),
        ):
            n = nodes[name]
            n.provision_state = state
            n.inventoried_at, n.facts = (utcnow(), {"format_version": 1}) if inventoried else (None, None)
            s.add(n)
        s.commit()

    def plans() -> list[wlm_svc.JoinPlan]:
        with Session(engine) as s:
            return wlm_svc.join_plans(s)

    now = [1000.0]
    runner = Recorder(settings)
    joiner = autojoin.AutoJoin(engine, settings, runner, clock=lambda: now[0])
    # no cluster named zc yet: the nodes wait, and say so once
    [p] = plans()
    assert (
        p.joining == ["zt01"]
        and p.pending == ["zt02", "zt03"]
        and "no cluster named 'zc'" in (p.missing or "")
    )
    asyncio.run(joiner.tick())
    asyncio.run(joiner.tick())
    assert (
        runner.started == []
        and len([e for e in events(engine, "node.join") if "wait to join" in e.message]) == 1
    )

    with Session(engine) as s:
        ctl = s.exec(select(Node).where(Node.name == "ctl")).one()
        cluster = WlmCluster(
            name="zc",
            kind="slurm",
            controller_id=ctl.id,
            state="deployed",
            settings={"storage_loc": "zc_acct"},
        )
        s.add(cluster)
        s.flush()
        s.add(WlmMember(cluster_id=cluster.id, node_id=ctl.id, role="compute"))
        s.commit()
    [p] = plans()
    assert p.missing is None and p.members == ["ctl"] and p.controller == "ctl"
    asyncio.run(joiner.tick())
    assert runner.started == []  # the rest of the rack is still booting: the batch waits
    now[0] += autojoin.HOLD_S + 1
    asyncio.run(joiner.tick())
    [(verb, spec, extra)] = runner.started  # waited long enough: the booted one joins alone
    assert verb == "wlm.deploy" and spec == {"cluster": "zc", "verify": True, "joining": ["zt01"]}
    kind, req, _actor, _dir = extra
    assert kind == "slurm" and req.nodes == "ctl,zt01" and req.controller == "ctl" and req.name == "zc"
    assert req.settings.storage_loc == "zc_acct"  # the cluster's settings are kept
    asyncio.run(joiner.tick())
    assert len(runner.started) == 1  # one deploy per cluster at a time (RETRY_S)

    # once nothing of the rack is pending, a new batch goes at once
    with Session(engine) as s:
        for n in s.exec(select(Node).where(Node.name.in_(["zt02", "zt03"]))):  # type: ignore[attr-defined]
            n.provision_state, n.inventoried_at, n.facts = "booted", utcnow(), {"format_version": 1}
            s.add(n)
        s.commit()
    now[0] += autojoin.RETRY_S + 1
    asyncio.run(joiner.tick())
    assert runner.started[-1][1]["joining"] == ["zt01", "zt02", "zt03"]  # zt01 again: it has not joined yet
    assert "zt04" not in runner.started[-1][2][1].nodes  # failed nodes never join

    # zt01 joined (a member, ready); zt02 was reimaged and is booted again: verified again; zt03 retired: it
    # leaves, and the deploy that takes it out names only the rest
    with Session(engine) as s:
        cluster = s.exec(select(WlmCluster).where(WlmCluster.name == "zc")).one()
        rows = {n.name: n for n in s.exec(select(Node))}
        for name, state in (("zt01", "ready"), ("zt02", "booted"), ("zt03", "retired")):
            s.add(WlmMember(cluster_id=cluster.id, node_id=rows[name].id, role="compute"))
            rows[name].provision_state = state
            s.add(rows[name])
        s.commit()
    [p] = plans()
    assert (
        p.members == ["ctl", "zt01", "zt02", "zt03"] and p.joining == ["zt02"] and p.leaving == ("zt03",)
    ), p
    assert p.nodes() == ["ctl", "zt01", "zt02"]
    now[0] += autojoin.RETRY_S + 1
    asyncio.run(joiner.tick())
    _verb, spec, (_kind, req, _a, _d) = runner.started[-1]
    assert spec["joining"] == ["zt02"] and req.nodes == "ctl,zt[01-02]" and req.verify is True
    with Session(engine) as s:
        rows = {n.name: n for n in s.exec(select(Node))}
        rows["zt02"].provision_state = "ready"
        s.add(rows["zt02"])
        s.commit()
    [p] = plans()  # only a departure: a deploy without it, and no verification job
    assert p.joining == [] and p.leaving == ("zt03",)
    now[0] += autojoin.RETRY_S + 1
    asyncio.run(joiner.tick())
    _verb, spec, (_kind, req, _a, _d) = runner.started[-1]
    assert "joining" not in spec and spec["verify"] is False and req.nodes == "ctl,zt[01-02]"


def test_a_kubernetes_cluster_is_joined_with_its_own_settings() -> None:
    from bcm.models.wlm import KubernetesDeployRequest
    from bcm.services.wlm import JoinPlan
    from bcm.workers import autojoin

    plan = JoinPlan("k8s", "kubernetes", "cp", ["node02"], ["zt01"], {"mode": "lab"}, [])
    req = autojoin.request(plan)
    assert isinstance(req, KubernetesDeployRequest) and req.nodes == "node02,zt01" and req.controller == "cp"
    assert req.settings.mode == "lab" and req.verify is True


def test_an_agent_sends_its_nodes_facts_without_an_ssh_round(api: TestClient, engine: Any) -> None:
    """bcm-agent with push_facts (what bcm-hello writes on a node bcm booted) posts the fact script's output:
    stored as an SSH inventory's, for the token's own node only."""
    from pathlib import Path

    from bcm.agent import main as agent_main
    from bcm.agent.reporter import AgentConfig, SendError

    recorded = (Path(__file__).resolve().parents[1] / "data" / "facts" / "vm-debian12.facts").read_text()
    for name in ("zt01", "zt02"):
        assert api.post("/api/v1/nodes", json={"name": name}).status_code == 201
    secret = api.post("/api/v1/nodes/zt01/token").json()["token"]

    def push(body: dict[str, Any], tok: str | None = secret) -> Any:
        return api.post(
            "/boot/v1/agent/facts", json=body, headers={"Authorization": f"Bearer {tok}" if tok else ""}
        )

    assert push({"output": recorded}, None).status_code == 401
    assert push({"output": recorded}, "bcm_" + "x" * 40).status_code == 401
    r = push({"output": "not the script's output"})
    assert r.status_code == 422 and r.json()["field"] == "output", r.text
    assert node(api, "zt01")["inventoried_at"] is None  # nothing stored
    # the agent's own path, through a real HTTP round trip of the test client
    sent: list[bytes] = []

    def send(url: str, token: str, body: bytes, timeout_s: float) -> int:
        sent.append(body)
        r = api.post(
            url.removeprefix("http://testserver"),
            content=body,
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        if r.status_code >= 300:
            raise SendError(f"{r.status_code}", retryable=r.status_code >= 500)
        return r.status_code

    config = AgentConfig.from_dict({"server_url": "http://testserver", "token": secret, "push_facts": True})
    assert config.push_facts is True
    assert agent_main.push_facts(config, collect_facts=lambda: recorded, send=send, sleep=lambda _s: None)
    n = node(api, "zt01")
    assert n["provision_state"] == "inventoried" and n["inventoried_at"], n
    assert api.get("/api/v1/nodes/zt01/hardware").json()["facts"]["cpu"]["threads"], "the facts are stored"
    assert node(api, "zt02")["inventoried_at"] is None  # the token's node only
    assert any("facts from its agent" in e.message for e in events(engine, "node.inventory"))
    # a refusal is not retried; an agent without push_facts sends nothing (an `agent deploy` config)
    assert not agent_main.push_facts(config, collect_facts=lambda: "junk", send=send, sleep=lambda _s: None)
    assert AgentConfig.from_dict({"server_url": "http://x", "token": "t"}).push_facts is False


def test_the_overlay_starts_the_agent_where_the_image_carries_it() -> None:
    from bcm.domain.image_recipe import Recipe, canonical_json
    from bcm.services.render import render

    unit = render("overlay/etc/systemd/system/bcm-agent.service.j2", node="zt01")
    assert "ConditionPathExists=/opt/bcm/bcm-agent.pyz" in unit and "After=bcm-hello.service" in unit
    hello = render(
        "overlay/usr/local/sbin/bcm-hello.j2", node="zt01", server_url="http://h", head="h", hosts=[]
    )
    assert '"push_facts": True' in hello
    plain, with_agent = Recipe(name="x1"), Recipe(name="x1", agent=True)
    assert '"agent"' not in canonical_json(
        plain
    )  # keys of recipes without it unchanged: their layers stay cached
    assert canonical_json(with_agent) != canonical_json(plain)
