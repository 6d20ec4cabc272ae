"""Tenancy: departments, projects, project members and department admins (scoped role bindings)

Revision ID: 0010_tenancy
Revises: 0009_wlm_members
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0010_tenancy"
down_revision: str | None = "0009_wlm_members"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _stamps() -> list[sa.Column]:  # type: ignore[type-arg]
    return [
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    ]


def upgrade() -> None:
    op.create_table(
        "department",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(length=40), nullable=False),
        sa.Column("gpu_quota", sa.Integer(), nullable=False),
        sa.Column("fairshare", sa.Integer(), nullable=False),
        sa.Column("description", sqlmodel.sql.sqltypes.AutoString(length=200), nullable=True),
        *_stamps(),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("department", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_department_name"), ["name"], unique=True)
    op.create_table(
        "project",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(length=40), nullable=False),
        sa.Column("department_id", sa.Integer(), nullable=False),
        sa.Column("deserved_gpus", sa.Integer(), nullable=False),
        sa.Column("limit_gpus", sa.Integer(), nullable=False),
        sa.Column("fairshare", sa.Integer(), nullable=False),
        sa.Column("description", sqlmodel.sql.sqltypes.AutoString(length=200), nullable=True),
        *_stamps(),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["department_id"], ["department.id"], ondelete="RESTRICT"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("project", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_project_name"), ["name"], unique=True)
        batch_op.create_index(batch_op.f("ix_project_department_id"), ["department_id"], unique=False)
    op.create_table(
        "project_member",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        *_stamps(),
        sa.ForeignKeyConstraint(["project_id"], ["project.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("project_id", "user_id"),
    )
    with op.batch_alter_table("project_member", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_project_member_project_id"), ["project_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_project_member_user_id"), ["user_id"], unique=False)
    op.create_table(
        "department_admin",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("department_id", sa.Integer(), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        *_stamps(),
        sa.ForeignKeyConstraint(["department_id"], ["department.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("department_id", "user_id"),
    )
    with op.batch_alter_table("department_admin", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_department_admin_department_id"), ["department_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_department_admin_user_id"), ["user_id"], unique=False)


def downgrade() -> None:
    for table, columns in (
        ("department_admin", ("department_id", "user_id")),
        ("project_member", ("project_id", "user_id")),
        ("project", ("name", "department_id")),
        ("department", ("name",)),
    ):
        with op.batch_alter_table(table, schema=None) as batch_op:
            for column in columns:
                batch_op.drop_index(batch_op.f(f"ix_{table}_{column}"))
        op.drop_table(table)
