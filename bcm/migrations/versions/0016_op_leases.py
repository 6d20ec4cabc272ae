"""Operations under a lease: owner, lease expiry, reclaim

An operation is held by a server (``owner``) until ``lease_expires``; the holder renews the lease
while its task lives, and any server claims an open operation whose lease has lapsed (``claims``
counts the takes). ``spec`` holds what the handler needs to run it again elsewhere, ``outcome`` what
it produced beyond per-node results. The old ``runner``/``heartbeat_at`` pair goes: an open
operation of the old kind becomes one with a lapsed lease, reclaimed at the next start.

Revision ID: 0016_op_leases
Revises: 0015_audit
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0016_op_leases"
down_revision: str | None = "0015_audit"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("operation", schema=None) as batch_op:
        batch_op.add_column(sa.Column("owner", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=True))
        batch_op.add_column(sa.Column("lease_expires", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("claims", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("spec", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("outcome", sa.JSON(), nullable=True))
        batch_op.drop_index("ix_operation_runner")
        batch_op.drop_column("heartbeat_at")
        batch_op.drop_column("runner")
        batch_op.create_index("ix_operation_owner", ["owner"], unique=False)
    # what was running counts as taken once; its lease (none) has lapsed
    op.execute("UPDATE operation SET claims = 1 WHERE state IN ('pending', 'running')")


def downgrade() -> None:
    with op.batch_alter_table("operation", schema=None) as batch_op:
        batch_op.drop_index("ix_operation_owner")
        batch_op.add_column(sa.Column("runner", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=True))
        batch_op.add_column(sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.create_index("ix_operation_runner", ["runner"], unique=False)
        batch_op.drop_column("outcome")
        batch_op.drop_column("spec")
        batch_op.drop_column("claims")
        batch_op.drop_column("lease_expires")
        batch_op.drop_column("owner")
