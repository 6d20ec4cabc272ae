"""BMC credentials bound to their target; Redfish TLS pins; plain-http permission per category

Revision ID: 0013_bmc_binding
Revises: 0012_health_records
"""

from collections.abc import Sequence

import sqlalchemy as sa  # noqa: F401
from alembic import op  # noqa: F401

revision: str = "0013_bmc_binding"
down_revision: str | None = "0012_health_records"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
