"""`specdec certs --out DIR [--hosts h1,h2]`: a development CA and its certificates
(specdec.serving.certificates)."""

from __future__ import annotations

import argparse
from pathlib import Path

from specdec.serving.certificates import DEFAULT_HOSTS, VALID_DAYS, write_certs


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "certs", help="write a development CA, a server and a client certificate")
    parser.add_argument("--out", required=True, help="directory to write them to")
    parser.add_argument("--hosts", default="",
                        help="comma-separated extra names or addresses the server "
                        "certificate is valid for (localhost and 127.0.0.1 always are)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    hosts = [h for h in args.hosts.split(",") if h.strip()]
    paths = write_certs(Path(args.out), hosts)
    for path in paths.values():
        print(path)
    valid = ", ".join(dict.fromkeys([*DEFAULT_HOSTS, *hosts]))
    print(f"server certificate valid for: {valid}; {VALID_DAYS} days")
    return 0
