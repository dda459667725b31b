"""`specdec` console script: one subcommand per module in specdec.commands.

Only the module of the command being run is imported: the others are listed from their
source (the `help=` of their `add_parser` call), so `specdec --help`, `generate` and
`traces` start without importing torch or transformers.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import logging
import pkgutil
import sys
from pathlib import Path

from specdec import commands
from specdec.serving.stack import die_with_parent


def command_modules() -> dict[str, str]:
    """Command name -> module name, from each module's `add_parser` call (no import)."""
    return {command_info(info.name)[0]: info.name
            for info in pkgutil.iter_modules(commands.__path__)
            if not info.name.startswith("_")}


def command_info(module: str) -> tuple[str, str]:
    """The name and `help=` a command module gives its subparser, read from its source
    (no import); the module name and its docstring's first line where it does not say."""
    source = Path(commands.__path__[0], f"{module}.py").read_text(encoding="utf-8")
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_parser" \
                and node.args and isinstance(node.args[0], ast.Constant):
            help_text = next((str(keyword.value.value) for keyword in node.keywords
                              if keyword.arg == "help"
                              and isinstance(keyword.value, ast.Constant)), "")
            return str(node.args[0].value), help_text
    docstring = (ast.get_docstring(tree) or "").strip()
    return module, docstring.splitlines()[0] if docstring else ""


def chosen_command(argv: list[str]) -> str | None:
    """The subcommand named in argv (the first argument not starting with '-')."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg if arg in command_modules() else None
    return None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser of `command` (its module imported); the others listed by name."""
    parser = argparse.ArgumentParser(
        prog="specdec", description="Exact speculative decoding as gRPC services.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in sorted(command_modules().items()):
        if name == command:
            module = importlib.import_module(f"{commands.__name__}.{module_name}")
            module.add_parser(subparsers)
        else:
            subparsers.add_parser(name, help=command_info(module_name)[1], add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    die_with_parent()  # a service started by `specdec up` stops when `up` does
    args = build_parser(chosen_command(argv)).parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return quiet_broken_pipe()
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        print(f"specdec {args.command}: error: {error}", file=sys.stderr)
        return 2


def quiet_broken_pipe() -> int:
    """The reader of stdout went away (`specdec traces --json | head`): exit quietly.

    stdout is pointed at /dev/null so the interpreter's final flush does not raise again.
    """
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
