"""images: build state, current version, manifest; one row per artifact with size and sha256

Revision ID: 0008_images
Revises: 0007_op_runner
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0008_images"
down_revision: str | None = "0007_op_runner"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("image", schema=None) as batch_op:
        batch_op.add_column(sa.Column("kernel_version", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True))
        batch_op.add_column(sa.Column("layer_key", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True))
        batch_op.add_column(sa.Column("is_current", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.add_column(sa.Column("operation_id", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("error", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("published_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("manifest", sa.JSON(), nullable=True))
        batch_op.create_index(batch_op.f("ix_image_is_current"), ["is_current"], unique=False)
        batch_op.create_index(batch_op.f("ix_image_operation_id"), ["operation_id"], unique=False)
    op.create_table(
        "imageartifact",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("image_id", sa.Integer(), nullable=False),
        sa.Column("kind", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("filename", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.ForeignKeyConstraint(["image_id"], ["image.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("image_id", "kind"),
    )
    with op.batch_alter_table("imageartifact", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_imageartifact_image_id"), ["image_id"], unique=False)
    with op.batch_alter_table("node", schema=None) as batch_op:
        batch_op.add_column(sa.Column("running_image", sqlmodel.sql.sqltypes.AutoString(length=200), nullable=True))
        batch_op.add_column(sa.Column("image_pushed_at", sa.DateTime(timezone=True), nullable=True))
    # node.image and category.image now name an image: values that name none were free text; cleared
    for table in ("node", "category"):
        op.execute(
            f"UPDATE {table} SET image = NULL WHERE image IS NOT NULL AND image NOT IN (SELECT name FROM image)"
        )


def downgrade() -> None:
    with op.batch_alter_table("node", schema=None) as batch_op:
        batch_op.drop_column("image_pushed_at")
        batch_op.drop_column("running_image")
    with op.batch_alter_table("imageartifact", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_imageartifact_image_id"))
    op.drop_table("imageartifact")
    with op.batch_alter_table("image", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_image_operation_id"))
        batch_op.drop_index(batch_op.f("ix_image_is_current"))
        for col in ("manifest", "published_at", "error", "operation_id", "is_current", "layer_key", "kernel_version"):
            batch_op.drop_column(col)
