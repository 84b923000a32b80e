"""The per-call wrapper of every OMA method handler: it authorizes, installs trace and role
context, tracks the call for graceful shutdown, and turns exceptions into statuses.

Handlers are wrapped once, when a service registers itself (`Registrar` stands in for the
server in the generated `add_*Servicer_to_server`), rather than by a gRPC interceptor on
every call: the wrapper is then the only per-call cost. Health and reflection are
registered on the server directly and never wrapped ([COMMON-AUTH-002]). Response streams
are always driven by the wrapper itself with `context.write`, so every await of a stream — in the servicer's generator or in the write —
happens inside the wrapper, which is what lets shutdown end an open stream with a proper
`UNAVAILABLE` status instead of a bare cancellation.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import uuid
from collections.abc import Callable, Sequence
from types import CoroutineType
from typing import Any

import grpc
from grpc import aio

from oma.runtime import auth, trace
from oma.runtime.errors import OmaError, shutting_down_error

logger = logging.getLogger("oma.runtime")


class CallTracker:
    """Calls in flight on one server (by task), and its shutdown state.

    Calls are split by whether their response is a stream: shutdown waits for the others
    (unary responses) and ends the streams.
    """

    def __init__(self) -> None:
        self.shutting_down = asyncio.Event()
        self._calls: dict[asyncio.Task[Any], tuple[bool, bool]] = {}  # → (streaming, aborted)
        self._open = {False: 0, True: 0}
        self._idle = {False: asyncio.Event(), True: asyncio.Event()}
        for event in self._idle.values():
            event.set()

    def started(self, task: asyncio.Task[Any], streaming: bool) -> None:
        self._calls[task] = (streaming, False)
        self._open[streaming] += 1
        self._idle[streaming].clear()

    def finished(self, task: asyncio.Task[Any]) -> None:
        record = self._calls.pop(task, None)
        if record is None:
            return
        streaming = record[0]
        self._open[streaming] -= 1
        if self._open[streaming] == 0:
            self._idle[streaming].set()

    async def wait_idle(self, streaming: bool) -> None:
        await self._idle[streaming].wait()

    def aborted(self, task: asyncio.Task[Any]) -> bool:
        """Whether shutdown cancelled this call (as opposed to its client going away)."""
        return self._calls.get(task, (False, False))[1]

    def abort(self, streaming: bool) -> int:
        """Cancel the handlers of open calls of one kind; each ends with UNAVAILABLE."""
        count = 0
        for task, (kind, aborted) in list(self._calls.items()):
            if kind == streaming and not aborted and not task.done():
                self._calls[task] = (kind, True)
                task.cancel()
                count += 1
        return count


_current_tracker: contextvars.ContextVar[CallTracker | None] = contextvars.ContextVar(
    "oma_current_server", default=None
)


def current_tracker() -> CallTracker | None:
    return _current_tracker.get()


def _bearer(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


def authorize(rule: auth.MethodRule, header: str | None, tokens: auth.TokenTable) -> str | None:
    """The caller's role, or an `OmaError` saying exactly what is wrong."""
    token: str | None = None
    if header is not None:
        scheme, _, rest = header.strip().partition(" ")
        if scheme.lower() == "bearer" and rest.strip():
            token = rest.strip()
    if rule.request_authenticated:
        # The request carries its own credential; a bearer token is optional context.
        return tokens.role_of(token) if token is not None else None
    accepted = rule.accepted()
    if header is None:
        raise OmaError(
            grpc.StatusCode.UNAUTHENTICATED,
            "TOKEN_MISSING",
            f"{rule.method} needs a bearer token: send metadata "
            f"'authorization: Bearer <token>' with a token of a role it accepts ({accepted})",
        )
    if token is None:
        raise OmaError(
            grpc.StatusCode.UNAUTHENTICATED,
            "TOKEN_INVALID",
            f"{rule.method}: the authorization metadata must read 'Bearer <token>'",
        )
    role = tokens.role_of(token)
    if role is None:
        raise OmaError(
            grpc.StatusCode.UNAUTHENTICATED,
            "TOKEN_INVALID",
            f"{rule.method}: the bearer token is not one this server knows; use a token "
            f"of a role it accepts ({accepted}) from this server's token file",
        )
    if not rule.allows(role):
        raise OmaError(
            grpc.StatusCode.PERMISSION_DENIED,
            "ROLE_FORBIDDEN",
            f"role '{role}' may not call {rule.method}; roles accepted: {accepted}",
        )
    return role


async def _abort(context: aio.ServicerContext[Any, Any], error: OmaError) -> None:
    await context.abort(error.code, error.message, trailing_metadata=error.trailing_metadata())


async def _abort_internal(context: aio.ServicerContext[Any, Any], method: str) -> None:
    error_id = uuid.uuid4().hex[:16]
    ctx = trace.current()
    logger.exception(
        "internal error %s in %s (trace %s)", error_id, method, ctx.trace_id if ctx else "-"
    )
    await _abort(
        context,
        OmaError(
            grpc.StatusCode.INTERNAL,
            "INTERNAL",
            f"internal server error in {method} (error id {error_id}); the server log has "
            "the details under that id",
            {"error_id": error_id},
        ),
    )


async def _abort_unimplemented(context: aio.ServicerContext[Any, Any], method: str) -> None:
    await context.abort(
        grpc.StatusCode.UNIMPLEMENTED, f"{method} is not implemented by this server"
    )


Behavior = Callable[..., Any]


class HandlerWrapper:
    """Wraps method handlers of one server with auth, context, tracking and error mapping."""

    def __init__(self, tokens: auth.TokenTable, tracker: CallTracker) -> None:
        self._tokens = tokens
        self._tracker = tracker

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        rule = auth.method_rule(method)
        if handler.response_streaming:
            if handler.request_streaming:
                wrapped = self._wrap(handler.stream_stream, rule, streaming=True)
                return grpc.stream_stream_rpc_method_handler(
                    wrapped, handler.request_deserializer, handler.response_serializer
                )
            wrapped = self._wrap(handler.unary_stream, rule, streaming=True)
            return grpc.unary_stream_rpc_method_handler(
                wrapped, handler.request_deserializer, handler.response_serializer
            )
        if handler.request_streaming:
            wrapped = self._wrap(handler.stream_unary, rule, streaming=False)
            return grpc.stream_unary_rpc_method_handler(
                wrapped, handler.request_deserializer, handler.response_serializer
            )
        wrapped = self._wrap(handler.unary_unary, rule, streaming=False)
        return grpc.unary_unary_rpc_method_handler(
            wrapped, handler.request_deserializer, handler.response_serializer
        )

    def _enter(self, rule: auth.MethodRule, context: aio.ServicerContext[Any, Any]) -> None:
        """Refuse the call while shutting down or when unauthorized; else set call context."""
        metadata = context.invocation_metadata()
        _current_tracker.set(self._tracker)
        trace.set_current(trace.from_metadata(metadata) or trace.TraceContext.new())
        if self._tracker.shutting_down.is_set():
            raise shutting_down_error()
        role = authorize(rule, _bearer(metadata), self._tokens)
        auth._current_role.set(role)

    def _wrap(self, handler: Behavior | None, rule: auth.MethodRule, streaming: bool) -> Behavior:
        if handler is None:
            raise RuntimeError(f"no handler behavior for {rule.method}")
        behavior: Behavior = handler
        tracker = self._tracker

        async def handle(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
            # Each RPC runs in its own task with a copied context, so the contextvars set
            # here are private to the call and need no reset.
            task = asyncio.current_task()
            assert task is not None
            tracker.started(task, streaming)
            result: Any = None
            try:
                self._enter(rule, context)
                result = behavior(request, context)
                if not streaming:
                    # Exact type first: `inspect.isawaitable` goes through an ABC check.
                    if type(result) is CoroutineType or inspect.isawaitable(result):
                        return await result
                    return result
                await _drive(result, context)
                if tracker.aborted(task):
                    # The handler swallowed the cancellation: its stream is still cut short.
                    raise shutting_down_error()
                return None
            except OmaError as error:
                await _abort(context, error)
            except NotImplementedError:
                await _abort_unimplemented(context, rule.method)
            except aio.AbortError:
                raise
            except asyncio.CancelledError:
                if not tracker.aborted(task):
                    raise  # the client went away, or the server is being torn down
                task.uncancel()
                await _abort(context, shutting_down_error())
            except Exception:
                await _abort_internal(context, rule.method)
            finally:
                tracker.finished(task)
                aclose = getattr(result, "aclose", None) if streaming else None
                if aclose is not None:
                    try:
                        await aclose()
                    except Exception:
                        logger.debug("closing the response stream of %s failed", rule.method)

        return handle


async def _drive(responses: Any, context: aio.ServicerContext[Any, Any]) -> None:
    """Send a handler's responses with `context.write`, whatever style it was written in
    (async generator, coroutine using `context.write` itself, or a plain iterable)."""
    if hasattr(responses, "__aiter__"):
        async for response in responses:
            await context.write(response)
    elif inspect.isawaitable(responses):
        await responses
    elif responses is not None:
        for response in responses:
            await context.write(response)


class _WrappedGeneric(grpc.GenericRpcHandler):
    """A generic handler whose method handlers come out wrapped (once per method)."""

    def __init__(self, inner: grpc.GenericRpcHandler, wrapper: HandlerWrapper) -> None:
        self._inner = inner
        self._wrapper = wrapper
        self._cache: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        cached = self._cache.get(method)
        if cached is None or cached[0] is not handler:
            cached = (handler, self._wrapper.wrap(method, handler))
            self._cache[method] = cached
        return cached[1]


class Registrar:
    """Stands in for the `grpc.aio.Server` given to a generated `add_*Servicer_to_server`
    function, so that every method handler it registers is wrapped."""

    def __init__(self, server: aio.Server, wrapper: HandlerWrapper) -> None:
        self._server = server
        self._wrapper = wrapper

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(
            tuple(_WrappedGeneric(handler, self._wrapper) for handler in handlers)
        )

    def add_registered_method_handlers(
        self, service_name: str, method_handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        wrapped = {
            name: self._wrapper.wrap(f"/{service_name}/{name}", handler)
            for name, handler in method_handlers.items()
        }
        self._server.add_registered_method_handlers(service_name, wrapped)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)
