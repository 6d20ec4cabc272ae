"""Slurm's command-line tools (sinfo, scontrol, srun, sacct) run on the controller over SSH. The only
place bcm speaks Slurm.

Every call is one SSH command with an explicit time bound; its failure becomes a DriverError naming
the controller and the reason (RetryableDriverError when the controller did not answer).
"""

from __future__ import annotations

import asyncio
import re
import shlex
from dataclasses import dataclass, field

from bcm.domain.naming import fold_hostlist
from bcm.drivers.ssh import HostResult, HostStatus, SshClient, Target
from bcm.errors import DriverError, InvalidInput, RetryableDriverError

REASON_PREFIX = "bcm: "
_VERIFY_MARK = "@@bcm-verify"


@dataclass(frozen=True)
class SlurmNodeState:
    state: str  # sinfo's long state, lower case: idle, allocated, mixed, drained, draining, down ...
    reason: str | None = None

    @property
    def drained_by_bcm(self) -> bool:
        return (self.reason or "").startswith(REASON_PREFIX)


@dataclass
class VerifyResult:
    ok: bool
    message: str
    job_id: str | None = None
    nodes: dict[str, str] = field(default_factory=dict)  # node -> CUDA_VISIBLE_DEVICES seen by the step
    alloc_tres: str | None = None
    output: str = ""


def _ok(result: HostResult, what: str) -> str:
    if result.ok:
        return result.stdout
    detail = (result.stderr.strip().splitlines() or [result.error or result.status.value])[-1][:300]
    message = f"{what} on controller {result.name} failed: {detail}"
    if result.status in (HostStatus.UNREACHABLE, HostStatus.TIMED_OUT):
        raise RetryableDriverError(message)
    raise DriverError(message)


async def node_states(ssh: SshClient, controller: Target, timeout_s: float = 30) -> dict[str, SlurmNodeState]:
    """Every node slurmctld knows, with its state and reason."""
    cmd = "sinfo --noheader --Node --format='%N|%T|%E'"
    out = _ok(await ssh.run_one(controller, cmd, command_timeout=timeout_s), "sinfo")
    states: dict[str, SlurmNodeState] = {}
    for line in out.splitlines():
        parts = line.strip().split("|", 2)
        if len(parts) < 2 or not parts[0]:
            continue
        reason = parts[2].strip() if len(parts) > 2 and parts[2].strip() not in ("", "none") else None
        states[parts[0]] = SlurmNodeState(parts[1].strip().lower(), reason)
    return states


def clean_reason(reason: str | None) -> str:
    """``bcm: <reason>`` on one line, bounded; bcm's own drains are told apart by the prefix."""
    text = " ".join((reason or "drained by bcm").split())[:200]
    return text if text.startswith(REASON_PREFIX) else REASON_PREFIX + text


async def drain(
    ssh: SshClient, controller: Target, names: list[str], reason: str | None, timeout_s: float = 30
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


async def resume(ssh: SshClient, controller: Target, names: list[str], timeout_s: float = 30) -> None:
    if not names:
        return
    cmd = shlex.join(["scontrol", "update", f"NodeName={fold_hostlist(names)}", "State=RESUME"])
    _ok(await ssh.run_one(controller, cmd, command_timeout=timeout_s), "scontrol resume")


async def wait_registered(
    ssh: SshClient, controller: Target, names: list[str], timeout_s: float = 90, interval_s: float = 1.0
) -> dict[str, SlurmNodeState]:
    """Poll sinfo until every named node answers (no ``*``, not down/unknown), bounded by ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    states: dict[str, SlurmNodeState] = {}
    while True:
        try:
            states = await node_states(ssh, controller)
        except RetryableDriverError:
            if loop.time() > deadline:
                raise
            states = {}
        waiting = [n for n in names if not _responding(states.get(n))]
        if not waiting or loop.time() > deadline:
            return states
        await asyncio.sleep(interval_s)


def _responding(state: SlurmNodeState | None) -> bool:
    if state is None:
        return False
    return not state.state.endswith("*") and not state.state.startswith(("down", "unknown", "future"))


async def verify_job(
    ssh: SshClient, controller: Target, names: list[str], *, timeout_s: float = 120
) -> VerifyResult:
    """One step on every named node with one GPU each; all or nothing; then the job's AllocTRES."""
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
            "--gres=gpu:1",
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
    no_gpu = [x for x, cuda in seen.items() if not cuda]
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
    return VerifyResult(True, f"one GPU step ran on all {n} nodes", job_id, seen, tres, output)


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
