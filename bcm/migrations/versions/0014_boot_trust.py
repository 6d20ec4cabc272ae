"""Boot trust: one boot token per provisioning attempt bound to the first client address; node-made host keys per category

Revision ID: 0014_boot_trust
Revises: 0013_bmc_binding
"""

from collections.abc import Sequence

import sqlalchemy as sa  # noqa: F401
from alembic import op  # noqa: F401

revision: str = "0014_boot_trust"
down_revision: str | None = "0013_bmc_binding"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
