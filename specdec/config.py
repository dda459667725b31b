"""Flags and SPECDEC_* environment variables: one name per setting, everywhere.

The settings themselves, with their defaults, live in specdec.settings; this module adds
them to parsers and reads the draft's derived choices. It imports no torch.
"""

from __future__ import annotations

import argparse
from typing import Any

from specdec.settings import (
    ADDRESS_SETTINGS,
    DEFAULT_PORTS,
    MODEL_SETTINGS,
    SECURITY_SETTINGS,
    SERVICE_SETTINGS,
    TELEMETRY_SETTINGS,
    add_setting,
    add_settings,
    default,
    draft_dtype_for,
    env_name,
    linear_kernel_for,
)

__all__ = ["DEFAULT_HOST", "DEFAULT_PORTS", "ROLES", "add_model_settings", "add_serve_arguments",
           "add_service_settings", "add_setting", "draft_compile", "draft_precision",
           "env_name", "serve_parser"]


def add_model_settings(parser: argparse.ArgumentParser,
                       roles: tuple[str, ...] = ("target", "draft")) -> None:
    """The model settings of the given roles (a target-only service takes no draft's)."""
    names = [name for name in MODEL_SETTINGS
             if "draft" in roles or not name.startswith("draft-")]
    if "target" not in roles:
        names.remove("target-model")
    add_settings(parser, names)


def draft_compile(args: argparse.Namespace | Any) -> str:
    return getattr(args, "draft_compile", "") or "auto"


def draft_precision(args: argparse.Namespace | Any) -> tuple[str, str]:
    """The draft's dtype setting ("auto" or a dtype) and linear kernel: its own settings,
    else the shared ones (args: flags, or anything with the same attributes)."""
    return (draft_dtype_for(getattr(args, "draft_dtype", ""), args.dtype),
            getattr(args, "draft_linear_kernel", "")
            or linear_kernel_for(args.dtype, args.linear_kernel))


def apply_torch_settings(args: argparse.Namespace) -> tuple[Any, Any]:
    """The device and dtype the flags name, after the backend's process settings."""
    from specdec.engine.backends import select_backend

    backend = select_backend(args)
    backend.configure_process()
    return backend.device, backend.dtype


# `specdec serve`'s flags, here so that code serving a role elsewhere (Ray replicas,
# `specdec up`) reads them without importing a command.
ROLES = ("coordinator", "draft", "target")
DEFAULT_HOST: str = default("host")


def add_service_settings(parser: argparse.ArgumentParser) -> None:
    """Settings every role accepts, so `specdec up` can pass one set to all three."""
    add_settings(parser, SERVICE_SETTINGS)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("role", choices=ROLES, help="which service")
    add_settings(parser, ADDRESS_SETTINGS)
    add_service_settings(parser)
    # Not in add_service_settings: `up` hands them over in the environment, and one
    # --health-port cannot serve all three.
    add_settings(parser, SECURITY_SETTINGS)
    # Not in add_service_settings: `up` must not hand one metrics port to all three.
    add_settings(parser, TELEMETRY_SETTINGS)


def serve_parser() -> argparse.ArgumentParser:
    """`specdec serve`'s flags on their own (for services started in other processes)."""
    parser = argparse.ArgumentParser(prog="specdec serve")
    add_serve_arguments(parser)
    return parser
