"""Cheaper health writes: GPU and node health rows updated in place, no index written twice

Every report updates its node's ``nodehealth`` row and its GPUs' ``gpuhealth`` rows and adds one
``healthsample`` row per GPU; at 1,000 reports a second the index entries those writes make are a real
share of the database's work. So:

- ``healthsample.node_id`` loses its own index: ``ix_healthsample_node_uuid_id`` (node_id, uuid, id)
  starts with it and serves every lookup by node (the history, the pruning, a node's deletion).
- ``nodehealth.last_report_at`` loses its index, which every report changed, so that no update of the
  row could stay on its page. The two readers (the summary's stale count and the staleness sweep) scan
  one row per node, which is cheap at 10,000 nodes.
- On PostgreSQL ``gpuhealth`` and ``nodehealth`` keep half of each page free (fillfactor 50), so an
  update whose indexed columns did not change (the common case: same verdict, same UUID) writes the
  new row version on the same page and no index entry at all (a heap-only tuple). Pages written before
  this migration get the free space as their rows move.

Revision ID: 0011_health_writes
Revises: 0010_tenancy
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0011_health_writes"
down_revision: str | None = "0010_tenancy"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UPDATED_IN_PLACE = ("gpuhealth", "nodehealth")


def upgrade() -> None:
    op.drop_index("ix_healthsample_node_id", table_name="healthsample")
    op.drop_index("ix_nodehealth_last_report_at", table_name="nodehealth")
    if op.get_bind().dialect.name == "postgresql":
        for table in UPDATED_IN_PLACE:
            op.execute(f"ALTER TABLE {table} SET (fillfactor = 50)")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for table in UPDATED_IN_PLACE:
            op.execute(f"ALTER TABLE {table} RESET (fillfactor)")
    op.create_index("ix_nodehealth_last_report_at", "nodehealth", ["last_report_at"])
    op.create_index("ix_healthsample_node_id", "healthsample", ["node_id"])
