"""The Lab: bring up, inspect and tear down N SSH nodes on an isolated bridge, from any process.

State lives in ``<state_dir>/state.json``; every mutating call holds ``<state_dir>/lock``. Teardown
does not trust the state file alone: it also sweeps namespaces named after the lab, processes in
them or chrooted under the state dir, mounts under the state dir and the head's veth, so a crashed
``up()`` leaves nothing that the next ``up()`` or ``down()`` misses.
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
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bcm.lab import accounting, fakegpu, net, procs, rootfs, vm
from bcm.lab.errors import LabError
from bcm.lab.node import (
    LabNode,
    NodeDirs,
    exec_argv,
    generate_host_key,
    install_host_key,
    log_tail,
    remove_dirs,
    spawn,
    sshd_of,
    start_script,
    write_node_files,
)

DEFAULT_STATE_DIR = Path("/var/lib/bcm-lab")
DEFAULT_SUBNET = "198.18.0.0/24"
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 5.0
# Short enough that "<name>-<prefix><index>" stays a usable namespace name and host name.
_NAME = re.compile(r"[a-z][a-z0-9]{0,11}(-[a-z0-9]{1,11})?")

FREEZE_WAIT_S = 10.0  # how long freeze() waits for the node's sshd to show as stopped


class Lab:
    """A lab of SSH nodes in network namespaces on one bridge.

    ``name`` names the bridge namespace; node namespaces are ``<name>-<hostname>`` and the head's
    veth is ``host_if`` (default ``<name>-prov``) with the subnet's first address.
    """

    def __init__(
        self,
        state_dir: Path = DEFAULT_STATE_DIR,
        name: str = "bcmlab",
        prefix: str = "node",
        *,
        subnet: str = DEFAULT_SUBNET,
        host_if: str | None = None,
        cache_dir: Path = rootfs.DEFAULT_CACHE_DIR,
    ) -> None:
        if not _NAME.fullmatch(name) or not _NAME.fullmatch(prefix):
            raise LabError(f"lab name {name!r} and prefix {prefix!r} must be short lowercase DNS labels")
        self.state_dir = Path(state_dir).absolute()
        self.name = name
        self.prefix = prefix
        self.subnet = ipaddress.IPv4Network(subnet)
        if not self.subnet.subnet_of(ipaddress.IPv4Network("198.18.0.0/15")):
            raise LabError(f"lab subnet {subnet} must lie inside 198.18.0.0/15 (benchmark space)")
        self.host_if = host_if or f"{name}-prov"[:15]
        self.cache_dir = cache_dir
        self._children: dict[str, subprocess.Popen[bytes]] = {}

    # ---- public surface -------------------------------------------------------------------------

    @property
    def netns(self) -> str:
        """The bridge namespace (holds br0); VMs' taps go here too."""
        return self.name

    @property
    def bridge(self) -> str:
        return net.BRIDGE

    @property
    def head_ip(self) -> str:
        """The head node's provisioning address (on ``host_if`` in the host namespace)."""
        return str(net.head_address(self.subnet))

    def up(
        self,
        n: int,
        authorized_keys: list[str],
        *,
        gpus: int = 0,
        slurm: bool = False,
        vms: int = 0,
        vm_bmc_password: str | None = None,
        vm_disk_bytes: int | None = None,
    ) -> list[LabNode]:
        """Clean any leftovers, then start n nodes that accept the given public keys as root.

        ``gpus``: each node gets that many simulated H100s (nvidia-smi, character devices for Slurm,
        recorded NVML values for the agent). ``slurm``: prepare what `bcm wlm deploy slurm` needs on
        these nodes (the host's MariaDB shared with every node, an accounting database, lab settings).
        """
        if n < 0 or n > net.max_nodes(self.subnet):
            raise LabError(f"a lab on {self.subnet} holds 0 to {net.max_nodes(self.subnet)} nodes, not {n}")
        if gpus and not 1 <= gpus <= fakegpu.MAX_GPUS:
            raise LabError(f"a lab node has 0 to {fakegpu.MAX_GPUS} simulated GPUs, not {gpus}")
        net.keep_lab_space_local()
        net.fit_neighbour_table(n)
        with self._locked():
            self._teardown()
            try:
                nodes = self._bring_up(n, authorized_keys)
                for node in nodes if gpus else []:
                    fakegpu.install(node, gpus)
                if slurm:
                    self._prepare_slurm(nodes)
                if vms:
                    vm.up(self.state_dir, self.netns, self.subnet, vms, vm_bmc_password, vm_disk_bytes)
                return nodes
            except BaseException:
                self._teardown()
                raise

    def down(self) -> None:
        """Stop every node and remove every namespace, mount, process, veth and file the lab made.

        The unreachable route for 198.18.0.0/15 stays (and is added if missing): lab addresses must not
        leave the machine once the lab's own routes are gone.
        """
        net.keep_lab_space_local()
        with self._locked():
            self._teardown()
            self._drop_accounting()

    def status(self) -> list[LabNode]:
        """The recorded nodes with ``alive``/``frozen`` read from /proc now; [] when the lab is down."""
        self._reap()
        return [node.refresh() for node in self._load_nodes()]

    def node(self, name: str) -> LabNode:
        for node in self.status():
            if node.name == name:
                return node
        raise LabError(f"no lab node named {name!r}")

    def is_up(self) -> bool:
        return (net.NETNS_DIR / self.netns).exists() and self._state_file.exists()

    def stop(self, name: str) -> LabNode:
        """Stop a node's sshd gracefully (SIGTERM, then SIGKILL); its namespace and files stay."""
        with self._locked():
            return self._stop_node(self.node(name), graceful=True)

    def kill(self, name: str) -> LabNode:
        """SIGKILL a node's sshd (and with it every process in the node's PID namespace)."""
        with self._locked():
            return self._stop_node(self.node(name), graceful=False)

    def start(self, name: str) -> LabNode:
        """Start a stopped node's sshd again, same address and host key."""
        with self._locked():
            node = self.node(name)
            if node.alive:
                return node
            self._start_nodes([node])
            self._save_node(node)
            if (self.state_dir / accounting.SETTINGS_FILE).exists() and accounting.MYSQL_SOCKET.exists():
                accounting.share_mysql_socket(node.refresh())
            return node.refresh()

    def freeze(self, name: str) -> LabNode:
        """SIGSTOP every process of the node: TCP connects still succeed, but no SSH banner comes."""
        node = self.node(name)
        procs.send(self._node_pids(node), signal.SIGSTOP)
        # a signal is delivered asynchronously: on a busy machine /proc may still say "running" for a while
        deadline = time.monotonic() + FREEZE_WAIT_S
        while not node.refresh().frozen and node.alive and time.monotonic() < deadline:  # bounded
            time.sleep(0.05)
        return node

    def thaw(self, name: str) -> LabNode:
        """Undo freeze()."""
        node = self.node(name)
        procs.send(self._node_pids(node), signal.SIGCONT)
        return node.refresh()

    def rekey(self, name: str) -> LabNode:
        """Give a node a new host key (restarting its sshd); returns the node with the new public key."""
        with self._locked():
            node = self.node(name)
            was_alive = node.alive
            self._stop_node(node, graceful=True)
            dirs = self._dirs(node.name)
            node.host_key_public = generate_host_key(dirs, node.name)
            install_host_key(dirs)
            if was_alive:
                self._start_nodes([node])
            self._save_node(node)
            return node.refresh()

    def exec_argv(self, name: str, argv: list[str]) -> list[str]:
        """Command line that runs argv inside the node (its namespaces and root filesystem)."""
        return exec_argv(self.node(name), argv)

    def run(self, name: str, argv: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run argv inside the node and return the finished process (no exception on non-zero exit)."""
        return subprocess.run(
            self.exec_argv(name, argv), capture_output=True, text=True, timeout=timeout, check=False
        )

    def known_hosts(self) -> str:
        """known_hosts text pinning every node's pre-registered host key."""
        return "".join(node.known_hosts_line() + "\n" for node in self._load_nodes())

    def flush_neighbours(self) -> None:
        net.flush_neighbours(self.netns, self.host_if)

    # ---- bring-up ---------------------------------------------------------------------------------

    def _bring_up(self, n: int, authorized_keys: list[str]) -> list[LabNode]:
        lower = rootfs.ensure_rootfs(self.cache_dir)
        net.create_network(self.netns, self.host_if, self.subnet)
        width = max(2, len(str(n)))
        nodes = [self._new_node(i, f"{self.prefix}{i:0{width}d}") for i in range(1, n + 1)]
        self._save(nodes, lower)
        net.add_nodes(
            self.netns,
            [
                net.NodeLink(
                    netns=node.netns,
                    bridge_port=f"vn{node.index}",
                    mac=node.mac,
                    port_mac=net.port_mac(node.index),
                    address=f"{node.ip}/{self.subnet.prefixlen}",
                )
                for node in nodes
            ],
        )
        hosts = self._hosts_file(nodes)

        def prepare(node: LabNode) -> None:
            dirs = self._dirs(node.name)
            dirs.make()
            node.host_key_public = generate_host_key(dirs, node.name)
            install_host_key(dirs)
            write_node_files(dirs, node.name, authorized_keys, hosts)

        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(prepare, nodes))
        self._save(nodes, lower)
        self._start_nodes(nodes)
        self._save(nodes, lower)
        self.flush_neighbours()
        return [node.refresh() for node in nodes]

    def _prepare_slurm(self, nodes: list[LabNode]) -> None:
        """Socket, database and settings for a Slurm deploy onto these nodes (see bcm.lab.accounting)."""
        settings: dict[str, object] = dict(accounting.LAB_SLURM_SETTINGS)
        if accounting.mariadb_installed():
            db = accounting.AccountingDb.for_lab(self.name, self.state_dir)
            for node in nodes:
                accounting.share_mysql_socket(node)
            settings |= {"storage_user": db.user, "storage_loc": db.name}
        else:  # `bcm wlm deploy slurm` says why when it needs the database
            (self.state_dir / accounting.PASS_FILE).unlink(missing_ok=True)
        accounting.write_slurm_defaults(self.state_dir, [node.name for node in nodes], settings)

    def _drop_accounting(self) -> None:
        db = accounting.AccountingDb.of_lab(self.state_dir)
        if db is not None and accounting.MYSQL_SOCKET.exists():
            with contextlib.suppress(LabError):  # MariaDB down: nothing more to clean from here
                db.drop()
        for name in (accounting.SETTINGS_FILE, accounting.PASS_FILE):
            (self.state_dir / name).unlink(missing_ok=True)

    def _new_node(self, index: int, hostname: str) -> LabNode:
        return LabNode(
            name=hostname,
            index=index,
            netns=f"{self.name}-{hostname}",
            mac=net.node_mac(index),
            ip=str(net.node_address(self.subnet, index)),
            host_key_public="",
            rootfs=str(self._dirs(hostname).root),
            upper=str(self._dirs(hostname).upper),
        )

    def _hosts_file(self, nodes: list[LabNode]) -> str:
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        lines += [f"{node.ip}\t{node.name}" for node in nodes]
        return "\n".join(lines) + "\n"

    def _start_nodes(self, nodes: list[LabNode]) -> None:
        """Spawn all at once, then wait until each sshd listens (or report the first that died)."""
        lower = Path(self._load_state().get("rootfs") or rootfs.ensure_rootfs(self.cache_dir))
        started: dict[str, subprocess.Popen[bytes]] = {}
        for node in nodes:
            dirs = self._dirs(node.name)
            started[node.name] = spawn(node.netns, start_script(lower, dirs, node.name), dirs.log)
            self._children[node.name] = started[node.name]
        deadline = time.monotonic() + READY_TIMEOUT_S + 0.2 * len(nodes)
        pending = {node.name: node for node in nodes}
        while pending:
            for name, node in list(pending.items()):
                child = started[name]
                if child.poll() is not None:
                    raise LabError(
                        f"lab node {name} exited during start (exit {child.returncode}):\n"
                        + log_tail(self._dirs(name))
                    )
                sshd = sshd_of(child.pid)
                if sshd is not None:
                    node.parent_pid = child.pid
                    node.sshd_pid = sshd
                    node.sshd_started = procs.start_time(sshd)
                    del pending[name]
            if pending and time.monotonic() > deadline:
                name = next(iter(pending))
                raise LabError(f"lab node {name} did not start sshd in time:\n" + log_tail(self._dirs(name)))
            if pending:
                time.sleep(0.05)

    # ---- stopping and teardown --------------------------------------------------------------------

    def _node_pids(self, node: LabNode) -> list[int]:
        """Every process in the node's PID namespace (sshd, sessions, anything entered later)."""
        if not node.alive or node.sshd_pid is None:
            return []
        pidns = procs.ns_id(node.sshd_pid, "pid")
        return procs.pids_in_namespaces("pid", [pidns]) if pidns else []

    def _stop_node(self, node: LabNode, *, graceful: bool) -> LabNode:
        # The unshare parent ignores SIGTERM; signal sshd (PID 1 of the node), then kill the parent.
        if node.alive and node.sshd_pid is not None:
            if graceful:
                procs.send([node.sshd_pid], signal.SIGTERM)
                procs.send([node.sshd_pid], signal.SIGCONT)  # a frozen sshd must run to exit
                procs.wait_gone([node.sshd_pid], STOP_TIMEOUT_S)
            procs.send([node.sshd_pid], signal.SIGKILL)
            procs.wait_gone([node.sshd_pid], STOP_TIMEOUT_S)
        if node.parent_pid is not None and procs.start_time(node.parent_pid) is not None:
            procs.send([node.parent_pid], signal.SIGKILL)
            procs.wait_gone([node.parent_pid], STOP_TIMEOUT_S)
        self._reap()
        node.refresh()
        self._save_node(node)
        return node

    def _lab_netns(self) -> list[str]:
        return [ns for ns in net.netns_names() if ns == self.netns or ns.startswith(self.netns + "-")]

    def _teardown(self) -> None:
        namespaces = self._lab_netns()
        ns_ids = [i for i in (procs.netns_file_id(net.NETNS_DIR / ns) for ns in namespaces) if i]
        try:
            recorded = [n.sshd_pid for n in self._load_nodes() if n.refresh().alive and n.sshd_pid]
        except LabError:  # a corrupt state file must not block cleaning up
            recorded = []
        # SIGKILL reaches even stopped (frozen) processes; a node's PID 1 dying takes its sessions along.
        for _ in range(5):
            victims = set(recorded) | set(procs.pids_in_namespaces("net", ns_ids))
            victims |= set(procs.pids_rooted_under(self._nodes_dir))
            victims.discard(os.getpid())
            recorded = []
            if not victims:
                break
            procs.send(victims, signal.SIGKILL)
            procs.wait_gone(sorted(victims), STOP_TIMEOUT_S)
            self._reap()
        for point in procs.mounts_under(self._nodes_dir):
            procs.run(["umount", "--lazy", point])
        net.flush_neighbours(self.netns, self.host_if)
        net.delete_netns(namespaces)
        net.delete_link(self.host_if)
        if self._nodes_dir.exists():
            for sub in self._nodes_dir.iterdir():
                remove_dirs(NodeDirs(sub))
            self._nodes_dir.rmdir()
        vm.remove(self.state_dir)  # VMs and their BMCs (bcm/lab/vm.py)
        self._state_file.unlink(missing_ok=True)

    def _reap(self) -> None:
        for name, child in list(self._children.items()):
            if child.poll() is not None:
                del self._children[name]

    # ---- state file --------------------------------------------------------------------------------

    @property
    def _state_file(self) -> Path:
        return self.state_dir / "state.json"

    @property
    def _nodes_dir(self) -> Path:
        return self.state_dir / "nodes"

    def _dirs(self, hostname: str) -> NodeDirs:
        return NodeDirs(self._nodes_dir / hostname)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.state_dir / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _load_state(self) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads(self._state_file.read_text())
        except FileNotFoundError:
            return {}
        except json.JSONDecodeError as exc:
            raise LabError(f"lab state file {self._state_file} is corrupt; run `down` to clean up") from exc
        return data

    def _load_nodes(self) -> list[LabNode]:
        return [LabNode.from_dict(item) for item in self._load_state().get("nodes", [])]

    def _save(self, nodes: list[LabNode], lower: Path) -> None:
        data = {
            "name": self.name,
            "prefix": self.prefix,
            "subnet": str(self.subnet),
            "netns": self.netns,
            "bridge": self.bridge,
            "host_if": self.host_if,
            "head_ip": self.head_ip,
            "rootfs": str(lower),
            "nodes": [node.to_dict() for node in nodes],
        }
        tmp = self._state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, self._state_file)

    def _save_node(self, changed: LabNode) -> None:
        state = self._load_state()
        if not state:
            return
        nodes = [changed if node.name == changed.name else node for node in self._load_nodes()]
        self._save(nodes, Path(state["rootfs"]))
