"""Failures the core can name precisely; the services map each to one gRPC status."""

from __future__ import annotations


class SpecdecError(Exception):
    """Base class; `code` is the grpc.StatusCode name the services answer with."""

    code = "INTERNAL"


class InvalidRequest(SpecdecError, ValueError):
    code = "INVALID_ARGUMENT"


class CacheSyncError(SpecdecError):
    """The service's KV cache does not hold the committed prefix the caller named."""

    code = "FAILED_PRECONDITION"


class KVBudgetExhausted(SpecdecError):
    code = "RESOURCE_EXHAUSTED"


class ServiceUnavailable(SpecdecError):
    code = "UNAVAILABLE"


class DeadlineExceeded(SpecdecError):
    """The request's deadline passed before a service answered its round."""

    code = "DEADLINE_EXCEEDED"
