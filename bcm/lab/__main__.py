"""`python -m bcm.lab up --nodes N --authorized-key FILE | down | status [--json]` (root only)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bcm.lab import DEFAULT_STATE_DIR, Lab, LabError, LabNode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bcm.lab", description="Lab of SSH nodes on one machine")
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    parser.add_argument("--name", default="bcmlab", help="bridge namespace; node namespaces get it as prefix")
    parser.add_argument("--prefix", default="node", help="node hostname prefix")
    parser.add_argument("--subnet", default="198.18.0.0/24")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="(re)create the lab")
    up.add_argument("--nodes", type=int, required=True)
    up.add_argument("--authorized-key", type=Path, action="append", default=[], help="public key file")
    up.add_argument("--json", action="store_true")
    sub.add_parser("down", help="remove everything the lab made")
    status = sub.add_parser("status", help="list nodes and whether their sshd runs")
    status.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    lab = Lab(args.state_dir, args.name, args.prefix, subnet=args.subnet)
    try:
        if args.command == "up":
            keys = [line for path in args.authorized_key for line in path.read_text().splitlines() if line]
            _print(lab.up(args.nodes, keys), args.json)
        elif args.command == "down":
            lab.down()
        else:
            _print(lab.status(), args.json)
    except LabError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    return 0


def _print(nodes: list[LabNode], as_json: bool) -> None:
    if as_json:
        print(json.dumps([node.to_dict() for node in nodes], indent=2))
        return
    for node in nodes:
        state = "frozen" if node.frozen else "up" if node.alive else "down"
        print(f"{node.name}\t{node.ip}\t{node.mac}\t{node.netns}\t{state}")


if __name__ == "__main__":
    sys.exit(main())
