"""`specdec prepare`: convert/locate the default models into the local cache."""

from __future__ import annotations

import argparse

from specdec.engine import models


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "prepare", help="convert the embedded target into the model cache (once)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    target = models.prepare_smollm2(progress=True)
    print(f"target: {target}")
    try:
        print(f"draft:  {models.resolve(models.DEFAULT_DRAFT)}")
    except FileNotFoundError as error:
        print(f"draft:  not available ({error})")
    return 0
