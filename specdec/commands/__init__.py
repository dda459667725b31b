"""Subcommands of the `specdec` CLI: each module here defines add_parser(subparsers)."""
