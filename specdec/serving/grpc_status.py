"""specdec.errors <-> gRPC status codes, both directions, via each class's `.code`."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import grpc

from specdec.errors import SpecdecError

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])


def _error_classes() -> dict[str, type[SpecdecError]]:
    classes: dict[str, type[SpecdecError]] = {}
    pending: list[type[SpecdecError]] = [SpecdecError]
    while pending:
        cls = pending.pop()
        classes.setdefault(cls.code, cls)
        pending.extend(cls.__subclasses__())
    return classes


def status_code(error: SpecdecError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, error.code, grpc.StatusCode.INTERNAL)


def abort(context: grpc.ServicerContext, error: SpecdecError) -> NoReturn:
    context.abort(status_code(error), str(error))
    raise AssertionError("context.abort returns only by raising")  # pragma: no cover


def from_rpc_error(error: grpc.RpcError, where: str) -> SpecdecError:
    """The specdec error a failed call stands for; `where` names the peer in messages."""
    code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = error.details() if isinstance(error, grpc.Call) else str(error)
    cls = _error_classes().get(code.name, SpecdecError)
    result = cls(f"{where}: {details}")
    result.grpc_code = code  # type: ignore[attr-defined]
    return result


def rpc_errors(method: F) -> F:
    """Servicer method decorator: SpecdecError -> its status, anything else -> INTERNAL."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except SpecdecError as error:
            abort(context, error)
        except Exception as error:
            if context.code() is not None:  # type: ignore[attr-defined]
                raise  # raised by context.abort: the status is already set
            log.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")

    return wrapper  # type: ignore[return-value]
