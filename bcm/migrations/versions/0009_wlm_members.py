"""wlm_member: cluster membership as rows (a node in at most one cluster) instead of a hostlist column

Revision ID: 0009_wlm_members
Revises: 0009_pxe (both 0009: the PXE migration landed first on 0008_images)

Each cluster's ``nodes`` hostlist becomes one ``compute`` row per node that still exists, and its
controller a ``controller`` row unless it is among those nodes. A node named by two clusters (which
bcm never allowed for members) stays in the first (lowest id). The downgrade folds the compute rows
back into ``nodes``.
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op
from ClusterShell.NodeSet import RESOLVER_NOGROUP, NodeSet

revision: str = "0009_wlm_members"
down_revision: str | None = "0009_pxe"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_member = sa.table(
    "wlm_member",
    sa.column("cluster_id", sa.Integer),
    sa.column("node_id", sa.Integer),
    sa.column("role", sa.String),
)


def _expand(hostlist: str) -> list[str]:
    # as bcm.domain.naming does: ClusterShell's NodeSet with group resolution off
    if not hostlist.strip():
        return []
    try:
        return list(NodeSet(hostlist, resolver=RESOLVER_NOGROUP))
    except Exception:  # bcm only ever stored parsed hostlists; anything else is taken name by name
        return [name.strip() for name in hostlist.split(",") if name.strip()]


def upgrade() -> None:
    conn = op.get_bind()
    clusters = conn.execute(sa.text("SELECT id, nodes, controller_id FROM wlm_cluster ORDER BY id")).all()
    node_ids = dict(conn.execute(sa.text("SELECT name, id FROM node")).all())
    rows, placed = [], set()
    for cluster_id, hostlist, controller_id in clusters:
        wanted = [(node_ids.get(name), "compute") for name in _expand(hostlist or "")]
        wanted.append((controller_id, "controller"))
        for node_id, role in wanted:
            if node_id is None or node_id in placed:
                continue  # gone from the inventory, or already in a cluster (its controller row too)
            placed.add(node_id)
            rows.append({"cluster_id": cluster_id, "node_id": node_id, "role": role})

    # the column goes before the new table refers to wlm_cluster: SQLite's batch mode recreates it
    with op.batch_alter_table("wlm_cluster", schema=None) as batch_op:
        batch_op.drop_column("nodes")
    op.create_table(
        "wlm_member",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("cluster_id", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("role", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.ForeignKeyConstraint(["cluster_id"], ["wlm_cluster.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["node_id"], ["node.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("node_id"),
    )
    with op.batch_alter_table("wlm_member", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_wlm_member_cluster_id"), ["cluster_id"], unique=False)
    if rows:
        op.bulk_insert(_member, rows)


def downgrade() -> None:
    conn = op.get_bind()
    members = conn.execute(
        sa.text(
            "SELECT m.cluster_id, n.name FROM wlm_member m JOIN node n ON n.id = m.node_id"
            " WHERE m.role = 'compute'"
        )
    ).all()
    by_cluster: dict[int, list[str]] = {}
    for cluster_id, name in members:
        by_cluster.setdefault(cluster_id, []).append(name)

    with op.batch_alter_table("wlm_member", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_wlm_member_cluster_id"))
    op.drop_table("wlm_member")
    with op.batch_alter_table("wlm_cluster", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "nodes", sqlmodel.sql.sqltypes.AutoString(length=65535), nullable=False, server_default=""
            )
        )
    for cluster_id, names in by_cluster.items():
        folded = str(NodeSet.fromlist(names, resolver=RESOLVER_NOGROUP))
        conn.execute(sa.text("UPDATE wlm_cluster SET nodes = :nodes WHERE id = :id"), {"nodes": folded, "id": cluster_id})
