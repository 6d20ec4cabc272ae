"""Secrets at rest: Fernet (AES-128-CBC + HMAC-SHA256) with one key in the state directory (0600).

Whoever can read the key file can read the secrets; the point is that a database dump, backup or
replica alone reveals no BMC password.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken

from bcm.errors import BcmError

KEY_FILE = "secret.key"


def key_path(state_dir: Path) -> Path:
    return Path(state_dir) / KEY_FILE


def _load_or_create(state_dir: Path) -> bytes:
    path = key_path(state_dir)
    with contextlib.suppress(FileNotFoundError):
        return path.read_bytes().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    key = Fernet.generate_key()
    try:  # O_EXCL: two processes starting at once agree on one key
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_bytes().strip()
    with os.fdopen(fd, "wb") as f:
        f.write(key + b"\n")
    return key


def ensure_key(state_dir: Path) -> None:
    """Make the key now if there is none (``bcm serve`` at start): a head node added by copying the state
    directory's secrets then copies this key, not a key made later on one head only."""
    _load_or_create(state_dir)


def _load(state_dir: Path) -> bytes:
    try:
        return key_path(state_dir).read_bytes().strip()
    except FileNotFoundError:
        raise BcmError(
            f"a stored secret cannot be decrypted: {key_path(state_dir)} is missing (on a second head node,"
            " copy it from the first); set the password again"
        ) from None


def encrypt(state_dir: Path, plain: str) -> str:
    return Fernet(_load_or_create(state_dir)).encrypt(plain.encode()).decode()


def decrypt(state_dir: Path, token: str) -> str:
    try:
        return Fernet(_load(state_dir)).decrypt(token.encode()).decode()
    except InvalidToken:
        raise BcmError(
            f"a stored secret cannot be decrypted with {key_path(state_dir)} (was the key replaced?); "
            "set the password again"
        ) from None
