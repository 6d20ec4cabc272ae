"""GPU health history: one row per report (``healthrecord``) instead of one per GPU (``healthsample``)

Every report added a ``healthsample`` row per GPU: eight inserts for an 8-GPU node, each with two index
entries and a foreign-key check. At 1,000 reports a second that was the largest single part of the
database's work. A ``healthrecord`` row holds one report's readings, a list per GPU in
``bcm.models.health.RECORD_FIELDS`` order; the history query picks a GPU's readings out of its node's
records, and pruning keeps ``history_per_gpu`` records per node.

The samples already stored are carried over: a node's samples with the same time (one report's) become
one record. The downgrade splits records back into samples.

Revision ID: 0012_health_records
Revises: 0011_health_writes
"""

from collections.abc import Iterator, Sequence
from itertools import groupby
from typing import Any

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0012_health_records"
down_revision: str | None = "0011_health_writes"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
BATCH = 1000  # rows per INSERT while carrying the history over

# bcm.models.health.RECORD_FIELDS as of this revision: a record's list per GPU
FIELDS = (
    "gpu_index",
    "uuid",
    "verdict",
    "temperature_c",
    "power_draw_w",
    "utilization_gpu_pct",
    "memory_used_mib",
    "ecc_sbe_volatile",
    "ecc_dbe_volatile",
    "xid",
)

_record = sa.table(
    "healthrecord",
    sa.column("node_id", sa.Integer),
    sa.column("time", sa.DateTime(timezone=True)),
    sa.column("gpus", sa.JSON),
)
_sample = sa.table(
    "healthsample",
    sa.column("node_id", sa.Integer),
    sa.column("time", sa.DateTime(timezone=True)),
    *(sa.column(name) for name in FIELDS),
)


def _batches(rows: Iterator[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    batch: list[dict[str, Any]] = []
    for row in rows:
        batch.append(row)
        if len(batch) == BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _create_samples() -> None:
    op.create_table(
        "healthsample",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("uuid", sqlmodel.sql.sqltypes.AutoString(length=96), nullable=False),
        sa.Column("gpu_index", sa.Integer(), nullable=False),
        sa.Column("time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("verdict", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("temperature_c", sa.Integer(), nullable=True),
        sa.Column("power_draw_w", sa.Float(), nullable=True),
        sa.Column("utilization_gpu_pct", sa.Integer(), nullable=True),
        sa.Column("memory_used_mib", sa.Integer(), nullable=True),
        sa.Column("ecc_sbe_volatile", sa.BigInteger(), nullable=True),
        sa.Column("ecc_dbe_volatile", sa.BigInteger(), nullable=True),
        sa.Column("xid", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(["node_id"], ["node.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_healthsample_node_uuid_id", "healthsample", ["node_id", "uuid", "id"])


def upgrade() -> None:
    op.create_table(
        "healthrecord",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("gpus", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["node_id"], ["node.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_healthrecord_node_id_id", "healthrecord", ["node_id", "id"])
    conn = op.get_bind()
    samples = conn.execute(  # streamed (the options on the statement: the inserts run on this connection too)
        sa.select(_sample)
        .order_by(_sample.c.node_id, _sample.c.time, _sample.c.gpu_index)
        .execution_options(stream_results=True, yield_per=BATCH)
    )

    def records() -> Iterator[dict[str, Any]]:
        for (node_id, time), group in groupby(samples, key=lambda r: (r.node_id, r.time)):
            yield {"node_id": node_id, "time": time, "gpus": [[getattr(r, f) for f in FIELDS] for r in group]}

    for batch in _batches(records()):
        conn.execute(sa.insert(_record), batch)
    op.drop_table("healthsample")


def downgrade() -> None:
    _create_samples()
    conn = op.get_bind()
    records = conn.execute(
        sa.select(_record)
        .order_by(_record.c.node_id, sa.text("id"))
        .execution_options(stream_results=True, yield_per=BATCH)
    )

    def samples() -> Iterator[dict[str, Any]]:
        for r in records:
            for gpu in r.gpus:
                values = dict.fromkeys(FIELDS) | dict(zip(FIELDS, gpu, strict=False))
                yield {**values, "node_id": r.node_id, "time": r.time}

    for batch in _batches(samples()):
        conn.execute(sa.insert(_sample), batch)
    op.drop_table("healthrecord")
