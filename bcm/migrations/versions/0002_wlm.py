"""workload manager tables

Revision ID: 0002_wlm
Revises: 0001
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0002_wlm"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "wlm_cluster",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(length=40), nullable=False),
        sa.Column("kind", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("controller_id", sa.Integer(), nullable=False),
        sa.Column("nodes", sqlmodel.sql.sqltypes.AutoString(length=65535), nullable=False),
        sa.Column("settings", sa.JSON(), nullable=True),
        sa.Column("state", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("munge_key_sha256", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
        sa.Column("last_deploy_op", sa.Integer(), nullable=True),
        sa.Column("last_verify_op", sa.Integer(), nullable=True),
        sa.Column("last_verify_ok", sa.Boolean(), nullable=True),
        sa.Column("last_verify_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_verify", sa.JSON(), nullable=True),
        sa.Column("synced_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deployed_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["controller_id"], ["node.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("wlm_cluster", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_wlm_cluster_name"), ["name"], unique=True)
        batch_op.create_index(batch_op.f("ix_wlm_cluster_controller_id"), ["controller_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("wlm_cluster", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_wlm_cluster_controller_id"))
        batch_op.drop_index(batch_op.f("ix_wlm_cluster_name"))
    op.drop_table("wlm_cluster")
