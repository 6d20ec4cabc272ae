"""Several servers: server heartbeats and a leader lease with a fencing epoch

``server``: one row per running ``bcm serve`` (its id, address, version, start and last heartbeat).
``leader``: the one lease row (``id = 1``, made here with epoch 0 and no holder), taken and renewed by
compare-and-set under a row lock; each takeover adds one to ``epoch``.

Revision ID: 0017_ha
Revises: 0016_op_leases
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0017_ha"
down_revision: str | None = "0016_op_leases"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "server",
        sa.Column("id", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("address", sqlmodel.sql.sqltypes.AutoString(length=256), nullable=False),
        sa.Column("version", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("server", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_server_heartbeat_at"), ["heartbeat_at"], unique=False)
    leader = op.create_table(
        "leader",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("holder", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=True),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.bulk_insert(leader, [{"id": 1, "holder": None, "epoch": 0}])


def downgrade() -> None:
    op.drop_table("leader")
    with op.batch_alter_table("server", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_server_heartbeat_at"))
    op.drop_table("server")
