"""operations record the server process running them and its heartbeat

Revision ID: 0007_op_runner
Revises: 0006_power
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0007_op_runner"
down_revision: str | None = "0006_power"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("operation", schema=None) as batch_op:
        batch_op.add_column(sa.Column("runner", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=True))
        batch_op.add_column(sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.create_index(batch_op.f("ix_operation_runner"), ["runner"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("operation", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_operation_runner"))
        batch_op.drop_column("heartbeat_at")
        batch_op.drop_column("runner")
