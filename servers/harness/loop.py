"""One turn of a session: from unanswered input to `session.status_idle`.

`drive` is a loop over the log: run tool calls that wait for a result, else stop when the
model has answered or a budget is spent, else ask the model. Each step appends its events
under the lease with ids derived from what is already in the log (the seq the step starts
from, or the model's `tool_use` id), so a step retried after a lost acknowledgement or by a
successor harness writes nothing twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import anthropic

from oma.servers.harness import conversation, faults, tools
from oma.servers.harness import events as ev
from oma.servers.harness.context import ContextPolicy, LogSlices, SlidingWindowPolicy
from oma.servers.harness.events import Definition, LogEvent, NewEvent, ToolSpec
from oma.servers.harness.model import ModelFailure, ModelReply, ToolCall, stream_reply
from oma.servers.harness.ports import (
    Lease,
    McpConnection,
    McpPort,
    McpTool,
    McpUnavailable,
    SandboxGone,
    SandboxPort,
    SessionPort,
    ToolFailed,
    ToolOutput,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

SANDBOX_LOST = (
    "The sandbox running this tool was lost ({detail}); the command's effects, and files "
    "written earlier, may be gone. The next tool call runs in a fresh sandbox."
)


@dataclass(frozen=True)
class LoopConfig:
    max_model_retries: int = 3
    backoff_initial_seconds: float = 0.5
    backoff_max_seconds: float = 8.0
    # Applied when the session's definition sets no per-turn call budget, so that a model
    # that never stops calling tools cannot run a turn forever.
    default_max_model_calls_per_turn: int = 200
    # Ask the model API to cache the prompt prefix (top-level `cache_control`).
    prompt_caching: bool = True
    # What each model request holds when the conversation outgrows the model's context
    # (`context.py`); the loop makes no assumption about the model's context size.
    context: ContextPolicy = dataclasses.field(default_factory=SlidingWindowPolicy)


class Interrupted(Exception):
    """The user interrupted the turn (`user.interrupt`)."""


INTERRUPTED = "The user interrupted the turn before this call ran."

MCP_IN_FLIGHT = (
    "The harness driving this session stopped while this MCP call was in flight. The call "
    "may or may not have run on the MCP server, and its result is lost; it was not sent again "
    "because the server does not declare the tool read-only or idempotent. Check its effects "
    "before calling it again."
)


def _stored(event: NewEvent, seq: int) -> LogEvent:
    """How `event` reads back from the log once stored at `seq`."""
    return LogEvent(
        seq=seq,
        id=event.id,
        type=event.type,
        text=event.text,
        tool_use_id=event.tool_use_id,
        tool_name=event.tool_name,
        tool_input=event.tool_input,
        is_error=event.is_error,
        stop_reason=event.stop_reason,
        usage=event.usage,
        mcp_server=event.mcp_server,
        mcp_tool=event.mcp_tool,
    )


class Turn:
    """Drives one session under one lease until it is idle."""

    def __init__(
        self,
        session: SessionPort,
        sandbox: SandboxPort,
        model: anthropic.AsyncAnthropic,
        config: LoopConfig,
        lease: Lease,
        definition: Definition,
        log_events: Sequence[LogEvent],
        mcp: McpPort | None = None,
    ) -> None:
        self._session = session
        self._sandbox = sandbox
        self._model = model
        self._config = config
        self._lease = lease
        if not definition.max_model_calls_per_turn:
            definition = dataclasses.replace(
                definition, max_model_calls_per_turn=config.default_max_model_calls_per_turn
            )
        self._definition = definition
        self._log = list(log_events)
        # Events up to here were written before this turn started (by a predecessor, if any).
        self._start_seq = self.last_seq
        self._tools = tools.complete(definition.tools)
        self._specs = {spec.name: spec for spec in self._tools}
        self._api_tools = tools.to_api(self._tools)
        self._mcp_port = mcp
        self._mcp: McpConnection | None = None
        self._servers = {server.name: server for server in definition.mcp_servers}
        # Listed at the start of the turn, by the name the model sees.
        self._mcp_tools: dict[str, McpTool] = {}
        self._sandbox_id: str | None = None
        self._lost_sandbox = False
        self._interrupt = asyncio.Event()

    @property
    def session_id(self) -> str:
        return self._lease.session_id

    @property
    def lease(self) -> Lease:
        return self._lease

    @property
    def turn_id(self) -> str:
        """Names the session turn being driven, the same for every harness that drives it: a
        turn runs from the first user message after an idle to the next idle."""
        return f"turn-{conversation.turn_start(self._log)}"

    @property
    def last_seq(self) -> int:
        return self._log[-1].seq if self._log else 0

    async def _append(self, *batch: NewEvent) -> None:
        seqs = await self._session.append(self._lease, batch)
        if seqs == list(range(self.last_seq + 1, self.last_seq + 1 + len(batch))):
            # Nothing else was appended since our last read: the log is ours plus this batch.
            self._log.extend(_stored(event, seq) for event, seq in zip(batch, seqs, strict=True))
        else:
            # A client appended meanwhile (or this was a replayed batch): read what we missed.
            self._log.extend(await self._session.read_events(self.session_id, self.last_seq))

    async def run(self) -> str:
        """Run to idle; returns the stop reason written. Raises `LeaseLost` if fenced out."""
        await self._append(
            NewEvent(f"run.{self.last_seq}", ev.STATUS_RUNNING, turn_id=self.turn_id)
        )
        faults.reach("after_running")
        watcher = asyncio.create_task(self._watch_interrupts(self.last_seq))
        try:
            await self._list_mcp_tools()
            return await self._steps()
        except Interrupted:
            # No further call starts; calls already asked for get a result, so that every
            # tool_use keeps its tool_result and the next request stays valid.
            for tool_use in conversation.pending_tool_uses(self._log):
                await self._record(tool_use, ToolOutput(INTERRUPTED, True))
            return await self._idle(ev.STOP_END_TURN)
        finally:
            watcher.cancel()
            if self._mcp is not None:
                with contextlib.suppress(Exception):
                    await self._mcp.close()

    def _connect_mcp(self) -> McpConnection | None:
        if self._mcp is None and self._mcp_port is not None:
            self._mcp = self._mcp_port.connect(self.session_id, self._definition)
        return self._mcp

    async def _list_mcp_tools(self) -> None:
        """Offer the tools of the session's MCP servers to the model, as `<server>__<tool>`.
        A server that cannot be listed is named in a `session.error`; the turn goes on
        without its tools."""
        base = self.last_seq
        taken = {spec.name for spec in self._tools}
        offered: list[ToolSpec] = []
        for index, server in enumerate(self._definition.mcp_servers):
            self._check_interrupt()
            connection = self._connect_mcp()
            try:
                if connection is None:
                    raise McpUnavailable("this harness cannot reach MCP servers")
                listed = await self._interruptible(connection.list_tools(server))
            except McpUnavailable as error:
                log.warning("session %s: %s", self.session_id, error)
                await self._append(
                    NewEvent(
                        f"mcp{base}.error{index}",
                        ev.SESSION_ERROR,
                        turn_id=self.turn_id,
                        code="mcp_unavailable",
                        text=f"The tools of MCP server {server.name!r} are not offered in "
                        f"this turn: {error}",
                    )
                )
                continue
            for tool in listed:
                name = tools.mcp_tool_name(server.name, tool.name)
                if name in taken:
                    log.warning(
                        "session %s: MCP tool %s of %s hides behind another tool named %s",
                        self.session_id,
                        tool.name,
                        server.name,
                        name,
                    )
                    continue
                taken.add(name)
                self._mcp_tools[name] = tool
                offered.append(ToolSpec(name, tool.description, tool.input_schema))
        if offered:
            self._api_tools = tools.to_api((*self._tools, *offered))

    async def _steps(self) -> str:
        while True:
            self._check_interrupt()
            pending = conversation.pending_tool_uses(self._log)
            if pending:
                waiting = await self._settle(pending)
                if waiting:
                    return await self._idle(ev.STOP_REQUIRES_ACTION, tuple(waiting))
                continue
            context = await self._config.context.build(
                LogSlices(self._log),
                system=self._definition.system,
                tools=tools.to_api(self._tools),
                caching=self._config.prompt_caching,
            )
            messages = context.messages
            if not messages or messages[-1]["role"] == "assistant":
                return await self._idle(ev.STOP_END_TURN)
            budget = conversation.budget_reached(self._definition, self._log)
            if budget:
                await self._append(
                    NewEvent(
                        f"budget.{self.last_seq}",
                        ev.SESSION_ERROR,
                        code="budget_reached",
                        text=f"The session's {budget} budget is used up; no more model calls.",
                    )
                )
                return await self._idle(ev.STOP_BUDGET_REACHED)
            reply = await self._call_model(messages)
            if reply is None:
                return await self._idle(ev.STOP_RETRIES_EXHAUSTED)

    async def _watch_interrupts(self, after_seq: int) -> None:
        """Follow the log for a `user.interrupt` while the turn runs (pushed, not polled)."""
        try:
            async for event in self._session.follow(self.session_id, after_seq):
                if event.type == ev.USER_INTERRUPT:
                    self._interrupt.set()
                    return
        except Exception as error:  # the log check at every step still sees interrupts
            log.warning("session %s: interrupt watch ended: %s", self.session_id, error)

    def _check_interrupt(self) -> None:
        if self._interrupt.is_set():
            raise Interrupted
        start = conversation.turn_start(self._log)
        if any(e.type == ev.USER_INTERRUPT and e.seq > start for e in self._log):
            raise Interrupted

    async def _interruptible(self, awaitable: Awaitable[T]) -> T:
        """Await `awaitable` unless the user interrupts first (then cancel it)."""
        self._check_interrupt()
        work = asyncio.ensure_future(awaitable)
        interrupted = asyncio.ensure_future(self._interrupt.wait())
        try:
            await asyncio.wait({work, interrupted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            interrupted.cancel()
        if work.done():
            return work.result()
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await work
        raise Interrupted

    async def reschedule(self, reason: str) -> None:
        """Give the session up mid-turn (the harness is shutting down); the log says so, and
        the next harness to wake it resumes where this one stopped. A turn already idle (the
        cancel came between the idle append and the lease release) is left as it is when
        nothing new needs a harness: a `session.status_rescheduled` after the idle would
        announce a turn nobody resumes, leaving the session rescheduling forever."""
        self._log.extend(await self._session.read_events(self.session_id, self.last_seq))
        if not conversation.has_work(self._log):
            return
        await self._append(NewEvent(f"resched.{self.last_seq}", ev.STATUS_RESCHEDULED, text=reason))

    async def abort(self, error: BaseException) -> str:
        """End a turn that failed unexpectedly: log why and go idle, so that watchers are
        not left waiting. The log is consistent; a new user message starts a new turn."""
        await self._append(
            NewEvent(
                f"abort.{self.last_seq}",
                ev.SESSION_ERROR,
                code="harness_error",
                text=f"{type(error).__name__}: {error}",
            )
        )
        return await self._idle(ev.STOP_RETRIES_EXHAUSTED)

    async def _settle(self, pending: Sequence[LogEvent]) -> list[str]:
        """Run the pending tool calls that may run, record their results, and return the ids
        of those that wait for the user (a custom tool's result, or a confirmation)."""
        waiting: list[str] = []
        for tool_use in pending:
            self._check_interrupt()
            if tool_use.type == ev.AGENT_CUSTOM_TOOL_USE:
                waiting.append(tool_use.tool_use_id)  # the client runs it
                continue
            if self._asks(tool_use):
                answer = conversation.confirmation(self._log, tool_use.tool_use_id)
                if answer is None:
                    waiting.append(tool_use.tool_use_id)
                    continue
                if not answer.allowed:
                    reason = f": {answer.text}" if answer.text else "."
                    await self._record(
                        tool_use, ToolOutput(f"The user denied this call{reason}", True)
                    )
                    continue
            if tool_use.type == ev.AGENT_MCP_TOOL_USE:
                output = await self._run_mcp(tool_use)
            else:
                output = await self._run_tool(tool_use)
            await self._record(tool_use, output)
        return waiting

    def _asks(self, tool_use: LogEvent) -> bool:
        """Whether the call waits for a `user.tool_confirmation` (permission "always ask")."""
        if tool_use.type == ev.AGENT_MCP_TOOL_USE:
            server = self._servers.get(tool_use.mcp_server)
            return server is not None and server.ask
        spec = self._specs.get(tool_use.tool_name)
        return spec is not None and spec.ask

    def _use_event(self, call: ToolCall) -> NewEvent:
        mcp_tool = self._mcp_tools.get(call.name)
        if mcp_tool is not None:
            return NewEvent(
                f"use.{call.id}",
                ev.AGENT_MCP_TOOL_USE,
                turn_id=self.turn_id,
                tool_use_id=call.id,
                tool_name=call.name,
                tool_input=call.input,
                mcp_server=mcp_tool.server,
                mcp_tool=mcp_tool.name,
            )
        spec = self._specs.get(call.name)
        return NewEvent(
            f"use.{call.id}",
            ev.AGENT_CUSTOM_TOOL_USE if spec is not None and spec.custom else ev.AGENT_TOOL_USE,
            turn_id=self.turn_id,
            tool_use_id=call.id,
            tool_name=call.name,
            tool_input=call.input,
        )

    async def _record(self, tool_use: LogEvent, output: ToolOutput) -> None:
        mcp = tool_use.type == ev.AGENT_MCP_TOOL_USE
        await self._append(
            NewEvent(
                f"result.{tool_use.tool_use_id}",
                ev.AGENT_MCP_TOOL_RESULT if mcp else ev.AGENT_TOOL_RESULT,
                turn_id=self.turn_id,
                tool_use_id=tool_use.tool_use_id,
                tool_name=tool_use.tool_name,
                text=output.text,
                is_error=output.is_error,
            )
        )
        faults.reach("after_tool_result")

    async def _idle(self, stop_reason: str, waiting: tuple[str, ...] = ()) -> str:
        faults.reach("before_idle")
        await self._append(
            NewEvent(
                f"idle.{self.last_seq}",
                ev.STATUS_IDLE,
                turn_id=self.turn_id,
                stop_reason=stop_reason,
                tool_use_ids=waiting,
            )
        )
        faults.reach("after_idle")
        return stop_reason

    async def _call_model(self, messages: list[dict[str, object]]) -> ModelReply | None:
        """One model request with retries; appends its events; None when retries ran out."""
        base = self.last_seq
        turn = self.turn_id
        d = self._definition
        await self._append(NewEvent(f"m{base}.start", ev.SPAN_START, turn_id=turn, model=d.model))
        faults.reach("after_model_request_start")
        preview_after = self.last_seq
        failure: ModelFailure | None = None
        for attempt in range(self._config.max_model_retries + 1):
            try:
                if attempt:
                    await self._interruptible(asyncio.sleep(self._backoff(attempt)))
                reply = await self._interruptible(
                    stream_reply(
                        self._model,
                        model=d.model,
                        system=d.system,
                        messages=messages,
                        tools=self._api_tools,
                        max_tokens=d.max_tokens,
                        user_id=self.session_id,
                        cache=self._config.prompt_caching,
                        on_text=lambda text: self._preview(preview_after, text),
                    )
                )
            except Interrupted:
                await self._append(
                    NewEvent(
                        f"m{base}.end",
                        ev.SPAN_END,
                        turn_id=turn,
                        model=d.model,
                        is_error=True,
                        text="interrupted by the user",
                    )
                )
                raise
            except ModelFailure as error:
                failure = error
                log.warning(
                    "session %s: model request failed (attempt %d): %s",
                    self.session_id,
                    attempt + 1,
                    error,
                )
                await self._append(
                    NewEvent(
                        f"m{base}.error{attempt}",
                        ev.SESSION_ERROR,
                        turn_id=turn,
                        text=str(error),
                        code=error.error_type,
                        retrying=error.retryable and attempt < self._config.max_model_retries,
                    )
                )
                if not error.retryable:
                    break
                continue
            batch = []
            if reply.text:
                batch.append(
                    NewEvent(f"m{base}.message", ev.AGENT_MESSAGE, turn_id=turn, text=reply.text)
                )
            batch.extend(self._use_event(c) for c in reply.tool_calls)
            batch.append(
                NewEvent(
                    f"m{base}.end",
                    ev.SPAN_END,
                    turn_id=turn,
                    usage=reply.usage,
                    model=reply.model or d.model,
                    stop_reason=reply.stop_reason,
                )
            )
            await self._append(*batch)
            faults.reach("after_tool_use")
            return reply
        await self._append(
            NewEvent(
                f"m{base}.end",
                ev.SPAN_END,
                turn_id=turn,
                model=d.model,
                is_error=True,
                text=str(failure),
            )
        )
        return None

    def _backoff(self, attempt: int) -> float:
        ceiling = min(
            self._config.backoff_max_seconds,
            self._config.backoff_initial_seconds * 2 ** (attempt - 1),
        )
        return random.uniform(ceiling / 2, ceiling)

    async def _preview(self, after_seq: int, text: str) -> None:
        faults.reach("mid_model_stream")
        try:
            await self._session.publish_preview(self._lease, after_seq, text)
        except Exception as error:  # previews are best-effort; the stored message is the truth
            log.debug("preview dropped: %s", error)

    def _maybe_sent(self, tool_use: LogEvent) -> bool:
        """Whether an earlier harness may have sent this call before it stopped: the call was
        in the log when this turn started and could run then (no confirmation was awaited,
        or a turn started after the user allowed it)."""
        if tool_use.seq > self._start_seq:
            return False
        if not self._asks(tool_use):
            return True
        answer = conversation.confirmation(self._log, tool_use.tool_use_id)
        return answer is not None and any(
            e.type == ev.STATUS_RUNNING and answer.seq < e.seq <= self._start_seq for e in self._log
        )

    async def _run_mcp(self, tool_use: LogEvent) -> ToolOutput:
        """Call an MCP tool through the vault's proxy. MCP has no execution id: a call a
        crashed predecessor may have sent is sent again only when the server declares the
        tool read-only or idempotent (HARNESS-MCP-002)."""
        server = self._servers.get(tool_use.mcp_server)
        if server is None:
            return ToolOutput(
                f"MCP server {tool_use.mcp_server!r} is not part of this session.", True
            )
        if self._maybe_sent(tool_use):
            listed = self._mcp_tools.get(tool_use.tool_name)
            if listed is None or not listed.safe_to_repeat:
                return ToolOutput(MCP_IN_FLIGHT, True)
        connection = self._connect_mcp()
        if connection is None:
            return ToolOutput(
                "The MCP tool could not be called: this harness cannot reach MCP servers.", True
            )
        try:
            return await connection.call_tool(server, tool_use.mcp_tool, tool_use.tool_input)
        except McpUnavailable as error:
            log.warning(
                "session %s: MCP call %s failed: %s", self.session_id, tool_use.tool_use_id, error
            )
            return ToolOutput(f"The MCP tool could not be called: {error}", True)

    async def _run_tool(self, tool_use: LogEvent) -> ToolOutput:
        if not tools.is_sandbox_tool(tool_use.tool_name):
            return ToolOutput(
                f"Tool {tool_use.tool_name!r} is not available in this session.", True
            )
        try:
            if self._sandbox_id is None and not self._lost_sandbox:
                self._sandbox_id = await self._sandbox.find_live(self.session_id)
            if self._sandbox_id is None:
                # Keyed by the tool call that needs it: a retry (or a successor harness)
                # reuses the same sandbox, and a replacement after a loss gets a distinct key.
                self._sandbox_id = await self._sandbox.provision(
                    self.session_id,
                    f"{self.session_id}.{tool_use.tool_use_id}",
                    self._definition.environment,
                )
            faults.reach("before_execute")
            execution = asyncio.ensure_future(
                self._sandbox.execute(
                    self._sandbox_id, tool_use.tool_name, tool_use.tool_input, tool_use.tool_use_id
                )
            )
            if faults.armed("during_execute"):
                # Crash once the sandbox has the call and is running it.
                await asyncio.wait({execution}, timeout=0.5)
                faults.crash()
            return await execution
        except ToolFailed as failed:
            log.warning(
                "session %s: tool %s failed: %s", self.session_id, tool_use.tool_use_id, failed
            )
            return ToolOutput(f"The tool could not be run: {failed}", True)
        except SandboxGone as gone:
            log.warning("session %s: sandbox %s lost: %s", self.session_id, self._sandbox_id, gone)
            lost, self._sandbox_id, self._lost_sandbox = self._sandbox_id, None, True
            if lost is not None:
                # So that no harness finds it by label and tries to use it again.
                await self._sandbox.destroy(lost)
            return ToolOutput(SANDBOX_LOST.format(detail=gone), True)
