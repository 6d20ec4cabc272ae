"""Audit retention and bounded unauthenticated writes

Revision ID: 0015_audit
Revises: 0014_boot_trust
"""

from collections.abc import Sequence

import sqlalchemy as sa  # noqa: F401
from alembic import op  # noqa: F401

revision: str = "0015_audit"
down_revision: str | None = "0014_boot_trust"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
