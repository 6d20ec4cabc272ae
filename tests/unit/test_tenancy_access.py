"""The role × scope × action table of tenancy, checked cell by cell against a table written apart from it."""

from __future__ import annotations

import pytest

from bcm.domain.tenancy import Action, Scope, allowed
from bcm.models.auth import Role

R, W, X = "read", "write", "delete"  # how each action is classed below
KIND = {
    Action.READ: R,
    Action.READ_USAGE: R,
    Action.PLAN: R,
    Action.CREATE_DEPARTMENT: W,
    Action.UPDATE_DEPARTMENT: W,
    Action.CREATE_PROJECT: W,
    Action.UPDATE_PROJECT: W,
    Action.MANAGE_MEMBERS: W,
    Action.APPLY: W,
    Action.DELETE_DEPARTMENT: X,
    Action.DELETE_PROJECT: X,
    Action.MANAGE_ADMINS: X,
}
DEPT_ADMIN_MAY = {
    Action.READ,
    Action.READ_USAGE,
    Action.CREATE_PROJECT,
    Action.UPDATE_PROJECT,
    Action.DELETE_PROJECT,
    Action.MANAGE_MEMBERS,
}


def expected(role: Role, scope: Scope, action: Action) -> bool:
    if role is Role.NODE:
        return False
    system = {Role.ADMIN: {R, W, X}, Role.OPERATOR: {R, W}, Role.VIEWER: {R}, Role.USER: set()}[role]
    if KIND[action] in system:
        return True
    if scope is Scope.DEPARTMENT_ADMIN:
        return action in DEPT_ADMIN_MAY
    if scope is Scope.PROJECT_MEMBER:
        return action is Action.READ_USAGE
    return False


def test_every_action_is_classed() -> None:
    assert set(KIND) == set(Action)


@pytest.mark.parametrize("role", list(Role))
@pytest.mark.parametrize("scope", list(Scope))
def test_table(role: Role, scope: Scope) -> None:
    got = {a: allowed(role, scope, a) for a in Action}
    assert got == {a: expected(role, scope, a) for a in Action}
