"""Kernel command-line arguments an operator adds (settings, category, node): kernel parameters only.

They are pasted into an iPXE ``kernel`` line, so a newline or an iPXE/shell metacharacter would add
commands to the boot script (``shell``, ``chain http://…``). Each argument is ``key`` or ``key=value``
from a conservative alphabet; ``bcm.*`` (and ``initrd``) are bcm's own: an operator's would override
them, since the image's init keeps the last value (``bcm.overlay=`` elsewhere sends the boot token
there). Pure code.
"""

from __future__ import annotations

import re

from bcm.errors import InvalidInput

MAX_CHARS = 1024
# a kernel parameter: key, optionally =value; values keep what real parameters use (console=ttyS0,115200n8,
# root=UUID=…, ip=::::eth0:dhcp, nvidia.NVreg_X=1, rd.driver.blacklist=nouveau, mem=4G@0x100000)
_ARG = re.compile(r"[A-Za-z0-9_.-]+(=[A-Za-z0-9_.,:/+=@%-]*)?")
RESERVED_PREFIXES = ("bcm.",)
RESERVED_KEYS = frozenset({"initrd"})


def check_kernel_args(value: str, field: str = "kernel_args") -> str:
    """The arguments separated by single spaces; InvalidInput naming ``field`` for anything else."""
    if not isinstance(value, str) or len(value) > MAX_CHARS:
        raise InvalidInput(f"{field}: at most {MAX_CHARS} characters of kernel parameters", field=field)
    if re.search(r"[^\x20-\x7e]", value):
        raise InvalidInput(
            f"{field}: kernel parameters on one line (no newline, tab or other control character)",
            field=field,
        )
    args = [a for a in value.split(" ") if a]
    for arg in args:
        key = arg.split("=", 1)[0]
        if not _ARG.fullmatch(arg):
            raise InvalidInput(
                f"{field}: {arg[:64]!r} is not a kernel parameter (key or key=value; letters, digits and "
                "_ . , : / + = @ % -; no quotes, $ ; & | < > or spaces inside)",
                field=field,
            )
        if key.lower().startswith(RESERVED_PREFIXES) or key.lower() in RESERVED_KEYS:
            raise InvalidInput(
                f"{field}: {key} is set by bcm itself (bcm.* and initrd are reserved)", field=field
            )
    return " ".join(args)
