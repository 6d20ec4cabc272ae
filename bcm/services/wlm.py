"""Workload-manager use cases: Slurm clusters rendered from the database, deployed, verified, drained.

Services flush but never commit: the request or background job owns the transaction.
"""

from __future__ import annotations

from bcm.domain.slurm import SlurmCluster
from bcm.services.render import render

SLURM_TEMPLATES = ("slurm.conf", "gres.conf", "cgroup.conf", "slurmdbd.conf")


def render_slurm_files(cluster: SlurmCluster, storage_pass: str) -> dict[str, str]:
    """The four Slurm files for a cluster; only slurmdbd.conf sees the database password."""
    out = {}
    for name in SLURM_TEMPLATES:
        extra = {"storage_pass": storage_pass} if name == "slurmdbd.conf" else {}
        out[name] = render(f"slurm/etc/slurm/{name}.j2", cluster=cluster, s=cluster.settings, **extra)
    return out
