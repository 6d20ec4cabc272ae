"""BMC credentials bound to their target; Redfish TLS pins; plain-http permission per category

A node's own BMC password is bound to the BMC it was set for (``node.bmc_password_target``), a category's
to the BMCs its member nodes had (``category.bmc_password_targets``, node name -> target). Passwords stored
before this revision have no binding: they stay unused until an admin sets them again (their address may
already have been changed by an operator, so binding them to today's address would trust that change).

Revision ID: 0013_bmc_binding
Revises: 0012_health_records
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0013_bmc_binding"
down_revision: str | None = "0012_health_records"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("node", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("bmc_password_target", sqlmodel.sql.sqltypes.AutoString(length=300), nullable=True)
        )
        batch_op.add_column(sa.Column("bmc_tls_pin", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True))
    with op.batch_alter_table("category", schema=None) as batch_op:
        batch_op.add_column(sa.Column("bmc_password_targets", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("bmc_allow_http", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("category", schema=None) as batch_op:
        batch_op.drop_column("bmc_allow_http")
        batch_op.drop_column("bmc_password_targets")
    with op.batch_alter_table("node", schema=None) as batch_op:
        batch_op.drop_column("bmc_tls_pin")
        batch_op.drop_column("bmc_password_target")
