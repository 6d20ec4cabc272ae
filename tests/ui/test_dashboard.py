"""The dashboard in a real Chromium against a real `bcm serve` (SQLite): signing in, roles, CSRF, escaping,
the CSP, live updates, an operation's live log, and a GPU's charts from reports sent by the agent route."""

from __future__ import annotations

import copy
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bcm.agent.collector import collect
from bcm.agent.fake_nvml import FakeNvml
from bcm.lab.fakegpu import RECORDED_NVML
from tests.ui.conftest import Site, shoot, sign_in, start_site

PAGES = [
    "/ui/",
    "/ui/nodes",
    "/ui/nodes/gpu01",
    "/ui/operations",
    "/ui/health",
    "/ui/images",
    "/ui/wlm",
    "/ui/tenancy",
    "/ui/pxe",
]
SCRIPT_REASON = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"> fan swap'


def csrf_of(page: Any) -> str:
    return str(page.locator('form[action="/ui/signout"] input[name=csrf]').get_attribute("value"))


def events(site: Site, action: str) -> list[dict[str, Any]]:
    r = site.api.get("/api/v1/events", params={"action": action})
    assert r.status_code == 200, r.text
    return list(r.json())


def seed_tenants(site: Site) -> None:
    """A department and a project, and a workload-manager sample of nlp holding 3 GPUs on gpu01."""
    assert site.api.post("/api/v1/departments", json={"name": "research", "gpu_quota": 8}).status_code == 201
    r = site.api.post(
        "/api/v1/projects",
        json={"name": "nlp", "department": "research", "deserved_gpus": 2, "limit_gpus": 4},
    )
    assert r.status_code == 201, r.text
    site.sql(
        "INSERT INTO wlm_cluster (name, kind, controller_id, state, created_at, updated_at, usage_at)"
        " SELECT 'lab', 'slurm', id, 'deployed', :t, :t, :t FROM node WHERE name = 'gpu01'",
        t="2026-01-01",
    )
    site.sql(
        "INSERT INTO wlm_member (cluster_id, node_id, role) SELECT c.id, n.id, 'compute' FROM wlm_cluster c, node n"
    )
    site.sql(
        "INSERT INTO wlm_usage (cluster_id, node_id, account, gpus, jobs) SELECT c.id, n.id, 'nlp', 3, 1"
        " FROM wlm_cluster c, node n WHERE n.name = 'gpu01'"
    )


def test_every_page_as_admin_has_a_strict_csp_and_loads_nothing_from_elsewhere(
    browser: Any, site: Site
) -> None:
    site.nodes("gpu[01-03]")
    seed_tenants(site)
    page = sign_in(browser, site, site.server.token())
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("request", lambda r: None if r.url.startswith(site.url) else problems.append(f"outside: {r.url}"))
    for path in PAGES:
        response = page.goto(path)
        assert response is not None and response.status == 200, path
        csp = response.headers["content-security-policy"]
        assert "unsafe-inline" not in csp and "script-src 'self'" in csp and "default-src 'none'" in csp
        assert response.headers["x-frame-options"] == "DENY"
        assert page.locator("main h1").count() == 1, path
        shoot(page, "admin-" + (path.removeprefix("/ui/").strip("/").replace("/", "-") or "overview"))
    # a CSP violation (an inline style or script of ours) or a fetch from elsewhere would be listed here
    assert problems == []
    # the tenants' sample: a Tenant cell on the Nodes page, a meter of GPUs in use on the Tenancy page
    page.goto("/ui/nodes")
    assert page.locator('tr[data-node="gpu01"] td.tenants').inner_text() == "nlp 3 GPUs"
    page.goto("/ui/tenancy")
    meter = page.locator('tr[data-project="nlp"] meter')
    assert meter.evaluate("m => [m.value, m.max, m.low, m.high]") == [3, 4, 2, 4]
    assert meter.get_attribute("aria-label") == "nlp: 3 of 4 GPUs in use (deserves 2)"
    assert problems == []
    # keyboard: the first Tab reaches the skip link, which leads to the page's content
    page.goto("/ui/nodes")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.textContent") == "Skip to content"
    # light and dark follow the system, and text stays readable in both (WCAG AA: 4.5:1)
    backgrounds = set()
    for scheme in ("light", "dark"):
        page.emulate_media(color_scheme=scheme)
        bg = page.evaluate("getComputedStyle(document.body).backgroundColor")
        backgrounds.add(bg)
        for selector in ("main h1", "p.muted", "table.nodes th a", "span.v-unknown", "td.state span"):
            fg = page.evaluate(f"getComputedStyle(document.querySelector({selector!r})).color")
            assert contrast(fg, bg) >= 4.5, (scheme, selector, fg, bg)
        button = page.locator("fieldset.bulk button")
        on, under = button.evaluate("b => [getComputedStyle(b).color, getComputedStyle(b).backgroundColor]")
        assert contrast(on, under) >= 4.5, (scheme, "button", on, under)
        shoot(page, f"admin-nodes-{scheme}")
    assert len(backgrounds) == 2


def contrast(a: str, b: str) -> float:
    """WCAG contrast ratio of two CSS ``rgb(r, g, b)`` colours."""

    def luminance(color: str) -> float:
        channels = [int(x) / 255 for x in re.findall(r"\d+", color)[:3]]
        r, g, b = (c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels)
        return 0.2126 * r + 0.7152 * g + 0.0722 * b

    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_viewer_sees_no_actions_and_the_server_refuses_a_forged_post(browser: Any, site: Site) -> None:
    site.nodes("gpu[01-03]")
    viewer = site.token("ui-viewer", "viewer")
    page = sign_in(browser, site, viewer, start="/ui/nodes")
    assert page.url.endswith("/ui/nodes")
    assert page.locator("table.nodes tbody tr").count() == 3
    assert page.locator('input[name="node"]').count() == 0  # no selection column
    assert page.locator("fieldset.bulk, form[action='/ui/nodes/confirm']").count() == 0
    assert page.get_by_text("Review…").count() == 0
    shoot(page, "viewer-nodes")
    page.goto("/ui/nodes/gpu01")
    assert page.locator("form[action='/ui/nodes/confirm']").count() == 0
    shoot(page, "viewer-node")

    # the cookie: HttpOnly, SameSite=Strict, scoped to /ui, and not the token
    cookies = {c["name"]: c for c in page.context.cookies()}
    session = cookies["bcm_session"]
    assert session["httpOnly"] and session["sameSite"] == "Strict" and session["path"] == "/ui"
    assert viewer not in session["value"] and viewer[4:20] not in session["value"]
    assert page.evaluate("document.cookie") == ""  # no script can read it

    # a forged action with the viewer's own valid CSRF token: refused by role, nothing moves
    csrf = csrf_of(page)
    for path in ("/ui/nodes/confirm", "/ui/nodes/act"):
        r = page.request.post(path, form={"csrf": csrf, "action": "drain", "nodes": "gpu01", "reason": "x"})
        assert r.status == 403, (path, r.status)
        assert "role viewer may not" in r.text()
    # without the CSRF token (what a cross-site form could send), refused before the role is asked
    r = page.request.post("/ui/nodes/act", form={"action": "drain", "nodes": "gpu01"})
    assert r.status == 403 and "CSRF" in r.text()
    r = page.request.post("/ui/pxe/assign", form={"csrf": csrf, "mac": "52:54:00:00:00:09", "name": "x1"})
    assert r.status == 403
    assert site.state("gpu01") == "ready"
    assert events(site, "node.drain") == []
    # the token itself was never in a URL the browser asked for
    assert viewer not in page.url


def test_operator_drains_a_node_from_the_nodes_page_and_a_script_reason_is_text(
    browser: Any, site: Site
) -> None:
    site.nodes("gpu[01-04]")
    page = sign_in(browser, site, site.token("ui-operator", "operator"), start="/ui/nodes")
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.check('input[name="node"][value="gpu02"]')
    page.select_option("#action", "drain")
    page.fill("#reason", SCRIPT_REASON)
    page.click("fieldset.bulk button[type=submit]")
    # the confirmation names the node and shows the reason as text
    assert page.locator("#confirm-hostlist").text_content() == "gpu02"
    assert page.locator("#confirm-reason").text_content() == SCRIPT_REASON
    shoot(page, "operator-confirm")
    page.click("button.danger")
    page.wait_for_url(re.compile(r"/ui/nodes\?"))
    # back on the Nodes page, filtered to the nodes acted on, with the result
    assert page.locator("p.notice").text_content() == "drain: done for the nodes below."
    assert page.locator("table.nodes tbody tr").count() == 1
    assert (page.locator('tr[data-node="gpu02"] td.state').text_content() or "").strip() == "drained"
    page.goto("/ui/nodes")
    states = {
        n: (page.locator(f'tr[data-node="{n}"] td.state').text_content() or "").strip()
        for n in ("gpu01", "gpu02", "gpu03", "gpu04")
    }
    assert states == {"gpu01": "ready", "gpu02": "drained", "gpu03": "ready", "gpu04": "ready"}
    shoot(page, "operator-nodes-drained")
    assert site.state("gpu02") == "drained"
    # recorded as the API's verb is, by the operator's token
    drained = events(site, "node.drain")
    assert [(e["actor"], e["target"], e["message"]) for e in drained] == [
        ("operator:ui-operator", "gpu02", SCRIPT_REASON)
    ]
    page.goto("/ui/nodes/gpu02")
    assert page.locator("#events td.message").first.text_content() == SCRIPT_REASON
    assert page.locator("img[src=x]").count() == 0
    assert page.evaluate("window.__pwned") is None and dialogs == []
    shoot(page, "operator-node-script-reason")


def test_failed_sign_ins_count_toward_the_auth_brake(tmp_path: Path) -> None:
    for site in start_site(tmp_path, BCM_HTTP__AUTH_FAILURES_PER_MINUTE="3"):
        with httpx.Client(base_url=site.url) as client:
            codes = []
            for _ in range(5):
                form = client.get("/ui/signin").text
                csrf = re.search(r'name="csrf" value="([^"]+)"', form).group(1)  # type: ignore[union-attr]
                r = client.post("/ui/signin", data={"csrf": csrf, "token": "bcm_not-a-token"})
                codes.append(r.status_code)
                assert "bcm_not-a-token" not in r.text
            assert codes == [401, 401, 401, 429, 429], codes
            assert r.headers["retry-after"].isdigit()
            # one brake for the API and the dashboard: the next wrong bearer token is braked too
            assert client.get("/api/v1/nodes", headers={"Authorization": "Bearer bcm_x"}).status_code == 429
            # and a sign-in without the form's CSRF token is refused without asking the database
            r = client.post("/ui/signin", data={"token": site.server.token()})
            assert r.status_code == 403
        log = site.server.log.read_text() if site.server.log else ""
        assert "authentication failed from 127.0.0.1 for /ui/signin" in log
        assert "bcm_not-a-token" not in log


def test_sign_out_and_revocation_end_the_session(browser: Any, site: Site) -> None:
    token = site.token("ui-leaver", "viewer")
    page = sign_in(browser, site, token)
    cookie = next(c["value"] for c in page.context.cookies() if c["name"] == "bcm_session")
    page.click("text=Sign out")
    page.wait_for_url(re.compile("/ui/signin"))
    with httpx.Client(base_url=site.url, cookies={"bcm_session": cookie}) as replay:
        r = replay.get("/ui/nodes")
        assert r.status_code == 303 and r.headers["location"].startswith("/ui/signin")
    assert [e["actor"] for e in events(site, "ui.signout")] == ["viewer:ui-leaver"]
    # a revoked token's session ends at its next request
    page = sign_in(browser, site, token)
    tid = next(t["id"] for t in site.api.get("/api/v1/tokens").json() if t["name"] == "ui-leaver")
    assert site.api.delete(f"/api/v1/tokens/{tid}").status_code == 200
    page.goto("/ui/nodes")
    assert "/ui/signin" in page.url
    # a node's agent token cannot sign in at all
    site.nodes("gpu01")
    node_token = site.api.post("/api/v1/nodes/gpu01/token").json()["token"]
    page = sign_in(browser, site, node_token)
    assert "/ui/signin" in page.url and page.locator(".alert").text_content().startswith("A node token")  # type: ignore[union-attr]


def test_nodes_table_updates_without_reload(browser: Any, site: Site) -> None:
    site.nodes("gpu[01-02]")
    page = sign_in(browser, site, site.token("ui-watcher", "viewer"), start="/ui/nodes")
    page.evaluate("window.__sameLoad = true")
    r = site.api.post("/api/v1/nodes/actions/drain", json={"nodes": "gpu01", "reason": "seen live"})
    assert r.status_code == 200, r.text
    state = page.locator('tr[data-node="gpu01"] td.state')
    state.filter(has_text="drained").wait_for(timeout=20_000)  # a poll every 5 s, with an ETag
    assert page.evaluate("window.__sameLoad") is True  # the same page load: no reload happened
    assert "seen live" not in (state.text_content() or "")  # an admin's drain: NodeHealth holds no reason


class SilentSsh:
    """Accepts SSH connections on loopback and never answers: an inventory waits for its connect timeout."""

    def __init__(self, host: str) -> None:
        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


@pytest.fixture
def silent_ssh() -> Iterator[SilentSsh]:
    s = SilentSsh("127.0.0.2")
    yield s
    s.close()


def test_an_operations_live_log_is_followed_to_its_end(
    browser: Any, tmp_path: Path, silent_ssh: SilentSsh
) -> None:
    env = {"BCM_SSH__PORT": str(silent_ssh.port), "BCM_SSH__CONNECT_TIMEOUT_S": "4"}
    for site in start_site(tmp_path, **env):
        site.nodes("slow01", state=None, ip="127.0.0.2")  # answers nothing: waits for the timeout
        site.nodes("fast01", state=None, ip="127.0.0.3")  # nothing listens: refused at once
        page = sign_in(browser, site, site.token("ui-follower", "viewer"), start="/ui/operations")
        r = site.api.post("/api/v1/nodes/actions/inventory", json={"nodes": "slow01,fast01"})
        assert r.status_code == 200, r.text
        op_id = r.json()["operation_id"]
        page.goto(f"/ui/operations/{op_id}")
        log = page.locator("#op-log")
        assert log.get_attribute("data-stream") == f"/ui/operations/{op_id}/log"  # rendered while it ran
        page.locator("#op-end").wait_for(state="visible", timeout=60_000)
        op = site.api.get(f"/api/v1/operations/{op_id}").json()
        assert op["state"] == "failed", op
        # the whole log, in order, each piece once: what the stream appended to what the page had
        assert log.text_content() == op["log"]
        assert "slow01:" in op["log"] and "fast01:" in op["log"]
        assert page.locator("#op-state").text_content() == "failed"
        assert log.get_attribute("data-ended") == "1"
        page.locator("#op-results td", has_text="slow01").wait_for(timeout=10_000)
        shoot(page, "operation-live-log")
        # the stream itself: server-sent events that end with an `end` event
        cookie = next(c["value"] for c in page.context.cookies() if c["name"] == "bcm_session")
        with httpx.Client(base_url=site.url, cookies={"bcm_session": cookie}, timeout=30) as client:
            r = client.get(f"/ui/operations/{op_id}/log")
            assert r.headers["content-type"].startswith("text/event-stream")
            assert "event: end" in r.text and '"state": "failed"' in r.text


def report(host: str, temperature: int) -> dict[str, Any]:
    nv = FakeNvml.from_file(RECORDED_NVML / "h100_sxm_565.json")
    nv.init()
    try:
        rep = copy.deepcopy(dict(collect(nv, None, hostname=host)))
    finally:
        nv.shutdown()
    for g in rep["gpus"]:
        g["temperature_c"] = temperature
    return rep


def test_a_gpu_temperature_chart_after_agent_reports(browser: Any, site: Site) -> None:
    site.nodes("gpu01")
    node_token = site.api.post("/api/v1/nodes/gpu01/token").json()["token"]
    temps = [41, 44, 47, 52, 49]
    with httpx.Client(base_url=site.url, timeout=30) as agent:
        for t in temps:
            r = agent.post(
                "/boot/v1/agent/report",
                content=json.dumps(report("gpu01", t)),
                headers={"Authorization": f"Bearer {node_token}", "Content-Type": "application/json"},
            )
            assert r.status_code == 202, r.text
            time.sleep(0.05)  # distinct sample times
    page = sign_in(browser, site, site.token("ui-charts", "viewer"), start="/ui/nodes/gpu01")
    chart = page.locator("#gpu-0 .chart-temperature svg")
    assert chart.get_attribute("aria-label") == "Temperature (°C)"
    points = (chart.locator("polyline").get_attribute("points") or "").split()
    assert len(points) == len(temps)  # one point per report kept
    ys = [float(p.split(",")[1]) for p in points]
    # higher is hotter: the SVG's y falls as the temperature rises, in the order reported
    assert [a > b for a, b in zip(ys, ys[1:], strict=False)] == [
        a < b for a, b in zip(temps, temps[1:], strict=False)
    ]
    assert chart.locator("text", has_text="52").count() == 1  # the scale's top is the hottest reading
    for kind in ("power", "ecc", "xid"):
        assert page.locator(f"#gpu-0 .chart-{kind}").count() == 1
    assert page.locator("#gpus tbody tr").first.locator("td").nth(4).text_content() == "49 °C"
    shoot(page, "node-gpu-charts")


HOSTILE = '<script>window.__pwned = 3</script><img src=x onerror="window.__pwned = 4">'


def test_a_discovered_machine_shows_its_facts_as_text_and_is_assigned_from_the_pxe_page(
    browser: Any, site: Site
) -> None:
    import hashlib

    from sqlmodel import Session

    from bcm.db import make_engine
    from bcm.drivers import imagebuild
    from bcm.services import images as image_svc
    from bcm.settings import Settings

    # a discovery image, published through the images service into the server's database
    settings = Settings(state_dir=site.server.state_dir)
    engine = make_engine(settings.effective_database_url)
    try:
        with Session(engine) as s:
            image = image_svc.begin_build(s, "img", None, "test")
            staging = image_svc.staging_dir(settings.images_dir, "img", image.version, 1)
            staging.mkdir(parents=True)
            found = []
            for kind, filename in (
                ("kernel", "vmlinuz"),
                ("initramfs", "initramfs.img"),
                ("rootfs", "rootfs.squashfs"),
            ):
                data = f"{kind} of img".encode()
                (staging / filename).write_bytes(data)
                found.append(imagebuild.Artifact(kind, filename, len(data), hashlib.sha256(data).hexdigest()))
            image_svc.publish(s, image, staging, settings.images_dir, found, {}, 3)
            s.commit()
    finally:
        engine.dispose()
    mac = "52:54:00:aa:00:28"
    with httpx.Client(base_url=site.url, timeout=30) as machine:  # the machine itself: no token
        assert machine.get(f"/boot/v1/ipxe/{mac.replace(':', '-')}").headers["x-bcm-purpose"] == "discovery"
        facts = {
            "format_version": 1,
            "hostname": HOSTILE,
            "cpu": {"model": HOSTILE, "threads": 4},
            "memory_bytes": 1 << 30,
            "dmi": {"product_name": HOSTILE},
            "nics": [{"name": "ens3", "mac": mac, "state": "up", "physical": True}],
        }
        r = machine.post("/boot/v1/discover", json={"mac": mac, "facts": facts})
        assert r.status_code in (200, 202), r.text
    page = sign_in(browser, site, site.token("ui-pxe", "operator"), start="/ui/pxe")
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    row = page.locator("#pxe tbody tr").first
    assert HOSTILE in (row.text_content() or "")  # the facts, as text
    assert page.locator("img[src=x]").count() == 0 and page.evaluate("window.__pwned") is None
    shoot(page, "pxe-discovered")
    row.locator("input[name=name]").fill("gpu28")
    row.locator("select[name=image]").select_option("img")
    row.locator("button[type=submit]").click()
    page.wait_for_url(re.compile("/ui/nodes/gpu28$"))
    assert (page.locator("#node-state").text_content() or "").strip() == "registered"
    assert page.locator("#fact-hostname").text_content() == HOSTILE  # a hostname fact, as text
    assert (
        page.locator("img[src=x]").count() == 0 and page.evaluate("window.__pwned") is None and dialogs == []
    )
    assert [e["target"] for e in events(site, "node.assign")] == ["gpu28"]
    shoot(page, "pxe-assigned-node")
