"""Who runs on which node, from Slurm's ``squeue`` (pure: the command to run, its output parsed).

One line per running job (array tasks each on their own line), fields joined by ``|``::

    squeue -h -r -t R -O JobID:0|,Account:0|,NodeList:0|,tres-alloc:0|,tres-per-node:0|,tres-per-job:0

``-O`` reads each field as ``type[:[.][size][suffix]]``: size 0 prints the value whole (no padding, and no
cut at 20 characters that would split a long node list), ``|`` is the suffix. A job's GPUs, best first:

- ``tres-alloc``: what it was given, ``cpu=8,mem=32G,node=2,billing=8,gres/gpu=4`` — GPUs show here only
  where they are accounted (``AccountingStorageTRES=gres/gpu`` with slurmdbd, as bcm renders slurm.conf);
  the job's total, split evenly across its nodes.
- ``tres-per-node``: ``--gres=gpu:h100:2`` / ``--gpus-per-node=2`` as ``gres:gpu:h100:2`` (Slurm 22.05;
  ``gres/gpu:2`` in later releases), that many on each node.
- ``tres-per-job``: ``--gpus=3`` as ``gres:gpu:3``, split evenly.

Split evenly means the first nodes get the remainder; a ``--gpus=N`` job spread unevenly by the scheduler
is counted as if even (its total is right). Jobs without an account (no accounting) have no tenant and
are left out.
"""

from __future__ import annotations

import re

from bcm.domain.naming import expand_hostlist
from bcm.drivers.wlm.base import NodeUsage
from bcm.errors import BcmError

FIELDS = ("JobID", "Account", "NodeList", "tres-alloc", "tres-per-node", "tres-per-job")
SQUEUE_ARGV = [
    "squeue",
    "-h",
    "-r",
    "-t",
    "R",
    "-O",
    ",".join(f"{f}:0|" for f in FIELDS[:-1]) + f",{FIELDS[-1]}:0",
]
NO_ACCOUNT = ("", "(null)")
_ALLOC_TOTAL = re.compile(r"(?:^|,)gres/gpu=(\d+)")  # untyped: every GPU of the job
_ALLOC_TYPED = re.compile(r"(?:^|,)gres/gpu:[^=,]+=(\d+)")  # per type, when only typed ones are listed
_ONE_NODE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")  # most jobs: one node, no brackets
_REQUEST = re.compile(r"(?:^|,)gres[:/]gpu(?::[^:,=]+)?[:=](\d+)(?=,|$)")  # gres:gpu:h100:2, gres/gpu:2


def alloc_gpus(tres: str) -> int | None:
    """GPUs in a TRES string (``gres/gpu=4``, or the typed counts summed); None where none is listed."""
    total = _ALLOC_TOTAL.findall(tres)
    if total:
        return sum(int(n) for n in total)
    typed = _ALLOC_TYPED.findall(tres)
    return sum(int(n) for n in typed) if typed else None


def requested_gpus(tres: str) -> int | None:
    """GPUs in a request (``gres:gpu:h100:2``, ``gres/gpu:2``); None where none is named (``N/A``)."""
    counts = _REQUEST.findall(tres)
    return sum(int(n) for n in counts) if counts else None


def per_node(fields: list[str], nodes: int) -> list[int]:
    """The job's GPUs on each of its ``nodes`` nodes, from its TRES fields (see the module docstring)."""
    alloc, node_req, job_req = (fields + ["", "", ""])[:3]
    total = alloc_gpus(alloc)
    if total is None:
        each = requested_gpus(node_req)
        if each is not None:
            return [each] * nodes
        total = requested_gpus(job_req) or 0
    share, extra = divmod(total, nodes)
    return [share + (1 if i < extra else 0) for i in range(nodes)]


def _nodes(nodelist: str, seen: dict[str, list[str]]) -> list[str]:
    """A job's node names (a hostlist expanded once per distinct list; a single name as it is)."""
    if _ONE_NODE.fullmatch(nodelist):
        return [nodelist]
    if nodelist not in seen:
        try:
            seen[nodelist] = expand_hostlist(nodelist, "NodeList")
        except BcmError:
            seen[nodelist] = []  # a name bcm could not have given: not one of its nodes
    return seen[nodelist]


def parse_running(out: str) -> list[NodeUsage]:
    """Per (node, account): GPUs and jobs of the running jobs in ``squeue``'s output (see the module)."""
    held: dict[tuple[str, str], list[int]] = {}
    seen: dict[str, list[str]] = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) < 4:
            continue
        account, nodelist = parts[1], parts[2]
        if account in NO_ACCOUNT or not nodelist:
            continue
        nodes = _nodes(nodelist, seen)
        if not nodes:
            continue
        for node, gpus in zip(nodes, per_node(parts[3:], len(nodes)), strict=True):
            slot = held.setdefault((node, account), [0, 0])
            slot[0] += gpus
            slot[1] += 1
    return [NodeUsage(node, account, gpus, jobs) for (node, account), (gpus, jobs) in sorted(held.items())]
