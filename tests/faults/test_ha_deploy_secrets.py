"""A deploy taken up by another head finishes with its request's write-only values (#27).

The accounting password a Slurm deploy request gives is kept in the cluster's directory of the server
that took the request. A server taking the deploy up has none there: it used to render slurmdbd.conf with
an empty password. Now the value travels with the operation, encrypted with secret.key (which heads share,
as the README says), and the other server writes it into its own cluster directory before it runs.
(tests/lab/test_ha_deploy.py does this end to end with a kill -9.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session

from bcm.errors import BcmError
from bcm.models.node import Node
from bcm.models.operation import Operation
from bcm.models.wlm import SlurmDeployRequest, WlmCluster
from bcm.services import secrets
from bcm.settings import Settings
from bcm.workers import wlm
from bcm.workers.job import Job

PASSWORD = "Acct-pass-27!"


def _cluster(engine: Engine) -> None:
    with Session(engine) as s:
        ctl = Node(name="ctl01")
        s.add(ctl)
        s.flush()
        assert ctl.id is not None
        s.add(WlmCluster(name="lab", kind="slurm", controller_id=ctl.id))
        s.commit()


def _taken_up(engine: Engine, state_dir: Path, spec: dict[str, object]) -> Job:
    other = Settings(state_dir=state_dir, database_url=str(engine.url))
    return Job(engine, other, 1, [], "admin", dict(spec), claims=2)


def test_a_deploy_taken_up_elsewhere_keeps_its_accounting_password(
    engine: Engine, settings: Settings, tmp_path: Path
) -> None:
    _cluster(engine)
    req = SlurmDeployRequest(name="lab", controller="ctl01", nodes="ctl01", storage_pass=PASSWORD)  # type: ignore[arg-type]
    op = Operation(kind="wlm.deploy", spec={"cluster": "lab", "verify": True})
    wlm.carry_secrets(op, settings.state_dir, req)
    assert op.spec and op.spec["cluster"] == "lab" and PASSWORD not in json.dumps(op.spec)  # never in clear

    second = tmp_path / "second"  # another head: the first's secret.key copied, as the README says
    second.mkdir()
    shutil.copy2(secrets.key_path(settings.state_dir), secrets.key_path(second))
    wlm.restore_secrets(_taken_up(engine, second, op.spec))
    kept = second / "wlm" / "lab" / "storage.pass"
    assert kept.read_text() == PASSWORD and kept.stat().st_mode & 0o077 == 0

    stranger = tmp_path / "stranger"  # a head whose key was never copied: a clear reason, nothing written
    stranger.mkdir()
    secrets.ensure_key(stranger)
    with pytest.raises(BcmError, match="cannot be decrypted"):
        wlm.restore_secrets(_taken_up(engine, stranger, op.spec))
    assert not (stranger / "wlm" / "lab" / "storage.pass").exists()


def test_a_deploy_without_write_only_values_carries_nothing(settings: Settings) -> None:
    op = Operation(kind="wlm.deploy", spec={"cluster": "lab", "verify": True})
    wlm.carry_secrets(op, settings.state_dir, SlurmDeployRequest(name="lab", controller="c", nodes="c"))
    assert op.spec == {"cluster": "lab", "verify": True}
