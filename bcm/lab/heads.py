"""Several head nodes in a lab: each a network namespace on a bridge of its own, running `bcm serve` on a
shared PostgreSQL database and keepalived, which holds the service address (the subnet's ``.1``) on the
head whose bcm leads (#27 items 3 and 5; the recipe of ../shared/LAB.md, verified there).

keepalived's check script asks the local server ``GET /leaderz`` (200 only while its database lease
holds): a head whose bcm dies, freezes or loses the lease fails the check and drops the address; the
other's check passes once its bcm leads. The address is a convenience for nodes, agents and iPXE, never
proof of leadership: a frozen keepalived master wakes up still holding it (LAB.md), and the database lease
with its epoch is what fences the old leader.

Addresses: 198.18.0.0/15 only, inside namespaces made here, after ``ip route add unreachable
198.18.0.0/15`` in the host namespace; the host reaches the lab through one veth (``.254``), so clients
on this machine talk to the service address directly. Drills: :meth:`Heads.kill` (kill -9 of a head's
bcm), :meth:`Heads.freeze` / :meth:`Heads.thaw` (SIGSTOP/SIGCONT of its bcm and keepalived).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bcm.lab import net, procs
from bcm.lab.errors import LabError

PORT = 8470
ROUTER_ID = 47
CHECK = """#!/bin/sh
# keepalived's check: this head's bcm leads (its database lease), else the service address goes
exec curl -sf -m 1 -o /dev/null http://127.0.0.1:{port}/leaderz
"""
KEEPALIVED = """global_defs {{
    router_id {name}
    enable_script_security
    script_user root
    vrrp_version 3
}}
vrrp_script chk {{
    script "{check}"
    interval 1
    timeout 2
    fall 2
    rise 2
}}
vrrp_instance VI {{
    state BACKUP
    interface eth0
    virtual_router_id {router_id}
    priority {priority}
    advert_int {advert}
    unicast_src_ip {address}
    unicast_peer {{
{peers}
    }}
    virtual_ipaddress {{
        {vip}/{prefix} dev eth0
    }}
    track_script {{
        chk
    }}
}}
"""


@dataclass
class Head:
    index: int
    netns: str
    address: str
    state_dir: Path
    serve: subprocess.Popen[bytes] | None = None
    keepalived: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.address}:{PORT}"


@dataclass
class Heads:
    """``Heads(work, n, database_url)``; ``up()``, drills, ``down()`` (everything it made goes)."""

    work: Path
    count: int = 2
    database_url: str = ""
    name: str = "bcmha"
    subnet: str = "198.18.229.0/24"
    lease_s: float = 2.0
    advert_s: float = 0.1
    heads: list[Head] = field(default_factory=list)

    @property
    def net(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(self.subnet)

    @property
    def vip(self) -> str:
        return str(self.net.network_address + 1)

    @property
    def url(self) -> str:
        """The service address: whichever head keepalived gave it to."""
        return f"http://{self.vip}:{PORT}"

    @property
    def bridge_ns(self) -> str:
        return f"{self.name}-br"

    @property
    def host_if(self) -> str:
        return f"{self.name}-h"[:15]

    def token(self) -> str:
        for head in self.heads:  # the first head to start made the admin token
            file = head.state_dir / "admin.token"
            if file.exists():
                return file.read_text().strip()
        raise LabError("no head wrote an admin token")

    def up(self) -> None:
        if not self.database_url.startswith("postgresql"):
            raise LabError("several heads need PostgreSQL (a database URL every head namespace reaches)")
        net.keep_lab_space_local()
        self.work.mkdir(parents=True, exist_ok=True)
        prefix = self.net.prefixlen
        procs.run(["ip", "netns", "add", self.bridge_ns])
        procs.run(["ip", "-n", self.bridge_ns, "-batch", "-"],
                  stdin="link set lo up\nlink add br0 type bridge stp_state 0 forward_delay 0\nlink set br0 up\n")  # fmt: skip
        host_addr = self.net.network_address + 254
        procs.run(["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", "p-host", "netns", self.bridge_ns])
        procs.run(["ip", "-n", self.bridge_ns, "link", "set", "p-host", "master", "br0", "up"])
        procs.run(["ip", "addr", "add", f"{host_addr}/{prefix}", "dev", self.host_if])
        procs.run(["ip", "link", "set", self.host_if, "up"])
        addresses = [str(self.net.network_address + 10 + i) for i in range(1, self.count + 1)]
        for i, address in enumerate(addresses, 1):
            ns = f"{self.name}-{i}"
            procs.run(["ip", "netns", "add", ns])
            procs.run(["ip", "-n", self.bridge_ns, "link", "add", f"p-{i}", "type", "veth", "peer", "name", "eth0",
                       "netns", ns])  # fmt: skip
            procs.run(["ip", "-n", self.bridge_ns, "link", "set", f"p-{i}", "master", "br0", "up"])
            procs.run(["ip", "-n", ns, "-batch", "-"],
                      stdin=f"link set lo up\naddr add {address}/{prefix} dev eth0\nlink set eth0 up\n")  # fmt: skip
            self.heads.append(Head(i, ns, address, self.work / f"head{i}"))
        for head in self.heads:
            self._start_serve(head)
        for head in self.heads:
            self._start_keepalived(head, [h.address for h in self.heads if h is not head])

    def _start_serve(self, head: Head) -> None:
        head.state_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("BCM_")}
        env.update(BCM_STATE_DIR=str(head.state_dir), BCM_DATABASE_URL=self.database_url,
                   BCM_HA__LEASE_S=str(self.lease_s), BCM_HA__ADDRESS=f"{head.address}:{PORT}")  # fmt: skip
        log = open(self.work / f"head{head.index}.log", "ab")  # noqa: SIM115 - handed to the child
        try:
            head.serve = subprocess.Popen(
                ["ip", "netns", "exec", head.netns, sys.executable, "-m", "cli.main", "serve",
                 "--host", "0.0.0.0", "--port", str(PORT)],
                env=env, cwd=Path(__file__).resolve().parents[2], stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        finally:
            log.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if head.serve.poll() is not None:
                raise LabError(f"bcm serve on head {head.index} exited: {self._tail(head)}")
            ok = subprocess.run(["ip", "netns", "exec", head.netns, "curl", "-sf", "-m", "1", "-o", "/dev/null",
                                 f"http://127.0.0.1:{PORT}/healthz"], check=False)  # fmt: skip
            if ok.returncode == 0:
                return
            time.sleep(0.2)
        raise LabError(f"bcm serve on head {head.index} did not answer within 60 s: {self._tail(head)}")

    def _tail(self, head: Head) -> str:
        return (self.work / f"head{head.index}.log").read_text(errors="replace")[-1500:]

    def _start_keepalived(self, head: Head, peers: list[str]) -> None:
        d = self.work / f"ka{head.index}"
        d.mkdir(parents=True, exist_ok=True)
        check = d / "chk.sh"
        check.write_text(CHECK.format(port=PORT))
        os.chmod(check, 0o700)  # keepalived refuses a script others may write
        conf = d / "keepalived.conf"
        conf.write_text(KEEPALIVED.format(
            name=f"{self.name}{head.index}", check=check, router_id=ROUTER_ID, priority=150 - head.index,
            advert=self.advert_s, address=head.address, peers="\n".join(f"        {p}" for p in peers),
            vip=self.vip, prefix=self.net.prefixlen,
        ))  # fmt: skip
        log = open(d / "keepalived.log", "ab")  # noqa: SIM115 - handed to the child
        try:
            head.keepalived = subprocess.Popen(
                ["ip", "netns", "exec", head.netns, "keepalived", "-n", "-l", "-D", "-P", "-f", str(conf),
                 "-p", str(d / "keepalived.pid"), "-r", str(d / "vrrp.pid")],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        finally:
            log.close()

    def holders(self) -> list[int]:
        """The heads holding the service address now (more than one only while one is frozen)."""
        out = []
        for head in self.heads:
            shown = procs.run(["ip", "-n", head.netns, "-4", "-o", "addr", "show", "dev", "eth0"])
            if f" {self.vip}/" in shown:
                out.append(head.index)
        return out

    def head(self, index: int) -> Head:
        return self.heads[index - 1]

    def kill(self, index: int) -> None:
        """kill -9 of a head's bcm serve (its keepalived stays and drops the address on the failed check)."""
        for pid in self._serve_pids(self.head(index)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def freeze(self, index: int) -> None:
        """SIGSTOP a head's bcm serve and keepalived: a paused machine."""
        self._signal(self.head(index), signal.SIGSTOP)

    def thaw(self, index: int) -> None:
        self._signal(self.head(index), signal.SIGCONT)

    def _serve_pids(self, head: Head) -> list[int]:
        """`ip netns exec` execs the server itself: the Popen's pid is bcm serve's."""
        return [head.serve.pid] if head.serve is not None and head.serve.poll() is None else []

    def _signal(self, head: Head, sig: signal.Signals) -> None:
        pids = self._serve_pids(head)
        if head.keepalived is not None and head.keepalived.poll() is None:
            pids += [head.keepalived.pid, *procs.children(head.keepalived.pid)]
        procs.send(pids, sig)

    def down(self) -> None:
        for head in self.heads:
            self._signal(head, signal.SIGCONT)
            for proc in (head.keepalived, head.serve):
                if proc is not None and proc.poll() is None:
                    proc.terminate()
            for proc in (head.keepalived, head.serve):
                if proc is not None:
                    try:
                        proc.wait(15)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait(5)
        leftover = procs.pids_in_namespaces("net", [i for h in self.heads
                                                    if (i := procs.netns_file_id(Path("/run/netns") / h.netns))])  # fmt: skip
        procs.send(leftover, signal.SIGKILL)
        made = [ns for ns in [h.netns for h in self.heads] + [self.bridge_ns] if (Path("/run/netns") / ns).exists()]
        net.delete_netns(made)  # only what exists: an `up` that failed half-way is taken down too
        if net.link_exists(self.host_if):
            net.delete_link(self.host_if)
        self.heads = []
