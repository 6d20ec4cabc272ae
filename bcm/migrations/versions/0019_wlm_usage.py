"""Who runs on which node: the workload-manager sync's sample of running work per node and account

``wlm_usage``: one row per (node, account) with running work on a member node of a cluster (GPUs and
jobs held there), replaced per cluster by each sync; a node or cluster removed takes its rows with it.
``wlm_cluster.usage_at``: when that cluster's sample was last taken.

Revision ID: 0019_wlm_usage
Revises: 0018_zero_touch
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0019_wlm_usage"
down_revision: str | None = "0018_zero_touch"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("wlm_cluster", schema=None) as batch_op:
        batch_op.add_column(sa.Column("usage_at", sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        "wlm_usage",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("cluster_id", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("account", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("jobs", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["cluster_id"], ["wlm_cluster.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["node_id"], ["node.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("node_id", "account"),
    )
    with op.batch_alter_table("wlm_usage", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_wlm_usage_cluster_id"), ["cluster_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_wlm_usage_account"), ["account"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("wlm_usage", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_wlm_usage_account"))
        batch_op.drop_index(batch_op.f("ix_wlm_usage_cluster_id"))
    op.drop_table("wlm_usage")
    with op.batch_alter_table("wlm_cluster", schema=None) as batch_op:
        batch_op.drop_column("usage_at")
