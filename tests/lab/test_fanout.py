"""SSH fan-out at scale on real lab nodes: a fan-out far above what this machine handles loses no host.

320 sshd nodes, the inventory's fact script through bcm's driver at a fan-out of 512 with a connect
timeout of 1 s: one Python event loop cannot finish 320 key exchanges in a second (nor can the
nodes' sshd on the same cores), so connects time out. They are retried, the fan-out backs off, and
every node ends ok, some after more than one attempt. In the same batch a node whose host key
changed fails at once (no retry), and an address in the lab subnet with no node behind it fails
after its bounded retries.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from pathlib import Path
from typing import Any

import pytest

from bcm.agent.facts import FACT_SCRIPT
from bcm.domain.facts import parse_fact_output
from bcm.drivers.ssh import HostStatus, SshClient, Target, ensure_keypair
from bcm.lab import net

pytestmark = pytest.mark.lab

NODES = 320
SUBNET = "198.18.32.0/23"  # up to 500 nodes
FAN_OUT = 512
RETRIES = 5  # 3 left 2 of 320 nodes timed out once while other tests loaded the 2 cores


def test_fan_out_far_above_capacity_loses_no_host(
    lab: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    key = tmp_path / "ssh" / "id_ed25519"
    built = lab(NODES, [ensure_keypair(key)], name="bcmfan", subnet=SUBNET)
    try:
        check_fan_out(built, key, caplog)
    finally:
        built.down()  # 320 nodes: not kept for the rest of the session


def check_fan_out(built: Any, key: Path, caplog: pytest.LogCaptureFixture) -> None:
    nodes = built.status()
    assert len(nodes) == NODES and all(n.alive for n in nodes)
    targets = [Target(n.name, n.ip, 22, n.host_key_public) for n in nodes]
    # node007 gets a new host key: its pin (the old key) no longer matches
    built.rekey("node007")
    # an address in the lab's subnet, routed to the bridge, where no node answers
    down_ip = str(net.node_address(ipaddress.IPv4Network(SUBNET), NODES + 5))
    targets.append(Target("ghost", down_ip, 22, None))

    client = SshClient(key, connect_timeout_s=1.0, command_timeout_s=60, concurrency=FAN_OUT, retries=RETRIES)
    caplog.set_level(logging.INFO, logger="bcm.drivers.ssh")
    results = asyncio.run(
        asyncio.wait_for(
            client.run_many(targets, FACT_SCRIPT, deadline_s=150), 240
        )  # outer bound: a hang fails
    )
    by_name = {r.name: r for r in results}

    healthy = [n.name for n in nodes if n.name != "node007"]
    failed = {n: (by_name[n].status.value, by_name[n].error) for n in healthy if not by_name[n].ok}
    assert not failed, failed
    for name in healthy[:3] + healthy[-3:]:
        assert parse_fact_output(by_name[name].stdout).hostname == name  # the right node answered
    retried = sorted(n for n in healthy if by_name[n].attempts > 1)
    assert retried, "no connect timed out at a fan-out of 512 with a 1 s connect timeout"
    assert all(by_name[n].attempts <= 1 + RETRIES for n in healthy)
    assert "concurrency cut" in caplog.text  # the fan-out backed off
    print(f"\n{len(retried)} of {len(healthy)} nodes needed a retry; {caplog.text.strip().splitlines()[-1]}")

    # refused once its key was seen, never tried again; attempts before that may have timed out under load
    changed = by_name["node007"]
    assert changed.status is HostStatus.HOST_KEY_CHANGED
    assert len(changed.earlier) == changed.attempts - 1
    assert all(e.startswith(("timed_out:", "unreachable:")) for e in changed.earlier), changed.earlier
    assert changed.host_key == " ".join(built.node("node007").host_key_public.split()[:2])  # the new key

    ghost = by_name["ghost"]
    assert ghost.status in (HostStatus.TIMED_OUT, HostStatus.UNREACHABLE)
    assert ghost.attempts == 1 + RETRIES and f"after {1 + RETRIES} attempts" in (ghost.error or "")
