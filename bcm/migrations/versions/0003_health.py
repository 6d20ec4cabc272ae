"""gpu health tables

Revision ID: 0003_health
Revises: 0002_wlm
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0003_health"
down_revision: str | None = "0002_wlm"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

Str = sqlmodel.sql.sqltypes.AutoString
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _ts(name: str, nullable: bool = True) -> sa.Column:  # type: ignore[type-arg]
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _node_fk() -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(["node_id"], ["node.id"], ondelete="CASCADE")


def upgrade() -> None:
    op.create_table(
        "nodehealth",
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("verdict", Str(length=16), nullable=False),
        sa.Column("report_verdict", Str(length=16), nullable=True),
        _ts("last_report_at"),
        _ts("collected_at"),
        sa.Column("consecutive_ok", sa.Integer(), nullable=False),
        sa.Column("gpu_count", sa.Integer(), nullable=False),
        sa.Column("agent_version", Str(length=64), nullable=True),
        sa.Column("driver_version", Str(length=64), nullable=True),
        sa.Column("findings", sa.JSON(), nullable=True),
        sa.Column("drained_by_bcm", sa.Boolean(), nullable=False),
        sa.Column("drain_reason", Str(length=512), nullable=True),
        sa.Column("pending_action", Str(length=16), nullable=True),
        sa.Column("action_attempts", sa.Integer(), nullable=False),
        sa.Column("samples_since_prune", sa.Integer(), nullable=False),
        _ts("updated_at", nullable=False),
        _node_fk(),
        sa.PrimaryKeyConstraint("node_id"),
    )
    op.create_index("ix_nodehealth_verdict", "nodehealth", ["verdict"])
    op.create_index("ix_nodehealth_last_report_at", "nodehealth", ["last_report_at"])
    op.create_index("ix_nodehealth_pending_action", "nodehealth", ["pending_action"])

    op.create_table(
        "gpuhealth",
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("uuid", Str(length=96), nullable=False),
        sa.Column("name", Str(length=128), nullable=True),
        sa.Column("pci_bus_id", Str(length=32), nullable=True),
        sa.Column("verdict", Str(length=16), nullable=False),
        sa.Column("reasons", sa.JSON(), nullable=True),
        sa.Column("temperature_c", sa.Integer(), nullable=True),
        sa.Column("power_draw_w", sa.Float(), nullable=True),
        sa.Column("utilization_gpu_pct", sa.Integer(), nullable=True),
        sa.Column("utilization_memory_pct", sa.Integer(), nullable=True),
        sa.Column("memory_total_mib", sa.Integer(), nullable=True),
        sa.Column("memory_used_mib", sa.Integer(), nullable=True),
        sa.Column("ecc_sbe_volatile", sa.Integer(), nullable=True),
        sa.Column("ecc_dbe_volatile", sa.Integer(), nullable=True),
        sa.Column("ecc_sbe_aggregate", sa.Integer(), nullable=True),
        sa.Column("ecc_dbe_aggregate", sa.Integer(), nullable=True),
        sa.Column("pcie_replay", sa.Integer(), nullable=True),
        sa.Column("remap_correctable", sa.Integer(), nullable=True),
        sa.Column("remap_uncorrectable", sa.Integer(), nullable=True),
        sa.Column("remap_pending", sa.Boolean(), nullable=True),
        sa.Column("remap_failure", sa.Boolean(), nullable=True),
        sa.Column("retired_sbe", sa.Integer(), nullable=True),
        sa.Column("retired_dbe", sa.Integer(), nullable=True),
        sa.Column("retired_pending", sa.Boolean(), nullable=True),
        sa.Column("last_xid", sa.Integer(), nullable=True),
        sa.Column("xid_count", sa.Integer(), nullable=False),
        _ts("sampled_at", nullable=False),
        _node_fk(),
        sa.PrimaryKeyConstraint("node_id", "index"),
    )
    op.create_index("ix_gpuhealth_uuid", "gpuhealth", ["uuid"])
    op.create_index("ix_gpuhealth_verdict", "gpuhealth", ["verdict"])

    op.create_table(
        "healthsample",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("uuid", Str(length=96), nullable=False),
        sa.Column("gpu_index", sa.Integer(), nullable=False),
        _ts("time", nullable=False),
        sa.Column("verdict", Str(length=16), nullable=False),
        sa.Column("temperature_c", sa.Integer(), nullable=True),
        sa.Column("power_draw_w", sa.Float(), nullable=True),
        sa.Column("utilization_gpu_pct", sa.Integer(), nullable=True),
        sa.Column("memory_used_mib", sa.Integer(), nullable=True),
        sa.Column("ecc_sbe_volatile", sa.Integer(), nullable=True),
        sa.Column("ecc_dbe_volatile", sa.Integer(), nullable=True),
        sa.Column("xid", sa.Integer(), nullable=True),
        _node_fk(),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_healthsample_node_id", "healthsample", ["node_id"])
    op.create_index("ix_healthsample_uuid_id", "healthsample", ["uuid", "id"])

    op.create_table(
        "healthevent",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        _ts("time", nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("gpu_uuid", Str(length=96), nullable=True),
        sa.Column("gpu_index", sa.Integer(), nullable=True),
        sa.Column("severity", Str(length=16), nullable=False),
        sa.Column("code", Str(length=64), nullable=False),
        sa.Column("message", Str(length=1024), nullable=False),
        sa.Column("action", Str(length=32), nullable=True),
        _node_fk(),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_healthevent_time", "healthevent", ["time"])
    op.create_index("ix_healthevent_node_id", "healthevent", ["node_id"])
    op.create_index("ix_healthevent_severity", "healthevent", ["severity"])


def downgrade() -> None:
    op.drop_table("healthevent")
    op.drop_table("healthsample")
    op.drop_table("gpuhealth")
    op.drop_table("nodehealth")
