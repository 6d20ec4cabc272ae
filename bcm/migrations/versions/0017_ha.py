"""Several servers: server heartbeats and a leader lease with a fencing epoch

Revision ID: 0017_ha
Revises: 0016_op_leases
"""

from collections.abc import Sequence

import sqlalchemy as sa  # noqa: F401
from alembic import op  # noqa: F401

revision: str = "0017_ha"
down_revision: str | None = "0016_op_leases"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
