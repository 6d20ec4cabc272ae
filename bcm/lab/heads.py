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
bcm), :meth:`Heads.freeze` / :meth:`Heads.thaw` (SIGSTOP/SIGCONT of its bcm and keepalived),
:meth:`Heads.start` (a killed head's bcm again).

The processes are detached (a session of their own, stdin from /dev/null, output to logs in ``work``), so
they outlive the command that started them (`bcm lab up --heads 2`). ``<work>/heads.json`` (0600: it holds
the database URL) records each process as (pid, start time): a later command (`bcm lab head kill 1`,
`bcm lab down`) finds them through :meth:`Heads.load` and never signals a stranger that reused a pid.
Teardown does not trust that file alone: it also kills whatever runs in namespaces named after the heads.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from bcm.lab import net, procs
from bcm.lab.errors import LabError

PORT = 8470
ROUTER_ID = 47
MIN_HEADS, MAX_HEADS = 2, 5
DEFAULT_SUBNET = "198.18.229.0/24"
STATE_FILE = "heads.json"
SERVE_READY_S = 60.0
STOP_TIMEOUT_S = 15.0
EXAMPLE_URL = "postgresql+psycopg://bcm@/bcm?host=/var/run/postgresql"
_NAME = re.compile(r"[a-z][a-z0-9-]{0,29}")  # a lab name (24 at most) and "ha"
CHECK = """#!/bin/sh
# keepalived's check: this head's bcm leads (its database lease), else the service address goes.
# keepalived runs it once a second (whole seconds only). No bcm here (connection refused): fail at once.
# bcm here but not leading (503): ask again every 0.1 s for up to 0.9 s, so that a head whose bcm has just
# taken the lease is seen within 0.1 s, not at the next whole second (bench/ha.py: 3.1 s to 2.6 s).
# Bounded by time: the last question starts before 0.9 s and curl gives up after 1 s, inside timeout 2.
start=$(date +%s%N)
while :; do
    curl -sf -m 1 -o /dev/null http://127.0.0.1:{port}/leaderz
    case $? in
        0) exit 0 ;;
        7) exit 1 ;;
    esac
    [ $(( ($(date +%s%N) - start) / 1000000 )) -lt 900 ] || exit 1
    sleep 0.1
done
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
    rise {rise}
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


@contextmanager
def socket_cluster(prefix: str = "bcmheads", version: str = "15") -> Iterator[str]:
    """A PostgreSQL cluster of its own for a drill (Debian's pg_createcluster on a free port), trusted on its
    socket, which every head namespace sees; role and database ``bcm``. Dropped on exit. Yields the URL."""
    import uuid

    from bcm.devserver import free_port

    def run(*argv: str) -> None:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise LabError(f"{' '.join(argv[:6])}: {done.stderr.strip()[-500:]}")

    name, port = f"{prefix}{uuid.uuid4().hex[:6]}", free_port()
    run("pg_createcluster", version, name, "-p", str(port), "--start-conf", "manual")
    try:
        Path(f"/etc/postgresql/{version}/{name}/pg_hba.conf").write_text(
            "local all all trust\nhost all all 127.0.0.1/32 trust\n"
        )
        run("pg_ctlcluster", "--skip-systemctl-redirect", version, name, "start")
        psql = [
            "runuser",
            "-u",
            "postgres",
            "--",
            "psql",
            "-h",
            "/var/run/postgresql",
            "-p",
            str(port),
            "-qc",
        ]
        for sql in ("CREATE ROLE bcm LOGIN SUPERUSER", "CREATE DATABASE bcm OWNER bcm"):
            run(*psql, sql)
        yield f"postgresql+psycopg://bcm@/bcm?host=/var/run/postgresql&port={port}"
    finally:
        subprocess.run(
            ["pg_dropcluster", "--stop", version, name], capture_output=True, timeout=120, check=False
        )


def check_database_url(url: str | None, subnet: str = DEFAULT_SUBNET) -> str:
    """The URL if every head can share it; else a LabError saying what to give instead (no I/O)."""
    if not url:
        raise LabError(
            f"several heads need --database-url, a PostgreSQL database they share (e.g. {EXAMPLE_URL})"
        )
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise LabError(f"--database-url is not a database URL (e.g. {EXAMPLE_URL})") from None
    backend = parsed.get_backend_name()
    if backend != "postgresql":
        why = "SQLite is one file on one machine" if backend == "sqlite" else f"not {backend}"
        raise LabError(
            f"--database-url: several heads share one PostgreSQL database, {why} (e.g. {EXAMPLE_URL})"
        )
    query_hosts = parsed.query.get("host", ())
    hosts = [parsed.host] if parsed.host else []
    hosts += [query_hosts] if isinstance(query_hosts, str) else list(query_hosts)
    for host in hosts:
        if host.startswith("/"):
            continue  # a socket directory: every namespace sees the host's file system
        try:
            inside = ipaddress.ip_address(host.rsplit(":", 1)[0]) in ipaddress.IPv4Network(subnet)
        except ValueError:
            inside = False
        if not inside:
            raise LabError(
                f"the heads' namespaces reach only {subnet}, not {host}: give PostgreSQL's socket "
                f"(e.g. {EXAMPLE_URL})"
            )
    return url


@dataclass
class Head:
    index: int
    netns: str
    address: str
    state_dir: Path
    serve_pid: int | None = None
    serve_started: int | None = None
    keepalived_pid: int | None = None
    keepalived_started: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.address}:{PORT}"

    @property
    def serve_alive(self) -> bool:
        return procs.is_alive(self.serve_pid, self.serve_started)

    @property
    def keepalived_alive(self) -> bool:
        return procs.is_alive(self.keepalived_pid, self.keepalived_started)

    def pids(self) -> list[int]:
        """bcm serve, keepalived and keepalived's children (its VRRP process), those that run."""
        found = [self.serve_pid] if self.serve_alive and self.serve_pid else []
        if self.keepalived_alive and self.keepalived_pid:
            found += [self.keepalived_pid, *procs.children(self.keepalived_pid)]
        return found

    def state(self, pid: int | None, alive: bool) -> str:
        return "down" if not alive or pid is None else "frozen" if procs.is_stopped(pid) else "up"

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "netns": self.netns,
            "address": self.address,
            "state_dir": str(self.state_dir),
            "serve_pid": self.serve_pid,
            "serve_started": self.serve_started,
            "keepalived_pid": self.keepalived_pid,
            "keepalived_started": self.keepalived_started,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Head:
        return cls(**{**data, "state_dir": Path(data["state_dir"])})


@dataclass
class Heads:
    """``Heads(work, n, database_url)``; ``up()``, drills, ``down()`` (everything it made goes);
    ``Heads.load(work)`` in another process finds what an ``up()`` started."""

    work: Path
    count: int = 2
    database_url: str = ""
    name: str = "bcmha"
    subnet: str = DEFAULT_SUBNET
    lease_s: float = 2.0
    advert_s: float = 0.1
    # successes of the check (once a second: keepalived takes whole seconds) before a head may take the
    # address: one is enough, a 200 from /leaderz means this head's bcm holds the database lease; a second
    # cost up to a second more on every failover (bench/ha.py shows both)
    check_rise: int = 1
    heads: list[Head] = field(default_factory=list)
    _children: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.work = Path(self.work).absolute()
        if not _NAME.fullmatch(self.name):
            raise LabError(f"heads name {self.name!r} must be a short lowercase DNS label")
        try:
            subnet = ipaddress.IPv4Network(self.subnet)
        except ValueError as exc:
            raise LabError(f"heads subnet {self.subnet!r}: {exc}") from None
        if not subnet.subnet_of(ipaddress.IPv4Network(net.LAB_SPACE)) or subnet.prefixlen > 24:
            raise LabError(f"heads subnet {self.subnet} must be a /24 or larger inside {net.LAB_SPACE}")

    @classmethod
    def load(cls, work: Path) -> Heads | None:
        """The heads an ``up()`` recorded in ``work`` (any process), or None when none are up."""
        file = Path(work) / STATE_FILE
        try:
            data = json.loads(file.read_text())
            heads = cls(
                Path(work),
                data["count"],
                data["database_url"],
                name=data["name"],
                subnet=data["subnet"],
                lease_s=data["lease_s"],
                advert_s=data["advert_s"],
                check_rise=data.get("check_rise", 1),
            )
            heads.heads = [Head.from_dict(item) for item in data["heads"]]
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as exc:
            raise LabError(
                f"heads state file {file} is unreadable ({exc}); `bcm lab down` cleans up"
            ) from None
        return heads

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

    def token_file(self) -> Path:
        for head in self.heads:  # the first head to start made the admin token
            file = head.state_dir / "admin.token"
            if file.exists():
                return file
        raise LabError("no head wrote an admin token")

    def token(self) -> str:
        return self.token_file().read_text().strip()

    # ---- up ---------------------------------------------------------------------------------------

    def up(self) -> None:
        """Take down heads left from before, then start ``count`` heads; a failed start leaves nothing."""
        if not MIN_HEADS <= self.count <= MAX_HEADS:
            raise LabError(f"a lab has {MIN_HEADS} to {MAX_HEADS} heads, not {self.count}")
        check_database_url(self.database_url, self.subnet)
        if os.geteuid() != 0:
            raise LabError("the lab's heads need root (network namespaces, keepalived)")
        net.keep_lab_space_local()  # before any lab address exists
        self.work.mkdir(parents=True, exist_ok=True)
        with self._locked():
            self._teardown()
            try:
                self._bring_up()
            except BaseException:
                self._teardown()
                raise

    def _bring_up(self) -> None:
        prefix = self.net.prefixlen
        procs.run(["ip", "netns", "add", self.bridge_ns])
        procs.run(
            ["ip", "-n", self.bridge_ns, "-batch", "-"],
            stdin="link set lo up\nlink add br0 type bridge stp_state 0 forward_delay 0\nlink set br0 up\n",
        )
        host_addr = self.net.network_address + 254
        procs.run(
            [
                "ip",
                "link",
                "add",
                self.host_if,
                "type",
                "veth",
                "peer",
                "name",
                "p-host",
                "netns",
                self.bridge_ns,
            ]
        )
        procs.run(["ip", "-n", self.bridge_ns, "link", "set", "p-host", "master", "br0", "up"])
        procs.run(["ip", "addr", "add", f"{host_addr}/{prefix}", "dev", self.host_if])
        procs.run(["ip", "link", "set", self.host_if, "up"])
        addresses = [str(self.net.network_address + 10 + i) for i in range(1, self.count + 1)]
        for i, address in enumerate(addresses, 1):
            ns = f"{self.name}-{i}"
            procs.run(["ip", "netns", "add", ns])
            procs.run(
                [
                    "ip",
                    "-n",
                    self.bridge_ns,
                    "link",
                    "add",
                    f"p-{i}",
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    ns,
                ]
            )
            procs.run(["ip", "-n", self.bridge_ns, "link", "set", f"p-{i}", "master", "br0", "up"])
            procs.run(
                ["ip", "-n", ns, "-batch", "-"],
                stdin=f"link set lo up\naddr add {address}/{prefix} dev eth0\nlink set eth0 up\n",
            )
            self.heads.append(Head(i, ns, address, self.work / f"head{i}"))
        self._save()
        for head in self.heads:
            self._start_serve(head)
            self._save()
        for head in self.heads:
            self._start_keepalived(head, [h.address for h in self.heads if h is not head])
            self._save()

    def _spawn(
        self, argv: list[str], log_path: Path, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> subprocess.Popen[bytes]:
        """A detached child: its own session, no terminal, output to its log."""
        log = open(log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            child = subprocess.Popen(
                argv,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        self._children.append(child)
        return child

    def _start_serve(self, head: Head) -> None:
        head.state_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("BCM_")}
        env.update(
            BCM_STATE_DIR=str(head.state_dir),
            BCM_DATABASE_URL=self.database_url,
            BCM_HA__LEASE_S=str(self.lease_s),
            BCM_HA__ADDRESS=f"{head.address}:{PORT}",
        )
        # `ip netns exec` execs the server itself: the child's pid is bcm serve's
        serve = self._spawn(
            [
                "ip",
                "netns",
                "exec",
                head.netns,
                sys.executable,
                "-m",
                "cli.main",
                "serve",
                "--host",
                "0.0.0.0",
                "--port",
                str(PORT),
            ],
            self.work / f"head{head.index}.log",
            env,
            Path(__file__).resolve().parents[2],
        )
        head.serve_pid, head.serve_started = serve.pid, procs.start_time(serve.pid)
        deadline = time.monotonic() + SERVE_READY_S
        while time.monotonic() < deadline:
            if serve.poll() is not None:
                raise LabError(f"bcm serve on head {head.index} exited: {self._tail(head)}")
            ok = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    head.netns,
                    "curl",
                    "-sf",
                    "-m",
                    "1",
                    "-o",
                    "/dev/null",
                    f"http://127.0.0.1:{PORT}/healthz",
                ],
                stdin=subprocess.DEVNULL,
                check=False,
            )
            if ok.returncode == 0:
                return
            time.sleep(0.2)
        raise LabError(
            f"bcm serve on head {head.index} did not answer within {SERVE_READY_S:.0f} s: {self._tail(head)}"
        )

    def _tail(self, head: Head) -> str:
        return (self.work / f"head{head.index}.log").read_text(errors="replace")[-1500:]

    def _start_keepalived(self, head: Head, peers: list[str]) -> None:
        d = self.work / f"ka{head.index}"
        d.mkdir(parents=True, exist_ok=True)
        check = d / "chk.sh"
        check.write_text(CHECK.format(port=PORT))
        os.chmod(check, 0o700)  # keepalived refuses a script others may write
        conf = d / "keepalived.conf"
        conf.write_text(
            KEEPALIVED.format(
                name=f"{self.name}{head.index}",
                check=check,
                router_id=ROUTER_ID,
                priority=150 - head.index,
                advert=self.advert_s,
                address=head.address,
                peers="\n".join(f"        {p}" for p in peers),
                vip=self.vip,
                prefix=self.net.prefixlen,
                rise=self.check_rise,
            )
        )
        keepalived = self._spawn(
            [
                "ip",
                "netns",
                "exec",
                head.netns,
                "keepalived",
                "-n",
                "-l",
                "-D",
                "-P",
                "-f",
                str(conf),
                "-p",
                str(d / "keepalived.pid"),
                "-r",
                str(d / "vrrp.pid"),
            ],
            d / "keepalived.log",
        )
        head.keepalived_pid, head.keepalived_started = keepalived.pid, procs.start_time(keepalived.pid)

    # ---- looking --------------------------------------------------------------------------------------

    def holders(self) -> list[int]:
        """The heads holding the service address now (more than one only while one is frozen)."""
        out = []
        for head in self.heads:
            shown = procs.run(["ip", "-n", head.netns, "-4", "-o", "addr", "show", "dev", "eth0"])
            if f" {self.vip}/" in shown:
                out.append(head.index)
        return out

    def leaders(self) -> list[int]:
        """The heads whose bcm answers ``/leaderz`` with 200 now (a frozen one is not asked)."""
        found = []
        for head in self.heads:
            if head.state(head.serve_pid, head.serve_alive) != "up":
                continue
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{head.url}/leaderz", timeout=1).status_code == 200:
                    found.append(head.index)
        return found

    def wait_leader(self, timeout_s: float = 60.0) -> int:
        """The head that leads and alone holds the service address, once it does (bounded)."""
        deadline = time.monotonic() + timeout_s
        while True:  # bounded by timeout_s
            holders = self.holders()
            if len(holders) == 1 and holders == self.leaders():
                return holders[0]
            if time.monotonic() > deadline:
                raise LabError(
                    f"no head led and held {self.vip} alone within {timeout_s:.0f} s (holding: "
                    f"{holders or 'none'}); see the logs in {self.work}"
                )
            time.sleep(0.2)

    def status(self) -> list[dict[str, Any]]:
        """Each head: address, its processes and their state, whether it holds the address and leads."""
        holders, leaders = set(self.holders()), set(self.leaders())
        return [
            {
                "head": h.index,
                "netns": h.netns,
                "address": h.address,
                "url": h.url,
                "serve": h.state(h.serve_pid, h.serve_alive),
                "serve_pid": h.serve_pid,
                "keepalived": h.state(h.keepalived_pid, h.keepalived_alive),
                "keepalived_pid": h.keepalived_pid,
                "service_address": h.index in holders,
                "leading": h.index in leaders,
            }
            for h in self.heads
        ]

    def head(self, index: int) -> Head:
        if not self.heads:
            raise LabError("no heads are up (bcm lab up --heads 2 --database-url …)")
        if not 1 <= index <= len(self.heads):
            raise LabError(f"no head {index}: the heads are 1 to {len(self.heads)}")
        return self.heads[index - 1]

    # ---- drills ---------------------------------------------------------------------------------------

    def kill(self, index: int) -> None:
        """kill -9 of a head's bcm serve (its keepalived stays and drops the address on the failed check)."""
        head = self.head(index)
        if head.serve_alive and head.serve_pid:
            procs.send([head.serve_pid], signal.SIGKILL)
            procs.wait_gone([head.serve_pid], STOP_TIMEOUT_S)
        self._reap()

    def start(self, index: int) -> None:
        """A head's bcm serve again (after a kill): a new server id on the same state dir."""
        head = self.head(index)
        if not head.serve_alive:
            self._start_serve(head)
            self._save()

    def freeze(self, index: int) -> None:
        """SIGSTOP a head's bcm serve and keepalived: a paused machine."""
        procs.send(self.head(index).pids(), signal.SIGSTOP)

    def thaw(self, index: int) -> None:
        procs.send(self.head(index).pids(), signal.SIGCONT)

    # ---- down ----------------------------------------------------------------------------------------

    def down(self) -> None:
        """Stop every head's processes, then anything else in their namespaces; remove the namespaces, the
        host's veth and the state file (logs and the heads' state dirs stay). Works from any process, after
        a half-made ``up()`` and without a state file."""
        net.keep_lab_space_local()
        with self._locked() if self.work.exists() else contextlib.nullcontext():
            self._teardown()

    def _teardown(self) -> None:
        if not self.heads:
            with contextlib.suppress(LabError):  # a corrupt state file must not block cleaning up
                self.heads = (Heads.load(self.work) or self).heads
        graceful = [pid for head in self.heads for pid in head.pids()]
        procs.send(graceful, signal.SIGCONT)  # a frozen process must run to exit
        procs.send(graceful, signal.SIGTERM)
        procs.wait_gone(graceful, STOP_TIMEOUT_S)
        pattern = re.compile(rf"{re.escape(self.name)}-(br|[0-9]+)")
        namespaces = [ns for ns in net.netns_names() if pattern.fullmatch(ns)]
        ids = [i for i in (procs.netns_file_id(net.NETNS_DIR / ns) for ns in namespaces) if i]
        for _ in range(5):  # SIGKILL reaches stopped processes too
            victims = [pid for head in self.heads for pid in head.pids()]
            victims += procs.pids_in_namespaces("net", ids)
            if not victims:
                break
            procs.send(victims, signal.SIGKILL)
            procs.wait_gone(victims, 5)
        self._reap()
        net.delete_netns(namespaces)
        net.delete_link(self.host_if)
        (self.work / STATE_FILE).unlink(missing_ok=True)
        self.heads = []

    def _reap(self) -> None:
        for child in list(self._children):
            if child.poll() is not None:
                self._children.remove(child)

    # ---- state file ----------------------------------------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.work / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _save(self) -> None:
        data = {
            "name": self.name,
            "subnet": self.subnet,
            "count": self.count,
            "database_url": self.database_url,
            "lease_s": self.lease_s,
            "advert_s": self.advert_s,
            "check_rise": self.check_rise,
            "service_address": self.vip,
            "heads": [head.to_dict() for head in self.heads],
        }
        tmp = self.work / f"{STATE_FILE}.tmp"
        tmp.unlink(missing_ok=True)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, self.work / STATE_FILE)
