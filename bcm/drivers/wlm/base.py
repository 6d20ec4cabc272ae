"""The workload-manager interface: what bcm asks of Slurm (and, later, Kubernetes), and the data it
gets back. Callers hold a :class:`WorkloadManager` from :func:`bcm.drivers.wlm.get` and never name one.

Contract of :class:`WorkloadManager`:

- ``plan`` is pure apart from the cluster's secrets directory (0700, files 0600): it renders the
  configuration files from a :class:`ClusterSpec` with the renderer it is handed, creates the secrets
  the cluster needs once (the munge key …), writes the rendered files there for Ansible to copy
  (``src:``), and returns the Ansible hosts and extra vars of the deploy. No secret value is ever in
  the plan: extra vars only name files.
- ``deploy`` runs the plan's playbook, blocking (callers run it in a worker thread); it returns
  per-host recaps and never raises for one host's failure.
- The async methods talk to the running cluster through its controller over SSH. Each call is
  bounded in time; a controller that does not answer raises RetryableDriverError, any other failure
  DriverError naming the controller and the reason.
- ``verify`` is all or nothing: one job step on every named node, each given one GPU; its
  :class:`VerifyResult` says which nodes ran and what they saw.
- Tenancy: ``tenancy_plan`` compares the accounts the model wants (:class:`AccountSpec`, departments
  with no parent, projects under them) with what the workload manager holds, and lists the changes
  (hand edits there show as ``drift``); it changes nothing. ``tenancy_apply`` makes the members'
  Unix users where jobs need them, runs the plan's changes in order, and returns the plan it ran;
  applying again right after finds nothing to change. Only accounts bcm made are ever touched.
- ``node_usage`` is a sample of who runs on which node now: one :class:`NodeUsage` per (node,
  account) with running work, the account as the workload manager names it (a Slurm account, a
  Kubernetes namespace: a project's), its GPUs split across the job's nodes. Nodes with nothing
  running are absent. The caller bounds and stores it (``bcm.services.wlm_usage``).
- Node states are the workload manager's own words, lower case (Slurm: ``idle``, ``drained``,
  ``idle*`` …); only the predicates here interpret them (``is_responding``, ``is_drained``,
  ``drained_by_bcm``), so callers never parse them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from bcm.drivers.ansible import AnsibleHost, PlaybookResult
from bcm.drivers.ssh import SshClient, Target

Render = Callable[..., str]
"""``render(template_path, **context) -> text``: the one template environment (bcm.services.render),
handed in so that drivers never import services."""


@dataclass(frozen=True)
class WlmNodeState:
    state: str  # the workload manager's long state, lower case
    reason: str | None = None  # why it is drained/down, as the workload manager records it


@dataclass(frozen=True)
class WlmHost:
    """One node as a plan needs it: address, pinned host key, inventoried facts and GPUs."""

    name: str
    address: str | None
    host_key: str | None
    facts: dict[str, Any] = field(default_factory=dict)
    gpus: list[tuple[int, str | None]] = field(default_factory=list)  # (index, product name)
    category: str | None = None
    gpu_memory: dict[int, int] = field(default_factory=dict)  # index -> MiB, where inventoried


@dataclass(frozen=True)
class Controller(Target):
    """How a driver reaches a cluster's controller: over SSH (the Target), and with the cluster's own
    credentials where the workload manager has an API of its own (``secrets_dir``, 0700)."""

    secrets_dir: Path | None = None


@dataclass(frozen=True)
class ClusterSpec:
    """A cluster as the database holds it: controller, member nodes (in order) and stored settings."""

    name: str
    controller: WlmHost
    members: list[WlmHost]
    settings: dict[str, Any]
    tenancy: bool = False  # departments exist: the workload manager enforces their accounts and limits


@dataclass
class DeployPlan:
    """Everything a deploy job needs; ``fingerprint`` is the sha256 of the cluster's shared secret."""

    cluster: str
    controller: str
    hosts: list[AnsibleHost]
    members: list[str]
    extravars: dict[str, Any]
    config: Any = None  # the workload manager's own cluster model (bcm.domain.slurm.SlurmCluster)
    fingerprint: str | None = None
    secrets_dir: Path | None = (
        None  # the cluster's 0700 directory, for drivers that talk to an API after Ansible
    )


@dataclass(frozen=True)
class AnsibleAccess:
    """How the head node reaches the nodes for a playbook run."""

    key_file: Path
    work_dir: Path
    username: str = "root"
    connect_timeout_s: float = 10.0


@dataclass
class VerifyResult:
    ok: bool
    message: str
    job_id: str | None = None
    nodes: dict[str, str] = field(default_factory=dict)  # node -> CUDA_VISIBLE_DEVICES seen by the step
    alloc_tres: str | None = None  # what accounting says the job was given (``gres/gpu=N`` …)
    output: str = ""


@dataclass(frozen=True)
class AccountSpec:
    """One account of the tenancy tree: a department (``parent`` None) or a project under one."""

    name: str
    parent: str | None
    fairshare: int
    gpu_limit: int | None  # projects: the most GPUs their jobs may hold at once
    users: tuple[str, ...] = ()
    gpu_deserved: int | None = None  # departments: their GPU quota; projects: their deserved GPUs


@dataclass(frozen=True)
class TenancyChange:
    """One step towards the model: ``add``/``modify``/``remove`` of an ``account`` or ``user`` association."""

    action: str
    kind: str
    name: str
    detail: str  # what changes, "have -> want" for a modification
    command: str  # what the workload manager is told, as one shell line
    drift: bool = False  # the workload manager's state was changed outside bcm


@dataclass
class TenancyPlan:
    cluster: str
    changes: list[TenancyChange] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what bcm cannot change here (a redeploy needed …)
    applied: bool = False


@dataclass(frozen=True)
class AccountUsage:
    """One account as the workload manager reports it now."""

    account: str
    raw_shares: int | None = None
    norm_shares: float | None = None
    raw_usage: int | None = None
    effective_usage: float | None = None
    fairshare: float | None = None
    gpus_running: int = 0
    gpus_pending: int = 0


@dataclass(frozen=True)
class NodeUsage:
    """What one account's running work holds on one node now."""

    node: str
    account: str
    gpus: int = 0
    jobs: int = 0  # jobs (Slurm) or pods (Kubernetes) of the account on the node


class WorkloadManager(Protocol):
    """One kind of workload manager (see the module docstring for the contract)."""

    kind: ClassVar[str]  # a bcm.models.wlm.WlmKind value
    title: ClassVar[str]  # as messages name it: "Slurm"
    node_agent: ClassVar[str]  # the node daemon a deploy waits for: "slurmd"

    def plan(self, spec: ClusterSpec, secrets_dir: Path, render: Render) -> DeployPlan:
        """Render the files, make the cluster's secrets once, list the Ansible hosts and vars."""
        ...

    def keep_secrets(self, secrets_dir: Path, secrets: Mapping[str, str]) -> None:
        """Store the secrets a deploy request carried (0600 files), for ``plan`` to use."""
        ...

    def deploy(self, plan: DeployPlan, access: AnsibleAccess, timeout_s: float) -> PlaybookResult:
        """Run the plan's playbook (blocking); per-host recaps."""
        ...

    async def node_states(
        self, ssh: SshClient, controller: Target, timeout_s: float = 30
    ) -> dict[str, WlmNodeState]:
        """Every node the controller knows, with its state and reason."""
        ...

    async def wait_registered(
        self, ssh: SshClient, controller: Target, names: list[str], timeout_s: float = 90
    ) -> dict[str, WlmNodeState]:
        """Poll until every named node responds, bounded by ``timeout_s``; the last states seen."""
        ...

    async def verify(
        self,
        ssh: SshClient,
        controller: Target,
        names: list[str],
        *,
        timeout_s: float = 120,
        gpus: bool = True,
    ) -> VerifyResult:
        """The all-or-nothing verification job across ``names`` (one GPU each unless ``gpus`` is False:
        a cluster whose nodes have none, as inventoried)."""
        ...

    async def drain(
        self, ssh: SshClient, controller: Target, names: list[str], reason: str | None, timeout_s: float = 30
    ) -> None:
        """Stop scheduling on the nodes, recording ``drain_reason(reason)``."""
        ...

    async def resume(
        self, ssh: SshClient, controller: Target, names: list[str], timeout_s: float = 30
    ) -> None:
        """Schedule on the nodes again."""
        ...

    async def tenancy_plan(
        self,
        ssh: SshClient,
        controller: Target,
        cluster: str,
        accounts: list[AccountSpec],
        timeout_s: float = 30,
        previous: list[AccountSpec] | None = None,
    ) -> TenancyPlan:
        """The changes that would make the workload manager hold ``accounts`` (see the module docstring)."""
        ...

    async def tenancy_apply(
        self,
        ssh: SshClient,
        controller: Target,
        nodes: list[Target],
        cluster: str,
        accounts: list[AccountSpec],
        timeout_s: float = 60,
        previous: list[AccountSpec] | None = None,
        uids: Mapping[str, int] | None = None,
    ) -> TenancyPlan:
        """Make the members' users on ``nodes`` (the controller among them, ``uids`` the same on every
        node), then run the plan; ``previous`` is what bcm applied last (drift is measured against it)."""
        ...

    async def usage(
        self, ssh: SshClient, controller: Target, accounts: list[str], timeout_s: float = 30
    ) -> dict[str, AccountUsage]:
        """Fair share and GPUs held or wanted now, per named account."""
        ...

    async def node_usage(self, ssh: SshClient, controller: Target, timeout_s: float = 30) -> list[NodeUsage]:
        """Which accounts run work on which nodes now, and the GPUs they hold there."""
        ...

    def drain_reason(self, reason: str | None) -> str:
        """The reason as bcm records it: one bounded line marked as bcm's."""
        ...

    def drained_by_bcm(self, state: WlmNodeState) -> bool:
        """The node's reason is one bcm wrote (bcm resumes only those)."""
        ...

    def is_drained(self, state: WlmNodeState) -> bool:
        """Drained or draining: no new work is scheduled on it."""
        ...

    def is_responding(self, state: WlmNodeState | None) -> bool:
        """The node is registered and answers the controller."""
        ...


async def poll_states(
    manager: WorkloadManager,
    ssh: SshClient,
    controller: Target,
    done: Callable[[dict[str, WlmNodeState]], bool],
    timeout_s: float,
    interval_s: float = 1.0,
) -> dict[str, WlmNodeState]:
    """Poll ``node_states`` until ``done`` holds for them or ``timeout_s`` passed (a controller that does not
    answer counts as nothing seen yet, until the deadline); the last states seen."""
    import asyncio

    from bcm.errors import RetryableDriverError

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:  # bounded by timeout_s
        try:
            states = await manager.node_states(ssh, controller)
        except RetryableDriverError:
            if loop.time() > deadline:
                raise
            states = {}
        if done(states) or loop.time() > deadline:
            return states
        await asyncio.sleep(interval_s)


async def poll_registered(
    manager: WorkloadManager,
    ssh: SshClient,
    controller: Target,
    names: list[str],
    timeout_s: float,
    interval_s: float = 1.0,
) -> dict[str, WlmNodeState]:
    """``wait_registered`` for any workload manager: every named node responding (``poll_states``)."""

    def responding(states: dict[str, WlmNodeState]) -> bool:
        return all(manager.is_responding(states.get(n)) for n in names)

    return await poll_states(manager, ssh, controller, responding, timeout_s, interval_s)


def write_private(path: Path, data: bytes) -> None:
    """Write ``path`` 0600 (its directory 0700), replacing it atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def write_rendered(secrets_dir: Path, files: Mapping[str, str]) -> dict[str, str]:
    """Rendered files written out for Ansible to copy (``src:``): their text never passes through
    extra vars, where Ansible would template any ``{{ … }}`` in it on the head node."""
    out = {}
    for file_name, text in files.items():
        path = secrets_dir / "etc" / file_name
        write_private(path, text.encode())
        out[file_name] = str(path)
    return out
