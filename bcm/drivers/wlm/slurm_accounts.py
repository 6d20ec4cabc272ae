"""Slurm accounting for the tenancy tree, without I/O: parse ``sacctmgr -nP`` output, compare it with
the accounts bcm wants, and list the sacctmgr commands that close the gap.

bcm marks its accounts ``Organization=bcm`` and touches no other: an account someone made by hand
under another organization is left alone (and named in the plan's notes when its name clashes).
*Drift* is a difference between Slurm and what bcm last applied there (a hand edit in sacctmgr),
as opposed to a change of the model since then.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field

from bcm.drivers.wlm.base import AccountSpec, TenancyChange

ORGANIZATION = "bcm"
ROOT = "root"
ENFORCE = "associations,limits,qos"
_GPU_TRES = re.compile(r"(?:^|,)gres/gpu=(-?\d+)(?:,|$)")


@dataclass(frozen=True)
class Assoc:
    account: str
    user: str  # "" for the account's own association
    parent: str
    fairshare: str
    grp_tres: str

    @property
    def gpu_limit(self) -> int | None:
        m = _GPU_TRES.search(self.grp_tres)
        return int(m.group(1)) if m and int(m.group(1)) >= 0 else None


@dataclass
class Holdings:
    """What slurmdbd holds for one cluster, as far as bcm cares."""

    managed: set[str] = field(default_factory=set)  # accounts with Organization=bcm
    foreign: set[str] = field(default_factory=set)  # every other account
    accounts: dict[str, Assoc] = field(default_factory=dict)  # account associations on the cluster
    users: dict[str, set[str]] = field(default_factory=dict)  # user -> accounts they have an association in
    defaults: dict[str, str] = field(default_factory=dict)  # user -> default account


ACCOUNT_QUERY = ["sacctmgr", "-nP", "show", "account", "format=Account,Organization"]
USER_QUERY = ["sacctmgr", "-nP", "show", "user", "format=User,DefaultAccount"]


def assoc_query(cluster: str) -> list[str]:
    return [
        "sacctmgr",
        "-nP",
        "show",
        "assoc",
        "where",
        f"cluster={cluster}",
        "format=Account,User,ParentName,Fairshare,GrpTRES",
    ]


def parse(accounts_out: str, assoc_out: str, users_out: str) -> Holdings:
    h = Holdings()
    for line in accounts_out.splitlines():
        name, _, org = line.strip().partition("|")
        if name:
            (h.managed if org.strip() == ORGANIZATION else h.foreign).add(name)
    for line in assoc_out.splitlines():
        parts = line.rstrip("\n").split("|")
        if len(parts) < 5 or not parts[0]:
            continue
        a = Assoc(parts[0], parts[1], parts[2], parts[3], parts[4])
        if a.user:
            h.users.setdefault(a.user, set()).add(a.account)
        else:
            h.accounts[a.account] = a
    for line in users_out.splitlines():
        user, _, default = line.strip().partition("|")
        if user:
            h.defaults[user] = default
    return h


def _sacctmgr(*args: str) -> str:
    return shlex.join(["sacctmgr", "-i", *args])


def _limit(value: int | None) -> str:
    return f"gres/gpu={-1 if value is None else value}"


def _fs(a: Assoc) -> int | None:
    return int(a.fairshare) if a.fairshare.isdigit() else None


def diff(
    cluster: str, want: list[AccountSpec], have: Holdings, previous: Iterable[AccountSpec] = ()
) -> tuple[list[TenancyChange], list[str]]:
    """The changes, in the order they can run, and notes on what bcm will not touch."""
    prev = {a.name: a for a in previous}
    prev_users = {(u, a.name) for a in prev.values() for u in a.users}
    wanted = {a.name: a for a in want}
    notes: list[str] = []
    adds: list[TenancyChange] = []
    mods: list[TenancyChange] = []
    for spec in want:  # departments come first, so parents exist before children
        parent = spec.parent or ROOT
        kind = "department" if spec.parent is None else "project"
        if spec.name in have.foreign:
            notes.append(f"account {spec.name} exists in Slurm but was not made by bcm; bcm leaves it alone")
            continue
        cur = have.accounts.get(spec.name) if spec.name in have.managed else None
        if cur is None:
            args = [
                f"name={spec.name}",
                f"cluster={cluster}",
                f"parent={parent}",
                f"fairshare={spec.fairshare}",
            ]
            args += [f"organization={ORGANIZATION}", f"description=bcm {kind}"]
            if spec.gpu_limit is not None:
                args.append(f"grptres={_limit(spec.gpu_limit)}")
            detail = f"{kind} under {parent}, fairshare {spec.fairshare}"
            detail += f", GrpTRES {_limit(spec.gpu_limit)}" if spec.gpu_limit is not None else ""
            adds.append(
                TenancyChange(
                    "add",
                    "account",
                    spec.name,
                    detail,
                    _sacctmgr("add", "account", *args),
                    drift=spec.name in prev,
                )
            )
            continue
        was = prev.get(spec.name)
        if cur.parent != parent:
            drift = was is not None and (was.parent or ROOT) != cur.parent
            mods.append(
                TenancyChange(
                    "modify",
                    "account",
                    spec.name,
                    f"parent {cur.parent} -> {parent}",
                    _sacctmgr(
                        "modify",
                        "account",
                        "where",
                        f"name={spec.name}",
                        f"cluster={cluster}",
                        "set",
                        f"parent={parent}",
                    ),
                    drift=drift,
                )
            )
        sets, details = [], []
        drift = False
        if _fs(cur) != spec.fairshare:
            sets.append(f"fairshare={spec.fairshare}")
            details.append(f"fairshare {cur.fairshare or '-'} -> {spec.fairshare}")
            drift |= was is not None and _fs(cur) != was.fairshare
        if cur.gpu_limit != spec.gpu_limit:
            sets.append(f"grptres={_limit(spec.gpu_limit)}")
            details.append(
                f"GrpTRES {cur.grp_tres or '-'} -> {_limit(spec.gpu_limit) if spec.gpu_limit is not None else '-'}"
            )
            drift |= was is not None and cur.gpu_limit != was.gpu_limit
        if sets:
            mods.append(
                TenancyChange(
                    "modify",
                    "account",
                    spec.name,
                    ", ".join(details),
                    _sacctmgr(
                        "modify", "account", "where", f"name={spec.name}", f"cluster={cluster}", "set", *sets
                    ),
                    drift=drift,
                )
            )

    want_users = {(u, a.name) for a in want for u in a.users if a.name not in have.foreign}
    have_users = {(u, acct) for u, accts in have.users.items() for acct in accts if acct in have.managed}
    user_adds = [
        TenancyChange(
            "add",
            "user",
            u,
            f"member of {acct}",
            _sacctmgr("add", "user", f"name={u}", f"account={acct}", f"cluster={cluster}"),
            drift=(u, acct) in prev_users,
        )
        for u, acct in sorted(want_users - have_users)
    ]
    user_removals: list[TenancyChange] = []
    gone_by_user: dict[str, set[str]] = {}
    for u, acct in sorted(have_users - want_users):
        gone_by_user.setdefault(u, set()).add(acct)
    for u, gone in sorted(gone_by_user.items()):
        kept = (have.users.get(u, set()) - gone) | {a for uu, a in want_users if uu == u}
        default = have.defaults.get(u, "")
        if default in gone and kept:
            new_default = sorted(kept)[0]
            user_removals.append(
                TenancyChange(
                    "modify",
                    "user",
                    u,
                    f"default account {default} -> {new_default}",
                    _sacctmgr("modify", "user", "where", f"name={u}", "set", f"defaultaccount={new_default}"),
                )
            )
        if not kept:  # their last association on the cluster: the user goes (their default with it)
            user_removals.append(
                TenancyChange(
                    "remove",
                    "user",
                    u,
                    f"no longer a member of {', '.join(sorted(gone))}",
                    _sacctmgr("remove", "user", "where", f"name={u}", f"cluster={cluster}"),
                    drift=any((u, a) not in prev_users for a in gone),
                )
            )
            continue
        for acct in sorted(gone):
            user_removals.append(
                TenancyChange(
                    "remove",
                    "user",
                    u,
                    f"no longer a member of {acct}",
                    _sacctmgr(
                        "remove", "user", "where", f"name={u}", f"account={acct}", f"cluster={cluster}"
                    ),
                    drift=(u, acct) not in prev_users,
                )
            )

    removals = []
    gone_accounts = [a for a in have.accounts if a in have.managed and a not in wanted]
    depth = {a: _depth(a, have) for a in gone_accounts}
    for acct in sorted(gone_accounts, key=lambda a: (-depth[a], a)):  # children before parents
        removals.append(
            TenancyChange(
                "remove",
                "account",
                acct,
                f"not in bcm's model (was under {have.accounts[acct].parent})",
                _sacctmgr("remove", "account", "where", f"name={acct}", f"cluster={cluster}"),
                drift=acct not in prev,
            )
        )
    return adds + mods + user_adds + user_removals + removals, notes


def _depth(account: str, have: Holdings) -> int:
    seen, depth = set(), 0
    while account in have.accounts and account not in seen and depth < 64:  # bounded: a tree, not a cycle
        seen.add(account)
        account = have.accounts[account].parent
        depth += 1
    return depth


def enforcing(config_out: str) -> bool:
    """Whether ``scontrol show config`` says associations and limits are enforced."""
    for line in config_out.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "AccountingStorageEnforce":
            got = set(value.strip().split(","))
            return {"associations", "limits"} <= got
    return False
