"""Boot trust: one boot token per provisioning attempt bound to the first client address; node-made host keys per category

A boot token now remembers the client address it is bound to (the first script fetch), keeps the token
encrypted so that address gets the same one again, and when the overlay went out. Unused tokens minted
before this revision are bound to no address: they are dropped, and a node provisioning across the upgrade
gets a new one at its next script fetch (or fails at its deadline and is provisioned again).
``category.host_key_source``: ``bcm`` (bcm makes the host key and sends it in the overlay; null means bcm)
or ``node`` (the node makes its own; bcm pins the public key it presents at hello).

Revision ID: 0014_boot_trust
Revises: 0013_bmc_binding
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0014_boot_trust"
down_revision: str | None = "0013_bmc_binding"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(sa.text("DELETE FROM boot_token WHERE used_at IS NULL"))
    with op.batch_alter_table("boot_token", schema=None) as batch_op:
        batch_op.add_column(sa.Column("client_address", sqlmodel.sql.sqltypes.AutoString(length=45), nullable=True))
        batch_op.add_column(sa.Column("token_enc", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("overlay_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("category", schema=None) as batch_op:
        batch_op.add_column(sa.Column("host_key_source", sqlmodel.sql.sqltypes.AutoString(length=8), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("category", schema=None) as batch_op:
        batch_op.drop_column("host_key_source")
    with op.batch_alter_table("boot_token", schema=None) as batch_op:
        batch_op.drop_column("overlay_at")
        batch_op.drop_column("token_enc")
        batch_op.drop_column("client_address")
