"""SSH host public keys as bcm pins them: one OpenSSH line (``type base64``), the blob checked to be
a key of the type it claims. Pure code."""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct

from bcm.errors import InvalidInput

KEY_TYPES = frozenset(
    {
        "ssh-ed25519",
        "ecdsa-sha2-nistp256",
        "ecdsa-sha2-nistp384",
        "ecdsa-sha2-nistp521",
        "ssh-rsa",
        "sk-ssh-ed25519@openssh.com",
        "sk-ecdsa-sha2-nistp256@openssh.com",
    }
)
MAX_KEY_CHARS = 16384


def check_host_key(line: str, field: str = "ssh_host_key") -> str:
    """``ssh-ed25519 AAAA… [comment]`` → ``ssh-ed25519 AAAA…``; anything else is InvalidInput."""
    if not isinstance(line, str) or len(line) > MAX_KEY_CHARS:
        raise InvalidInput(f"{field}: not an SSH public key line", field=field)
    parts = line.strip().split()
    if len(parts) < 2 or parts[0] not in KEY_TYPES:
        raise InvalidInput(
            f"{field}: not an SSH public key line (like 'ssh-ed25519 AAAAC3Nz…'; types: "
            f"{', '.join(sorted(KEY_TYPES))})",
            field=field,
        )
    kind, data = parts[0], parts[1]
    try:
        blob = base64.b64decode(data, validate=True)
        (length,) = struct.unpack(">I", blob[:4])
        embedded = blob[4 : 4 + length].decode("ascii")
    except (binascii.Error, struct.error, UnicodeDecodeError, ValueError):
        raise InvalidInput(f"{field}: the key data is not valid base64 of an SSH key", field=field) from None
    if embedded != kind or len(blob) <= 4 + length:
        raise InvalidInput(f"{field}: the key data is not a {kind} key", field=field)
    return f"{kind} {data}"


def fingerprint(line: str) -> str:
    """OpenSSH's SHA256 fingerprint of a key line (``SHA256:…``), for events and messages."""
    digest = hashlib.sha256(base64.b64decode(line.split()[1])).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")
