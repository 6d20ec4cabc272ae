"""power control: BMC settings on nodes and categories (password encrypted), last read power state

Revision ID: 0006_power
Revises: 0005_bounds
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0006_power"
down_revision: str | None = "0005_bounds"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("node", schema=None) as batch_op:
        batch_op.add_column(sa.Column("bmc_address", sqlmodel.sql.sqltypes.AutoString(length=270), nullable=True))
        batch_op.add_column(sa.Column("bmc_protocol", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=True))
        batch_op.add_column(sa.Column("bmc_user", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True))
        batch_op.add_column(sa.Column("bmc_password_enc", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("power_state", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=True))
        batch_op.add_column(sa.Column("power_checked_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("category", schema=None) as batch_op:
        batch_op.add_column(sa.Column("bmc_protocol", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=True))
        batch_op.add_column(sa.Column("bmc_user", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True))
        batch_op.add_column(sa.Column("bmc_password_enc", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("category", schema=None) as batch_op:
        for name in ("bmc_password_enc", "bmc_user", "bmc_protocol"):
            batch_op.drop_column(name)
    with op.batch_alter_table("node", schema=None) as batch_op:
        for name in ("power_checked_at", "power_state", "bmc_password_enc", "bmc_user", "bmc_protocol", "bmc_address"):
            batch_op.drop_column(name)
