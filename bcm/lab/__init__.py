"""A real lab on one machine: SSH nodes in network namespaces on an isolated bridge (see LAB.md).

    from bcm.lab import Lab
    lab = Lab(Path("/var/lib/bcm/lab/bcmlab"))   # bridge namespace "bcmlab", nodes node01...
    nodes = lab.up(8, authorized_keys=[pubkey])  # -> list[LabNode]; the head is 198.18.0.1
    lab.freeze("node03"); lab.thaw("node03")     # sshd hangs after connect, then recovers
    lab.rekey("node04")                          # the node's host key changes
    lab.down()                                   # nothing left: namespaces, mounts, processes, veth

Needs root, iproute2, util-linux (nsenter, unshare), openssh-client and mmdebstrap (first run only).
"""

from bcm.lab.errors import LabError
from bcm.lab.lab import DEFAULT_STATE_DIR, Lab
from bcm.lab.node import LabNode

__all__ = ["DEFAULT_STATE_DIR", "Lab", "LabError", "LabNode"]
