"""Operations under a lease: owner, lease expiry, reclaim

Revision ID: 0016_op_leases
Revises: 0015_audit
"""

from collections.abc import Sequence

import sqlalchemy as sa  # noqa: F401
from alembic import op  # noqa: F401

revision: str = "0016_op_leases"
down_revision: str | None = "0015_audit"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
