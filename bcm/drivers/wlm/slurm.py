"""Slurm behind the workload-manager interface: its files rendered from the database, the
``slurm.yml`` playbook, and its command-line tools (sinfo, scontrol, srun, sacct) run on the
controller over SSH. The only place bcm speaks Slurm.

Every call is one SSH command with an explicit time bound; its failure becomes a DriverError naming
the controller and the reason (RetryableDriverError when the controller did not answer).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import secrets
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

from bcm.domain.naming import fold_hostlist
from bcm.domain.slurm import NodeInput, SlurmCluster, SlurmSettings, build_cluster
from bcm.drivers import ansible
from bcm.drivers.ansible import AnsibleHost, PlaybookResult
from bcm.drivers.ssh import HostResult, HostStatus, SshClient, Target
from bcm.drivers.wlm import slurm_accounts as accts
from bcm.drivers.wlm import slurm_usage
from bcm.drivers.wlm.base import (
    AccountSpec,
    AccountUsage,
    AnsibleAccess,
    ClusterSpec,
    DeployPlan,
    NodeUsage,
    Render,
    TenancyPlan,
    VerifyResult,
    WlmNodeState,
    poll_registered,
    write_private,
    write_rendered,
)
from bcm.errors import DriverError, InvalidInput, RetryableDriverError

REASON_PREFIX = "bcm: "
TEMPLATES = ("slurm.conf", "gres.conf", "cgroup.conf", "slurmdbd.conf")
MUNGE_KEY_BYTES = 1024  # what `mungekey` makes by default
PLAYBOOK = "slurm.yml"
_VERIFY_MARK = "@@bcm-verify"


# ---- files and secrets ----------------------------------------------------------------------------


def render_files(cluster: SlurmCluster, storage_pass: str, render: Render) -> dict[str, str]:
    """The four Slurm files for a cluster; only slurmdbd.conf sees the database password."""
    out = {}
    for name in TEMPLATES:
        extra = {"storage_pass": storage_pass} if name == "slurmdbd.conf" else {}
        out[name] = render(f"slurm/etc/slurm/{name}.j2", cluster=cluster, s=cluster.settings, **extra)
    return out


def effective_settings(settings: SlurmSettings, *, tenancy: bool) -> SlurmSettings:
    """The stored knobs, with accounting enforced once bcm's departments are Slurm accounts (a job then
    needs an association, and GrpTRES holds); a value stored by hand wins."""
    if tenancy and not settings.accounting_enforce:
        return settings.model_copy(update={"accounting_enforce": accts.ENFORCE})
    return settings


def ensure_munge_key(secrets_dir: Path) -> tuple[Path, str]:
    """The cluster's munge key file (made once, 0600) and its sha256; the key itself is never returned."""
    path = secrets_dir / "munge.key"
    if not path.exists():
        write_private(path, secrets.token_bytes(MUNGE_KEY_BYTES))
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def storage_pass(secrets_dir: Path) -> str:
    """The accounting database password a deploy stored ("" when none was ever given)."""
    path = secrets_dir / "storage.pass"
    return path.read_text() if path.exists() else ""


# ---- commands on the controller ---------------------------------------------------------------------


def _ok(result: HostResult, what: str) -> str:
    if result.ok:
        return result.stdout
    detail = (result.stderr.strip().splitlines() or [result.error or result.status.value])[-1][:300]
    message = f"{what} on controller {result.name} failed: {detail}"
    if result.status in (HostStatus.UNREACHABLE, HostStatus.TIMED_OUT):
        raise RetryableDriverError(message)
    raise DriverError(message)


def clean_reason(reason: str | None) -> str:
    """``bcm: <reason>`` on one line, bounded; bcm's own drains are told apart by the prefix."""
    text = " ".join((reason or "drained by bcm").split())[:200]
    return text if text.startswith(REASON_PREFIX) else REASON_PREFIX + text


async def _alloc_tres(ssh: SshClient, controller: Target, job_id: str, tries: int = 20) -> str | None:
    """The job's AllocTRES from accounting; slurmctld hands records to slurmdbd shortly after the job."""
    if not re.fullmatch(r"[0-9]+", job_id):
        return None
    cmd = shlex.join(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "AllocTRES"])
    for _ in range(tries):  # bounded: 20 tries, about 10 s
        result = await ssh.run_one(controller, cmd, command_timeout=20)
        text = result.stdout.strip() if result.ok else ""
        if text:
            return text.splitlines()[0]
        await asyncio.sleep(0.5)
    return None


async def sacct_tres(ssh: SshClient, controller: Target, job_id: str) -> str | None:
    """AllocTRES of a finished job (``gres/gpu=N`` among them when GPUs are accounted)."""
    return await _alloc_tres(ssh, controller, job_id)


def _num(text: str, kind: type[int] | type[float]) -> float | int | None:
    try:
        return kind(text.strip())
    except ValueError:
        return None


_GPUS = re.compile(r"gpu(?::[A-Za-z0-9_.-]+)?[:=](\d+)")


def parse_usage(accounts: list[str], sshare_out: str, squeue_out: str) -> dict[str, AccountUsage]:
    """Per account: sshare's own row (no user) and the GPUs its jobs hold or wait for."""
    rows: dict[str, dict[str, object]] = {a: {} for a in accounts}
    for line in sshare_out.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) < 7 or parts[1] or parts[0] not in rows:
            continue
        rows[parts[0]] = {
            "raw_shares": _num(parts[2], int),
            "norm_shares": _num(parts[3], float),
            "raw_usage": _num(parts[4], int),
            "effective_usage": _num(parts[5], float),
            "fairshare": _num(parts[6], float),
        }
    running = dict.fromkeys(accounts, 0)
    pending = dict.fromkeys(accounts, 0)
    for line in squeue_out.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 4 or parts[0] not in running:
            continue
        per_node = sum(int(n) for n in _GPUS.findall(parts[3]))
        gpus = per_node * (int(parts[2]) if parts[2].isdigit() else 1)
        if parts[1] == "RUNNING":
            running[parts[0]] += gpus
        elif parts[1] == "PENDING":
            pending[parts[0]] += gpus
    return {
        a: AccountUsage(a, gpus_running=running[a], gpus_pending=pending[a], **rows[a])  # type: ignore[arg-type]
        for a in accounts
    }


# ---- the interface ------------------------------------------------------------------------------------


class Slurm:
    """:class:`bcm.drivers.wlm.base.WorkloadManager` for Slurm (slurmctld + slurmdbd on the controller)."""

    kind: ClassVar[str] = "slurm"
    title: ClassVar[str] = "Slurm"
    node_agent: ClassVar[str] = "slurmd"

    def plan(self, spec: ClusterSpec, secrets_dir: Path, render: Render) -> DeployPlan:
        """slurm.conf, gres.conf, cgroup.conf from the inventoried GPUs; slurmdbd.conf and the munge key
        kept 0600 beside them; the controller runs slurmctld and slurmdbd, the members slurmd."""
        ctl = spec.controller
        inputs = [NodeInput(m.name, m.address, m.facts, m.gpus, m.category) for m in spec.members]
        settings = effective_settings(SlurmSettings.model_validate(spec.settings), tenancy=spec.tenancy)
        config = build_cluster(spec.name, ctl.name, ctl.address, inputs, settings)
        files = render_files(config, storage_pass(secrets_dir), render)
        key_path, fingerprint = ensure_munge_key(secrets_dir)
        dbd_path = secrets_dir / "slurmdbd.conf"
        write_private(dbd_path, files.pop("slurmdbd.conf").encode())
        file_paths = write_rendered(secrets_dir, files)
        member_names = [m.name for m in spec.members]
        hosts = [
            AnsibleHost(
                ctl.name,
                ctl.address or "",
                ctl.host_key or "",
                ("slurm_controller", "slurmdbd", *(("slurm_nodes",) if ctl.name in member_names else ())),
            )
        ]
        hosts += [
            AnsibleHost(m.name, m.address or "", m.host_key or "", ("slurm_nodes",))
            for m in spec.members
            if m.name != ctl.name
        ]
        extravars = {
            "bcm_slurm": {
                "cluster": spec.name,
                "files": file_paths,
                "slurm_user": settings.slurm_user,
                "munge_key_src": str(key_path),
                "slurmdbd_conf_src": str(dbd_path),
            }
        }
        return DeployPlan(spec.name, ctl.name, hosts, member_names, extravars, config, fingerprint)

    def keep_secrets(self, secrets_dir: Path, secrets: Mapping[str, str]) -> None:
        """``storage_pass``: the accounting database password, for slurmdbd.conf."""
        if "storage_pass" in secrets:
            write_private(secrets_dir / "storage.pass", secrets["storage_pass"].encode())

    def deploy(self, plan: DeployPlan, access: AnsibleAccess, timeout_s: float) -> PlaybookResult:
        return ansible.run_playbook(
            PLAYBOOK,
            plan.hosts,
            plan.extravars,
            key_file=access.key_file,
            work_dir=access.work_dir,
            username=access.username,
            connect_timeout_s=access.connect_timeout_s,
            timeout_s=timeout_s,
        )

    async def node_states(
        self, ssh: SshClient, controller: Target, timeout_s: float = 30
    ) -> dict[str, WlmNodeState]:
        """Every node slurmctld knows, with its state and reason."""
        cmd = "sinfo --noheader --Node --format='%N|%T|%E'"
        out = _ok(await ssh.run_one(controller, cmd, command_timeout=timeout_s), "sinfo")
        states: dict[str, WlmNodeState] = {}
        for line in out.splitlines():
            parts = line.strip().split("|", 2)
            if len(parts) < 2 or not parts[0]:
                continue
            reason = parts[2].strip() if len(parts) > 2 and parts[2].strip() not in ("", "none") else None
            states[parts[0]] = WlmNodeState(parts[1].strip().lower(), reason)
        return states

    async def wait_registered(
        self,
        ssh: SshClient,
        controller: Target,
        names: list[str],
        timeout_s: float = 90,
        interval_s: float = 1.0,
    ) -> dict[str, WlmNodeState]:
        """Poll sinfo until every named node answers (no ``*``, not down/unknown), bounded by ``timeout_s``."""
        return await poll_registered(self, ssh, controller, names, timeout_s, interval_s)

    async def verify(
        self,
        ssh: SshClient,
        controller: Target,
        names: list[str],
        *,
        timeout_s: float = 120,
        gpus: bool = True,
    ) -> VerifyResult:
        """One step on every named node with one GPU each (none when ``gpus`` is False: nodes without GPUs);
        all or nothing; then the job's AllocTRES."""
        if not names:
            raise InvalidInput("nodes: nothing to verify", field="nodes")
        hostlist = fold_hostlist(names)
        n = len(names)
        step = f'echo "{_VERIFY_MARK} $(hostname) $SLURM_JOB_ID cuda=${{CUDA_VISIBLE_DEVICES:-}}"'
        srun = shlex.join(
            [
                "srun",
                f"--nodes={n}",
                f"--ntasks={n}",
                "--ntasks-per-node=1",
                f"--nodelist={hostlist}",
                *(["--gres=gpu:1"] if gpus else []),
                "--job-name=bcm-verify",
                "--time=5",
                f"--immediate={max(10, int(timeout_s) // 2)}",
                "sh",
                "-c",
                step,
            ]
        )
        cmd = f"timeout {int(timeout_s)} {srun}"
        result = await ssh.run_one(controller, cmd, command_timeout=timeout_s + 15)
        if result.status in (HostStatus.UNREACHABLE, HostStatus.TIMED_OUT, HostStatus.AUTH_FAILED):
            raise RetryableDriverError(f"verification job: controller {result.name}: {result.error}")
        seen: dict[str, str] = {}
        job_id = None
        for line in result.stdout.splitlines():
            parts = line.split()
            if len(parts) >= 4 and parts[0] == _VERIFY_MARK:
                seen[parts[1]] = parts[3].removeprefix("cuda=")
                job_id = parts[2]
        output = (result.stdout + result.stderr)[-4000:]
        missing = [x for x in names if x not in seen]
        no_gpu = [x for x, cuda in seen.items() if not cuda] if gpus else []
        if not result.ok or missing or no_gpu:
            why = []
            if not result.ok:
                tail = (result.stderr.strip().splitlines() or [result.error or "failed"])[-1]
                why.append(f"srun failed: {tail[:300]}")
            if missing:
                why.append(f"no output from {fold_hostlist(missing)}")
            if no_gpu:
                why.append(f"no GPU given to the step on {fold_hostlist(no_gpu)}")
            return VerifyResult(False, "; ".join(why), job_id, seen, None, output)
        tres = await _alloc_tres(ssh, controller, job_id) if job_id else None
        what = "one GPU step" if gpus else "one step (no GPUs inventoried)"
        return VerifyResult(True, f"{what} ran on all {n} nodes", job_id, seen, tres, output)

    async def drain(
        self, ssh: SshClient, controller: Target, names: list[str], reason: str | None, timeout_s: float = 30
    ) -> None:
        if not names:
            return
        cmd = shlex.join(
            [
                "scontrol",
                "update",
                f"NodeName={fold_hostlist(names)}",
                "State=DRAIN",
                f"Reason={clean_reason(reason)}",
            ]
        )
        _ok(await ssh.run_one(controller, cmd, command_timeout=timeout_s), "scontrol drain")

    async def resume(
        self, ssh: SshClient, controller: Target, names: list[str], timeout_s: float = 30
    ) -> None:
        if not names:
            return
        cmd = shlex.join(["scontrol", "update", f"NodeName={fold_hostlist(names)}", "State=RESUME"])
        _ok(await ssh.run_one(controller, cmd, command_timeout=timeout_s), "scontrol resume")

    async def _holdings(
        self, ssh: SshClient, controller: Target, cluster: str, timeout_s: float
    ) -> accts.Holdings:
        outs = []
        for what, argv in (
            ("sacctmgr show account", accts.ACCOUNT_QUERY),
            ("sacctmgr show assoc", accts.assoc_query(cluster)),
            ("sacctmgr show user", accts.USER_QUERY),
        ):
            outs.append(_ok(await ssh.run_one(controller, shlex.join(argv), command_timeout=timeout_s), what))
        return accts.parse(*outs)

    async def tenancy_plan(
        self,
        ssh: SshClient,
        controller: Target,
        cluster: str,
        accounts: list[AccountSpec],
        timeout_s: float = 30,
        previous: list[AccountSpec] | None = None,
    ) -> TenancyPlan:
        """sacctmgr's associations on the cluster against the model; drift against ``previous``."""
        if not re.fullmatch(r"[a-z][a-z0-9_-]{0,39}", cluster):
            raise InvalidInput(f"cluster: {cluster!r} is not a Slurm cluster name", field="cluster")
        have = await self._holdings(ssh, controller, cluster, timeout_s)
        changes, notes = accts.diff(cluster, accounts, have, previous or ())
        if accounts:
            config = _ok(
                await ssh.run_one(controller, "scontrol show config", command_timeout=timeout_s), "scontrol"
            )
            if not accts.enforcing(config):
                notes.append(
                    f"slurmctld does not enforce AccountingStorageEnforce={accts.ENFORCE} yet: limits take"
                    " effect after `bcm wlm deploy slurm` renders it into slurm.conf"
                )
        return TenancyPlan(cluster, changes, notes)

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
        """Unix users on every node (same uid everywhere), then the plan's sacctmgr commands in order."""
        users = sorted({u for a in accounts for u in a.users})
        if users:
            await self._ensure_users(ssh, nodes, users, uids or {}, timeout_s)
        plan = await self.tenancy_plan(ssh, controller, cluster, accounts, timeout_s, previous)
        for change in plan.changes:
            what = f"sacctmgr {change.action} {change.kind} {change.name}"
            _ok(await ssh.run_one(controller, change.command, command_timeout=timeout_s), what)
        plan.applied = True
        return plan

    async def _ensure_users(
        self, ssh: SshClient, nodes: list[Target], users: list[str], uids: Mapping[str, int], timeout_s: float
    ) -> None:
        lines = []
        for user in users:
            if not re.fullmatch(r"[a-z][a-z0-9-]{0,31}", user):
                raise InvalidInput(f"user: {user!r} cannot be a Unix user", field="user")
            uid = uids.get(user)
            ids = ["-u", str(uid)] if uid else []
            group = f"groupadd {'-g ' + str(uid) + ' ' if uid else ''}{user}"
            add = shlex.join(
                ["useradd", "-M", *ids, "-g", user, "-s", "/bin/bash", "-d", f"/home/{user}", user]
            )
            lines.append(f"getent group {user} >/dev/null || {group}")
            lines.append(f"getent passwd {user} >/dev/null || {add}")
        cmd = "set -e; " + "; ".join(lines)
        results = await ssh.run_many(nodes, cmd, command_timeout=timeout_s)
        failed = [r for r in results if not r.ok]
        if failed:
            r = failed[0]
            detail = (r.stderr.strip().splitlines() or [r.error or r.status.value])[-1][:300]
            cls = (
                RetryableDriverError
                if r.status in (HostStatus.UNREACHABLE, HostStatus.TIMED_OUT)
                else DriverError
            )
            raise cls(f"creating users on {fold_hostlist([x.name for x in failed])} failed: {detail}")

    async def usage(
        self, ssh: SshClient, controller: Target, accounts: list[str], timeout_s: float = 30
    ) -> dict[str, AccountUsage]:
        """sshare's fair-share figures and squeue's GPUs (running, pending) per account."""
        if not accounts:
            return {}
        names = ",".join(accounts)
        share_cmd = shlex.join(
            [
                "sshare",
                "-nP",
                "-A",
                names,
                "-o",
                "Account,User,RawShares,NormShares,RawUsage,EffectvUsage,FairShare",
            ]
        )
        shares = _ok(await ssh.run_one(controller, share_cmd, command_timeout=timeout_s), "sshare")
        queue_cmd = shlex.join(["squeue", "-h", "-A", names, "-o", "%a|%T|%D|%b"])
        queue = _ok(await ssh.run_one(controller, queue_cmd, command_timeout=timeout_s), "squeue")
        return parse_usage(accounts, shares, queue)

    async def node_usage(self, ssh: SshClient, controller: Target, timeout_s: float = 30) -> list[NodeUsage]:
        """squeue's running jobs: account, nodes and allocated GPUs (see ``slurm_usage``)."""
        cmd = shlex.join(slurm_usage.SQUEUE_ARGV)
        out = _ok(await ssh.run_one(controller, cmd, command_timeout=timeout_s), "squeue")
        return slurm_usage.parse_running(out)

    def drain_reason(self, reason: str | None) -> str:
        return clean_reason(reason)

    def drained_by_bcm(self, state: WlmNodeState) -> bool:
        return (state.reason or "").startswith(REASON_PREFIX)

    def is_drained(self, state: WlmNodeState) -> bool:
        return state.state.startswith("drain")  # drained, draining (sinfo's %T)

    def is_responding(self, state: WlmNodeState | None) -> bool:
        if state is None:
            return False
        return not state.state.endswith("*") and not state.state.startswith(("down", "unknown", "future"))
