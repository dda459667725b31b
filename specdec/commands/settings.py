"""`specdec settings`: every service setting with its flag, environment variable and
default, as this process sees them (`--markdown`: the reference table of the docs)."""

from __future__ import annotations

import argparse

from specdec.settings import GROUPS, SETTINGS, markdown_table


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "settings", help="list every service setting, its environment variable and default")
    parser.add_argument("--markdown", action="store_true",
                        help="print the reference table (docs/configuration.md's source)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.markdown:
        print(markdown_table(), end="")
        return 0
    for group in GROUPS:
        print(f"{group}:")
        for setting in (s for s in SETTINGS.values() if s.group == group):
            value = setting.from_env()
            source = "environment" if value != setting.default else "default"
            print(f"  {setting.env:<32} {value!r:<28} ({source})")
    return 0
