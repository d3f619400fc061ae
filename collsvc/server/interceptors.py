"""The two choke points every Coordinator call passes: the token check and the error translation.

- :class:`TokenCheckedHandlers` compares ``authorization: Bearer <token>`` in constant time before the
  request body is deserialized: a refused call is answered by a handler without a deserializer.
- :func:`translate_errors` turns what the state classes raise into a gRPC status plus the
  ``collsvc-error-reason`` / ``collsvc-error-details`` trailing metadata that
  :func:`collsvc.errors.error_from_rpc` maps back to the same exception on the client.
"""

from __future__ import annotations

import functools
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias, TypeVar

import grpc
from google.protobuf.message import DecodeError

from collsvc.errors import (
    DETAILS_METADATA_KEY,
    REASON_METADATA_KEY,
    CollsvcError,
    Reason,
    ResourceLimitError,
    error_details,
    reason_for,
    status_for,
)
from collsvc.server.request_limits import RequestLimits
from collsvc.server.state.common import NotFoundError

log = logging.getLogger(__name__)

UNAUTHENTICATED_MESSAGE = "authentication failed: missing or wrong token (expected 'authorization: Bearer <token>')"

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
_Method = TypeVar("_Method", bound=Callable[..., Awaitable[Any]])


def describe_error(exc: BaseException) -> tuple[grpc.StatusCode, str, str]:
    """``(status code, reason name, details JSON)`` for an exception raised while serving a call."""
    if isinstance(exc, CollsvcError):
        reason = reason_for(exc)
        details = json.dumps(error_details(exc))
    elif isinstance(exc, NotFoundError):
        reason, details = Reason.ERROR_REASON_NOT_FOUND, "{}"
    elif isinstance(exc, (ValueError, TypeError, DecodeError)):
        reason, details = Reason.ERROR_REASON_INVALID_ARGUMENT, "{}"
    else:
        return grpc.StatusCode.INTERNAL, "ERROR_REASON_UNSPECIFIED", "{}"
    return status_for(reason), Reason.Name(reason), details


async def abort_with(context: Context, exc: BaseException) -> NoReturn:
    """Ends the call with the status, reason and details that stand for ``exc``."""
    code, reason, details = describe_error(exc)
    context.set_trailing_metadata(((REASON_METADATA_KEY, reason), (DETAILS_METADATA_KEY, details)))
    message = str(exc) if code != grpc.StatusCode.INTERNAL else f"internal coordinator error: {exc!r}"
    await context.abort(code, message)


class MalformedRequest:
    """Stands in for a request body that is not valid protobuf.

    gRPC answers a deserializer that raises with UNKNOWN and logs a traceback for every such request
    (found by fuzzing: a flood of garbage became a flood of tracebacks); :func:`lenient_deserializer`
    returns this instead, and :func:`translate_errors` refuses it as INVALID_ARGUMENT.
    """

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


class RefusedRequest:
    """Stands in for a request over a size limit (see :mod:`collsvc.server.request_limits`);
    :func:`translate_errors` raises its error, so the call ends RESOURCE_EXHAUSTED naming the limit."""

    __slots__ = ("error",)

    def __init__(self, error: ResourceLimitError) -> None:
        self.error = error


def checked_parse(message_cls: Any, data: bytes, limits: RequestLimits | None) -> Any:
    """Parses ``data`` as ``message_cls`` after checking its size, then checks every field.

    Raises:
        ResourceLimitError: the message or one of its fields is over its limit.
        DecodeError: the bytes do not parse.
    """
    if limits is not None:
        limits.check_size(message_cls.DESCRIPTOR, len(data))  # before parsing: no copy of a refused body
    message = message_cls.FromString(data)
    if limits is not None and limits.may_exceed(len(data)):
        limits.check_fields(message)
    return message


def lenient_deserializer(message_cls: Any, limits: RequestLimits | None = None) -> Callable[[bytes], Any]:
    """``message_cls.FromString`` that returns a :class:`MalformedRequest` for bytes that do not parse and
    a :class:`RefusedRequest` for a message over ``limits`` (checked by :func:`checked_parse`)."""

    def parse(data: bytes) -> Any:
        try:
            return checked_parse(message_cls, data, limits)
        except DecodeError as exc:
            return MalformedRequest(str(exc))
        except ResourceLimitError as exc:
            return RefusedRequest(exc)

    return parse


def stream_deserializer(message_cls: Any, limits: RequestLimits | None = None) -> Callable[[bytes], Any]:
    """:func:`checked_parse` for the messages of a stream: its errors reach the servicer's
    ``context.read()``, which :func:`translate_errors` turns into the call's status."""

    def parse(data: bytes) -> Any:
        return checked_parse(message_cls, data, limits)

    return parse


def translate_errors(method: _Method) -> _Method:
    """Decorates a servicer coroutine ``(self, request, context)`` so that errors become statuses.

    CollsvcError subclasses keep their reason; NotFoundError becomes NOT_FOUND and ValueError or
    TypeError INVALID_ARGUMENT; anything else is logged and answered with INTERNAL.
    """

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: Context) -> Any:
        try:
            if isinstance(request, MalformedRequest):
                raise ValueError(f"malformed request: {request.error}")
            if isinstance(request, RefusedRequest):
                raise request.error
            return await method(self, request, context)
        # DecodeError: a malformed message read from a stream (Watch) by context.read().
        except (CollsvcError, NotFoundError, ValueError, TypeError, DecodeError) as exc:
            log.debug("%s failed: %s", method.__name__, exc)
            await abort_with(context, exc)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            log.exception("%s: unexpected error", method.__name__)
            await abort_with(context, exc)

    return wrapper  # type: ignore[return-value]


async def _deny(context: Context) -> NoReturn:
    context.set_trailing_metadata(
        ((REASON_METADATA_KEY, Reason.Name(Reason.ERROR_REASON_AUTHENTICATION)), (DETAILS_METADATA_KEY, "{}"))
    )
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)


async def _deny_unary(request: Any, context: Context) -> NoReturn:
    await _deny(context)


def _deny_handler(handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    # No request_deserializer: the refused body stays raw bytes and is never parsed.
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_deny_unary)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_deny_unary)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_deny_unary)
    return grpc.unary_unary_rpc_method_handler(_deny_unary)


if TYPE_CHECKING:
    _HandlersBase = grpc.GenericRpcHandler[Any, Any]
else:  # the runtime class is not generic
    _HandlersBase = grpc.GenericRpcHandler


class TokenCheckedHandlers(_HandlersBase):
    """Wraps the Coordinator's method handlers: a call without ``authorization: Bearer <token>`` gets
    a handler that refuses it (UNAUTHENTICATED) without parsing its body.

    The check runs where gRPC looks up the handler for a new call, synchronously: an asyncio server
    interceptor would cost a coroutine chain per call (measured: 20-40 us of the coordinator's CPU
    per call, about a tenth of a rendezvous). Other services (the standard health service) are
    registered beside this one, unwrapped, so load balancers and ``collsvc health`` can probe
    without the secret.

    Args:
        handlers: the Coordinator's generic handler.
        token: the shared secret every call must present.
    """

    def __init__(self, handlers: grpc.GenericRpcHandler[Any, Any], token: str) -> None:
        self._handlers = handlers
        self._expected = f"Bearer {token}".encode()

    def _authorized(self, metadata: Any) -> bool:
        presented = b""
        for key, value in metadata or ():
            if key == "authorization":
                presented = value.encode() if isinstance(value, str) else bytes(value)
                break
        # Compare even when nothing was presented, so timing says nothing about the token.
        return hmac.compare_digest(presented, self._expected) and bool(presented)

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = self._handlers.service(handler_call_details)
        if handler is None or self._authorized(handler_call_details.invocation_metadata):
            return handler
        log.warning("refused %s: missing or wrong token", handler_call_details.method)
        return _deny_handler(handler)
