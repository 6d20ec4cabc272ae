"""Install to the node's own disk (#30): install modes per category and node, disk layouts on the category,
and what a node's disk holds and what it booted.

``category.install_mode``/``disk_layout``: the members' mode (stateless, full, auto, nosync) and layout (JSON,
bcm.domain.disk_layout). ``node.install_mode`` overrides it; ``next_install_mode`` applies to one boot;
``data_node`` refuses a full install unless an admin confirmed the wipe (``wipe_confirmed``, used up by it).
``install_state`` (installing, installed), ``installed_image``/``_layout``/``_at``, ``install_bytes``: the disk;
``booted_image``/``booted_from`` (network, disk): what the node's last boot runs.

Revision ID: 0020_install
Revises: 0019_wlm_usage
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0020_install"
down_revision: str | None = "0019_wlm_usage"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("category", schema=None) as batch_op:
        batch_op.add_column(sa.Column("install_mode", sqlmodel.sql.sqltypes.AutoString(length=8), nullable=True))
        batch_op.add_column(sa.Column("disk_layout", sa.JSON(), nullable=True))
    with op.batch_alter_table("node", schema=None) as batch_op:
        batch_op.add_column(sa.Column("install_mode", sqlmodel.sql.sqltypes.AutoString(length=8), nullable=True))
        batch_op.add_column(sa.Column("next_install_mode", sqlmodel.sql.sqltypes.AutoString(length=8), nullable=True))
        batch_op.add_column(sa.Column("data_node", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.add_column(sa.Column("wipe_confirmed", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.add_column(sa.Column("install_state", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=True))
        batch_op.add_column(sa.Column("installed_image", sqlmodel.sql.sqltypes.AutoString(length=200), nullable=True))
        batch_op.add_column(sa.Column("installed_layout", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=True))
        batch_op.add_column(sa.Column("installed_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("install_bytes", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("booted_image", sqlmodel.sql.sqltypes.AutoString(length=200), nullable=True))
        batch_op.add_column(sa.Column("booted_from", sqlmodel.sql.sqltypes.AutoString(length=8), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("node", schema=None) as batch_op:
        for column in ("booted_from", "booted_image", "install_bytes", "installed_at", "installed_layout",
                       "installed_image", "install_state", "wipe_confirmed", "data_node", "next_install_mode",
                       "install_mode"):
            batch_op.drop_column(column)
    with op.batch_alter_table("category", schema=None) as batch_op:
        batch_op.drop_column("disk_layout")
        batch_op.drop_column("install_mode")
