"""The thin gRPC layer every Podium process shares: servers, channels, auth, errors.

- :func:`make_server` builds a ``grpc.aio`` server with the token check (and TLS)
  in front of every handler and the standard ``grpc.health.v1`` service.
- :func:`make_channel` builds a ``grpc.aio`` channel that presents the token.
- :func:`handle_errors` wraps servicer methods so a raised :mod:`podium.errors`
  exception becomes its status code plus an ``ErrorInfo`` trailer, and
  :func:`error_from_rpc` turns that back into the same exception on the client.
- :func:`use_uvloop` installs uvloop where it is available.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from podium import errors
from podium.auth import TOKEN_METADATA_KEY, TlsConfig, bearer, token_from_metadata, token_matches
from podium.v1 import common_pb2

log = logging.getLogger(__name__)

#: Binary trailing-metadata key carrying a serialized podium.v1.ErrorInfo.
ERROR_METADATA_KEY = "podium-error-bin"

#: Largest single gRPC message. Payloads are chunked far below this (podium.transport.chunks);
#: the limit only bounds what a misbehaving peer can make us buffer.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

#: What a server allows one connection (see _SERVER_OPTIONS): the handshake deadline, the
#: idle time before an unused connection is closed, and the streams running at once.
SERVER_HANDSHAKE_MS = 5_000
MAX_CONNECTION_IDLE_MS = 120_000
MAX_CONCURRENT_STREAMS = 1_024

_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Detect a dead peer on an idle long-lived stream within seconds, not hours.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Reconnect to a restarted peer (a scheduler back on its port) within ~2 s. gRPC's
    # default backoff grows to 120 s, during which every call fails at once: a controller
    # could not reach a scheduler that was down for a minute until long after it is back,
    # and its session lease could run out meanwhile.
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    # gRPC also takes the minimum backoff as the time a connection attempt may take until
    # the peer's HTTP/2 SETTINGS arrive. At 250 ms, 128 workers starting at once on 2 cores
    # failed the controller's first Describe with "connection attempt timed out before
    # receiving SETTINGS frame"; a refused connection (peer down) is not affected by this.
    ("grpc.min_reconnect_backoff_ms", 20_000),
    # gRPC shares connections (subchannels) between channels to the same address. Worker
    # ports are reused: a new worker can get the port of one that just exited, and a
    # shared subchannel still backing off from the dead one failed the new worker's first
    # call with "Connection refused". Each channel keeps its own connections.
    ("grpc.use_local_subchannel_pool", 1),
]
_SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    # One port per server, never shared with a stale process of another run.
    ("grpc.so_reuseport", 0),
    # Connections a client with no token can hold (issue #34). A TCP connection that has not
    # finished the HTTP/2 (or TLS) handshake within 5 s is closed: gRPC's default is 120 s,
    # long enough for a few hundred never-speaking sockets to exhaust the descriptors.
    ("grpc.server_handshake_timeout_ms", SERVER_HANDSHAKE_MS),
    # A connection with no call in flight for 2 minutes gets a GOAWAY; a client's channel
    # reconnects on its next call, so only connections nobody uses are reclaimed.
    ("grpc.max_connection_idle_ms", MAX_CONNECTION_IDLE_MS),
    # Streams one connection may run at once (a controller calls 128 workers over one
    # channel each; the scheduler's clients run a few calls at a time).
    ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS),
    # No grpc.max_connection_age: every server carries a stream as long-lived as the job (the
    # scheduler the agents' HeartbeatStream, a worker its Calls stream, an agent a followed
    # TailLog), which an age limit would cut however long its grace.
]


def use_uvloop() -> None:
    """Make new event loops uvloop loops (a no-op where uvloop is missing)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


# ---------------------------------------------------------------- errors

def status_code_of(exc: BaseException) -> grpc.StatusCode:
    """The grpc.StatusCode an exception travels as."""
    return grpc.StatusCode[errors.status_name_of(exc)]


def error_info_of(exc: BaseException) -> common_pb2.ErrorInfo:
    """The ErrorInfo message describing an exception."""
    return common_pb2.ErrorInfo(**errors.error_fields(exc))


def error_from_info(info: common_pb2.ErrorInfo, status_name: str = "UNKNOWN") -> errors.PodiumError:
    """Rebuild the exception an ErrorInfo describes."""
    return errors.error_from_fields(info.type, info.message, traceback=info.traceback,
                                    rank=info.rank, node=info.node, details=dict(info.details),
                                    status_name=status_name)


def error_from_rpc(exc: grpc.RpcError, *, what: str = "") -> errors.PodiumError:
    """Turn a failed RPC into the PodiumError the server raised (or the closest class).

    ``what`` names the peer or operation, to make transport errors actionable.
    """
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for item in trailing or ():
        key, value = (item.key, item.value) if hasattr(item, "key") else item
        if key == ERROR_METADATA_KEY:
            info = common_pb2.ErrorInfo()
            try:
                info.ParseFromString(value)
            except Exception:  # a corrupt trailer still leaves the status code
                break
            return error_from_info(info, code.name)
    cls = errors.CLASS_OF_STATUS.get(code.name, errors.PodiumError)
    prefix = f"{what}: " if what else ""
    return cls(f"{prefix}{details or code.name}")


def _trailer(exc: BaseException):
    return ((ERROR_METADATA_KEY, error_info_of(exc).SerializeToString()),)


async def abort(context: grpc.aio.ServicerContext, exc: BaseException):
    """Fail the current RPC with the status and ErrorInfo of ``exc``."""
    context.set_trailing_metadata(_trailer(exc))
    await context.abort(status_code_of(exc), str(exc)[:4000])


def _as_podium_error(exc: Exception, method) -> errors.PodiumError:
    """A PodiumError stays itself; anything else is a bug, logged and sent as INTERNAL."""
    if isinstance(exc, errors.PodiumError):
        return exc
    log.exception("internal error in %s", method.__qualname__)
    return errors.InternalError(f"{method.__name__}: {type(exc).__name__}: {exc}")


def handle_errors(method):
    """Decorator for async servicer methods (unary or streaming responses).

    PodiumErrors become their status; anything else is a bug: logged with its
    traceback and sent as INTERNAL, so the service keeps serving.
    """
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream_wrapper(self, request, context):
            try:
                async for item in method(self, request, context):
                    yield item
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as exc:  # noqa: BLE001 - see _as_podium_error
                await abort(context, _as_podium_error(exc, method))
        return stream_wrapper

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - see _as_podium_error
            await abort(context, _as_podium_error(exc, method))
    return wrapper


# ---------------------------------------------------------------- auth

def _unauthenticated_handler(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that only fails UNAUTHENTICATED.

    It never reads the request, so unauthenticated bytes are never unpickled.
    """
    exc = errors.AuthenticationError("missing or wrong cluster token")

    async def deny(request_or_iterator, context):
        await abort(context, exc)

    async def deny_stream(request_or_iterator, context):
        await abort(context, exc)
        yield  # pragma: no cover - makes this an async generator

    if handler is None:
        return grpc.unary_unary_rpc_method_handler(deny)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream)
    return grpc.unary_unary_rpc_method_handler(deny)


class MalformedMessage:
    """What a request message that does not parse arrives as, instead of grpc's UNKNOWN.

    Unary requests never reach a handler this way (the call fails INVALID_ARGUMENT
    first); a handler reading a request *stream* (``context.read()`` or the iterator)
    must check for it and ``await abort(context, item.error)``.
    """

    __slots__ = ("error",)

    def __init__(self, error: errors.InvalidArgumentError) -> None:
        self.error = error


def _lenient(deserialize):
    """``deserialize`` that returns a MalformedMessage instead of raising inside grpc."""
    owner = getattr(deserialize, "__self__", None)
    what = getattr(getattr(owner, "DESCRIPTOR", None), "full_name", "") or "request"

    def parse(raw: bytes):
        try:
            return deserialize(raw)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the peer's bad bytes
            return MalformedMessage(errors.InvalidArgumentError(
                f"malformed {what} ({len(raw)} bytes): {exc}"))
    return parse


def _parsing_handler(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
    """``handler`` with request parsing failures turned into INVALID_ARGUMENT.

    grpc.aio answers bytes its deserializer rejects with UNKNOWN "Unexpected
    DecodeError" and logs a traceback; a peer's garbage is its error, not ours.
    """
    if handler is None or handler.request_deserializer is None:
        return handler
    parse = _lenient(handler.request_deserializer)
    if handler.request_streaming:  # the reader checks each item (see MalformedMessage)
        return handler._replace(request_deserializer=parse)
    options = dict(request_deserializer=parse, response_serializer=handler.response_serializer)
    if handler.response_streaming:
        inner = handler.unary_stream

        async def stream_behavior(request, context):
            if isinstance(request, MalformedMessage):
                await abort(context, request.error)
            result = inner(request, context)
            if hasattr(result, "__aiter__"):
                async for item in result:
                    yield item
            elif inspect.isawaitable(result):  # the context.write() style
                await result
            else:
                for item in result:
                    yield item
        return grpc.unary_stream_rpc_method_handler(stream_behavior, **options)
    inner = handler.unary_unary

    async def behavior(request, context):
        if isinstance(request, MalformedMessage):
            await abort(context, request.error)
        result = inner(request, context)
        return await result if inspect.isawaitable(result) else result
    return grpc.unary_unary_rpc_method_handler(behavior, **options)


class TokenServerInterceptor(grpc.aio.ServerInterceptor):
    """Rejects every call that does not present the cluster token (constant-time check),
    before its request is parsed; answers unparsable requests INVALID_ARGUMENT."""

    def __init__(self, token: str) -> None:
        self._token = token
        # method path -> (its handler, the parsing wrapper of it): built once, not per call.
        self._parsing: dict[str, tuple] = {}

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if token_matches(self._token, token_from_metadata(handler_call_details.invocation_metadata)):
            cached = self._parsing.get(handler_call_details.method)
            if cached is None or cached[0] is not handler:
                cached = (handler, _parsing_handler(handler))
                if handler is not None:
                    self._parsing[handler_call_details.method] = cached
            return cached[1]
        return _unauthenticated_handler(handler)


class _TokenAdder:
    """Adds the token to an outgoing call's metadata."""

    def __init__(self, token: str) -> None:
        self._pair = (TOKEN_METADATA_KEY, bearer(token))

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = list(details.metadata or ())
        metadata.append(self._pair)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                          details.credentials, details.wait_for_ready)


# grpc.aio files each interceptor under the FIRST interceptor type it is an instance of
# (an if/elif chain), so one class per call shape, not one class for all four.
class _UnaryUnaryToken(_TokenAdder, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _UnaryStreamToken(_TokenAdder, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _StreamUnaryToken(_TokenAdder, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStreamToken(_TokenAdder, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def _token_interceptors(token: str) -> list:
    return [cls(token) for cls in (_UnaryUnaryToken, _UnaryStreamToken, _StreamUnaryToken,
                                   _StreamStreamToken)]


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Metadata to pass explicitly on a call (for sync stubs and hot paths)."""
    return ((TOKEN_METADATA_KEY, bearer(token)),)


# ---------------------------------------------------------------- servers and channels

def make_server(token: str, *, interceptors=(), health_service: bool = True
                ) -> tuple[grpc.aio.Server, health.aio.HealthServicer | None]:
    """A grpc.aio server that checks the token on every call.

    Returns the server and its health servicer (SERVING for "" once you call
    ``set("", SERVING)``; :func:`start_server` does that).
    """
    server = grpc.aio.server(interceptors=[TokenServerInterceptor(token), *interceptors],
                             options=_SERVER_OPTIONS)
    servicer = None
    if health_service:
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return server, servicer


def bind(server: grpc.aio.Server, host: str, port: int, tls: TlsConfig | None = None) -> int:
    """Bind ``host:port`` (port 0 picks a free one) and return the bound port."""
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        if tls is not None:
            bound = server.add_secure_port(target, tls.server_credentials())
        else:
            bound = server.add_insecure_port(target)
    except RuntimeError as exc:  # grpcio >= 1.60 raises instead of returning 0
        raise errors.UnavailableError(f"cannot bind {target}: {exc}") from exc
    if not bound:
        raise errors.UnavailableError(f"cannot bind {target}")
    return bound


async def start_server(server: grpc.aio.Server, health_servicer=None) -> None:
    """Start serving and report SERVING on the health service."""
    await server.start()
    if health_servicer is not None:
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)


def make_channel(address: str, token: str, tls: TlsConfig | None = None, *,
                 add_token: bool = True,
                 extra_options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """A grpc.aio channel to ``address`` ("host:port") that presents the token on every call.

    Hot paths may pass ``add_token=False`` and send :func:`token_metadata` themselves:
    grpc.aio's interceptor wrappers add a little to every message of a stream.
    ``extra_options`` are more gRPC channel arguments (e.g. a local subchannel pool).
    """
    interceptors = _token_interceptors(token) if add_token else None
    options = [*_CHANNEL_OPTIONS, *extra_options]
    if tls is not None:
        if tls.server_name:
            options.append(("grpc.ssl_target_name_override", tls.server_name))
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options,
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


def make_sync_channel(address: str, tls: TlsConfig | None = None) -> grpc.Channel:
    """A blocking channel (for the CLI and tests); pass :func:`token_metadata` per call."""
    if tls is not None:
        options = list(_CHANNEL_OPTIONS)
        if tls.server_name:
            options.append(("grpc.ssl_target_name_override", tls.server_name))
        return grpc.secure_channel(address, tls.channel_credentials(), options=options)
    return grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
