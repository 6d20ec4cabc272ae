"""/api/v1/ssh: the server's SSH identity, which nodes must trust."""

from __future__ import annotations

from fastapi import APIRouter

from bcm.api.deps import SettingsDep, Viewer
from bcm.drivers import ssh

router = APIRouter(prefix="/ssh", tags=["ssh"])


@router.get("/public-key")
def public_key(settings: SettingsDep, _t: Viewer) -> dict[str, str]:
    return {"public_key": ssh.ensure_keypair(settings.ssh_key_file)}
