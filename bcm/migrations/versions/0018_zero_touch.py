"""Zero-touch: categories provision what their discovery rule registers and join it to a cluster

``category.auto_provision``: provision a machine the rule registered at once. ``category.wlm_cluster``:
the workload-manager cluster its booted nodes join. ``category.bmc_discover_range``: the network (admin
only, set with the password) whose BMCs, as discoveries report them, get the category's BMC password.

Revision ID: 0018_zero_touch
Revises: 0017_ha
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0018_zero_touch"
down_revision: str | None = "0017_ha"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("category", schema=None) as batch_op:
        batch_op.add_column(sa.Column("auto_provision", sa.Boolean(), nullable=True))
        batch_op.add_column(sa.Column("wlm_cluster", sqlmodel.sql.sqltypes.AutoString(length=40), nullable=True))
        batch_op.add_column(
            sa.Column("bmc_discover_range", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True)
        )


def downgrade() -> None:
    with op.batch_alter_table("category", schema=None) as batch_op:
        batch_op.drop_column("bmc_discover_range")
        batch_op.drop_column("wlm_cluster")
        batch_op.drop_column("auto_provision")
