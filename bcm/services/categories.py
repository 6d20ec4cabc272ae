"""Category use cases."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func
from sqlmodel import Session, col, select

from bcm.errors import Conflict, Duplicate, NotFound
from bcm.models.category import Category, CategoryCreate, CategoryPublic, CategoryUpdate
from bcm.models.node import Node
from bcm.services import events, images


def get(session: Session, name: str) -> Category:
    cat = session.exec(select(Category).where(Category.name == name)).first()
    if cat is None:
        raise NotFound(f"category {name!r} not found")
    return cat


def create(session: Session, spec: CategoryCreate, actor: str) -> Category:
    if session.exec(select(Category).where(Category.name == spec.name)).first() is not None:
        raise Duplicate(f"name: category {spec.name!r} already exists", field="name")
    cat = Category(**_columns(session, spec, spec.model_dump()))
    session.add(cat)
    events.record(session, actor, "category.create", spec.name)
    session.flush()
    return cat


def update_category(session: Session, name: str, spec: CategoryUpdate, actor: str) -> Category:
    cat = get(session, name)
    for field, value in _columns(session, spec, spec.model_dump(exclude_unset=True)).items():
        setattr(cat, field, value)
    session.add(cat)
    events.record(session, actor, "category.update", name, ", ".join(sorted(spec.model_fields_set)))
    session.flush()
    return cat


def _columns(
    session: Session, spec: CategoryCreate | CategoryUpdate, values: dict[str, Any]
) -> dict[str, Any]:
    """Column values from a validated spec: the health policy stored as only the keys it sets."""
    if "image" in values:
        images.check_reference(session, values["image"])
    if "health_policy" in values:
        values["health_policy"] = spec.health_policy.stored() if spec.health_policy else None
    return values


def delete(session: Session, name: str, actor: str) -> None:
    cat = get(session, name)
    used = _node_count(session, cat)
    if used:
        raise Conflict(f"category {name!r} is used by {used} node(s); move them first")
    session.delete(cat)
    events.record(session, actor, "category.delete", name)
    session.flush()


def list_public(session: Session) -> list[CategoryPublic]:
    counts = dict(
        session.exec(select(Node.category_id, func.count()).group_by(col(Node.category_id))).all()  # type: ignore[arg-type]
    )
    return [
        to_public(c, counts.get(c.id, 0)) for c in session.exec(select(Category).order_by(col(Category.name)))
    ]


def get_public(session: Session, name: str) -> CategoryPublic:
    cat = get(session, name)
    return to_public(cat, _node_count(session, cat))


def _node_count(session: Session, cat: Category) -> int:
    return int(session.exec(select(func.count()).where(Node.category_id == cat.id)).one())


def to_public(cat: Category, node_count: int = 0) -> CategoryPublic:
    return CategoryPublic(**cat.model_dump(exclude={"id"}), node_count=node_count)


SEED = (
    CategoryCreate(name="default", description="nodes without a more specific category"),
    CategoryCreate(name="gpu", wlm_role="compute", description="GPU compute nodes"),
)


def seed_defaults(session: Session) -> None:
    """On an empty category table, create the stock categories (as BCM ships ``default``)."""
    if session.exec(select(Category)).first() is None:
        for spec in SEED:
            session.add(Category(**_columns(session, spec, spec.model_dump())))
        session.flush()
