"""The dashboard against a Slurm lab: an operator drains a node from the Nodes page, and Slurm drains it
with bcm's reason; resuming it from the node's page puts it back in service in both. bcm's agent, deployed
over SSH onto the node and answering from the recorded fake NVML, reports meanwhile: the node's page then
charts each GPU's temperature from those reports.

It builds one small lab (a controller and one compute node, the lab module the Slurm tests use) and
deploys Slurm without the verification job: the cheapest real Slurm there is."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bcm.lab.slurm import SlurmLab
from tests.lab.conftest import lab_required  # noqa: F401  (the fixture: skips where no lab can be built)
from tests.lab.test_health_e2e import GPUS, fixture_for, until
from tests.ui.conftest import Site, shoot, sign_in

pytestmark = pytest.mark.lab


@pytest.fixture
def slurm_ui(lab_required: None, tmp_path: Path) -> Iterator[SlurmLab]:  # noqa: F811
    with SlurmLab.running(
        tmp_path, nodes=2, gpus_per_node=GPUS, name="bcmui", subnet="198.18.28.0/24", server_host="0.0.0.0"
    ) as run:
        yield run


def slurm_reasons(run: SlurmLab) -> str:
    done = run.lab.run(run.controller, ["sinfo", "-R", "--noheader", "--format=%N|%E"], timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return str(done.stdout)


def test_operator_drains_a_lab_node_from_the_nodes_page_and_slurm_drains_it(
    browser: Any, slurm_ui: SlurmLab
) -> None:
    run = slurm_ui
    op = run.deploy(verify=False)
    assert op["state"] == "succeeded", f"{op['state']}: {op.get('error')}\n{op.get('log', '')[-3000:]}"
    node = run.compute[0]
    # the agent onto the node over SSH: it reports every second while the operator works
    body = {
        "nodes": node,
        "server_url": f"http://{run.lab.head_ip}:{run.server.port}",
        "interval_s": 1.0,
        "nvml_fixture": fixture_for(node),
    }
    started = run.http.post("/api/v1/agents/deploy", json=body)
    assert started.status_code == 202, started.text
    agent_op = run.wait(started.json()["operation_id"], timeout_s=180)
    assert agent_op["state"] == "succeeded", agent_op
    site = Site(run.server, run.http)
    page = sign_in(browser, site, site.token("ui-lab-operator", "operator"), start=f"/ui/nodes?nodes={node}")
    assert (page.locator(f'tr[data-node="{node}"] td.state').text_content() or "").strip() == "ready"
    page.check(f'input[name="node"][value="{node}"]')
    page.select_option("#action", "drain")
    page.fill("#reason", "fan swap")
    page.click("fieldset.bulk button[type=submit]")
    assert page.locator("#confirm-hostlist").text_content() == node
    page.click("button.danger")
    page.wait_for_url(re.compile(r"/ui/nodes\?"))
    row = page.locator(f'tr[data-node="{node}"]')
    assert (row.locator("td.state").text_content() or "").strip() == "drained"
    assert re.search(r"drain(ed|ing) \(lab\)", row.locator("td.wlm").text_content() or ""), row.inner_html()
    shoot(page, "lab-nodes-drained")
    assert f"{node}|bcm: fan swap" in slurm_reasons(run)

    # resume from the node's own page: back in service in bcm and in Slurm
    page.goto(f"/ui/nodes/{node}")
    page.select_option("form.bulk select[name=action]", "resume")
    page.click("form.bulk button[type=submit]")
    page.click("button.danger")
    page.wait_for_url(re.compile(r"/ui/nodes\?"))
    assert (page.locator(f'tr[data-node="{node}"] td.state').text_content() or "").strip() == "ready"
    assert node not in slurm_reasons(run)
    assert run.http.get(f"/api/v1/nodes/{node}").json()["wlm_state"] == "idle"

    # the GPU charts on the node's page, drawn from what the lab agent reported
    uuid = run.http.get(f"/api/v1/nodes/{node}/gpus").json()[0]["uuid"]

    def third_report() -> list[dict[str, Any]] | None:
        # a 404 until the agent's first report is in (the agent started a moment ago, on a loaded machine)
        r = run.http.get(f"/api/v1/gpus/{uuid}/history")
        assert r.status_code in (200, 404), r.text
        samples: list[dict[str, Any]] = r.json()["samples"] if r.status_code == 200 else []
        return samples if len(samples) >= 3 else None

    history = until("the lab agent's third report", third_report)
    temps = {float(h["temperature_c"]) for h in history}
    page.goto(f"/ui/nodes/{node}")
    chart = page.locator("#gpu-0 .chart-temperature svg")
    assert chart.get_attribute("aria-label") == "Temperature (°C)"
    points = (chart.locator("polyline").get_attribute("points") or "").split()
    assert len(points) >= len(history)  # one point per report kept, at least those seen above
    assert chart.locator("text", has_text=f"{max(temps):g}").count() >= 1, chart.inner_html()
    shoot(page, "lab-node-gpu-charts")
