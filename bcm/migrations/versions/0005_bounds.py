"""64-bit GPU error counters; GPU history and health events indexed per node (pruned per node)

Revision ID: 0005_bounds
Revises: 0004_users
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_bounds"
down_revision: str | None = "0004_users"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COUNTERS = {
    "gpuhealth": [
        "ecc_sbe_volatile", "ecc_dbe_volatile", "ecc_sbe_aggregate", "ecc_dbe_aggregate", "pcie_replay",
        "remap_correctable", "remap_uncorrectable", "retired_sbe", "retired_dbe",
    ],
    "healthsample": ["ecc_sbe_volatile", "ecc_dbe_volatile"],
}


def _retype(to: sa.types.TypeEngine) -> None:
    # SQLite's INTEGER already holds 64 bits; only PostgreSQL needs the ALTER
    if op.get_bind().dialect.name == "sqlite":
        return
    for table, columns in COUNTERS.items():
        for column in columns:
            op.alter_column(table, column, type_=to, existing_nullable=True)


def upgrade() -> None:
    _retype(sa.BigInteger())
    op.drop_index("ix_healthsample_uuid_id", table_name="healthsample")
    op.create_index("ix_healthsample_node_uuid_id", "healthsample", ["node_id", "uuid", "id"])
    op.create_index("ix_healthevent_node_id_id", "healthevent", ["node_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_healthevent_node_id_id", table_name="healthevent")
    op.drop_index("ix_healthsample_node_uuid_id", table_name="healthsample")
    op.create_index("ix_healthsample_uuid_id", "healthsample", ["uuid", "id"])
    _retype(sa.Integer())
