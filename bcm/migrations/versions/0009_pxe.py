"""PXE provisioning: settings set through the API; one-time boot tokens; a node's overlay host key and its place in the provisioning queue; category discovery rules

Revision ID: 0009_pxe
Revises: 0008_images
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op


revision: str = "0009_pxe"
down_revision: str | None = "0008_images"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "pxe_config",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("interface", sqlmodel.sql.sqltypes.AutoString(length=15), nullable=True),
        sa.Column("address", sqlmodel.sql.sqltypes.AutoString(length=45), nullable=True),
        sa.Column("mode", sqlmodel.sql.sqltypes.AutoString(length=8), nullable=False),
        sa.Column("range_start", sqlmodel.sql.sqltypes.AutoString(length=45), nullable=True),
        sa.Column("range_end", sqlmodel.sql.sqltypes.AutoString(length=45), nullable=True),
        sa.Column("netmask", sqlmodel.sql.sqltypes.AutoString(length=45), nullable=False),
        sa.Column("router", sqlmodel.sql.sqltypes.AutoString(length=45), nullable=True),
        sa.Column("updated_by", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "boot_token",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("mac", sqlmodel.sql.sqltypes.AutoString(length=17), nullable=False),
        sa.Column("token_hash", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("used_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["node_id"], ["node.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("boot_token", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_boot_token_node_id"), ["node_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_boot_token_token_hash"), ["token_hash"], unique=True)
    with op.batch_alter_table("node", schema=None) as batch_op:
        batch_op.add_column(sa.Column("host_key_enc", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("provision_queued_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("provision_started_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("provision_deadline", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("category", schema=None) as batch_op:
        batch_op.add_column(sa.Column("discover_mac_prefix", sqlmodel.sql.sqltypes.AutoString(length=17), nullable=True))
        batch_op.add_column(sa.Column("discover_names", sqlmodel.sql.sqltypes.AutoString(length=1024), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("category", schema=None) as batch_op:
        batch_op.drop_column("discover_names")
        batch_op.drop_column("discover_mac_prefix")
    with op.batch_alter_table("node", schema=None) as batch_op:
        batch_op.drop_column("provision_deadline")
        batch_op.drop_column("provision_started_at")
        batch_op.drop_column("provision_queued_at")
        batch_op.drop_column("host_key_enc")
    with op.batch_alter_table("boot_token", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_boot_token_token_hash"))
        batch_op.drop_index(batch_op.f("ix_boot_token_node_id"))
    op.drop_table("boot_token")
    op.drop_table("pxe_config")
