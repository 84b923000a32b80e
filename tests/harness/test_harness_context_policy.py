"""The sliding-window context policy against synthetic logs (no servers).

Every request it builds is checked by the scripted model server's validator, which is as
strict as the real Messages API (roles alternate, every tool_use answered in the next
message, at most four cache breakpoints).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oma.servers.harness import conversation
from oma.servers.harness import events as ev
from oma.servers.harness.context import (
    Context,
    LogSlices,
    SlidingWindowPolicy,
    WholeLogPolicy,
)
from oma.servers.harness.events import LogEvent
from oma.servers.harness.model_server.validate import validate_request

TOOLS = [{"name": "bash", "description": "Run a command.", "input_schema": {"type": "object"}}]
SYSTEM = "You are a test agent."
TASK = "Count the files, one command at a time."


class LogBuilder:
    """Appends events the way the loop does: a model request's span, its reply, results."""

    def __init__(self) -> None:
        self.events: list[LogEvent] = []
        self.replies = 0

    def add(self, type_: str, **fields: Any) -> None:
        seq = len(self.events) + 1
        self.events.append(LogEvent(seq=seq, id=f"e{seq}", type=type_, **fields))

    def user(self, text: str) -> None:
        self.add(ev.USER_MESSAGE, text=text)
        self.add(ev.STATUS_RUNNING)

    def reply(self, uses: int = 1, text: str = "", output: str = "x" * 200) -> None:
        self.replies += 1
        n = self.replies
        self.add(ev.SPAN_START)
        if text:
            self.add(ev.AGENT_MESSAGE, text=text)
        ids = [f"toolu_{n}_{i}" for i in range(uses)]
        for tool_use_id in ids:
            self.add(
                ev.AGENT_TOOL_USE,
                tool_use_id=tool_use_id,
                tool_name="bash",
                tool_input={"command": f"ls {n}"},
            )
        self.add(ev.SPAN_END)
        for tool_use_id in ids:
            self.add(ev.AGENT_TOOL_RESULT, tool_use_id=tool_use_id, text=output)

    def idle(self) -> None:
        self.add(ev.STATUS_IDLE, stop_reason=ev.STOP_END_TURN)


async def build(policy: Any, log: list[LogEvent]) -> Context:
    result: Context = await policy.build(LogSlices(log), system=SYSTEM, tools=TOOLS, caching=True)
    return result


def check_valid(context: Context) -> None:
    validate_request(
        {
            "model": "claude-sonnet-5",
            "max_tokens": 100,
            "system": SYSTEM,
            "tools": TOOLS,
            "messages": context.messages,
            "cache_control": {"type": "ephemeral"},
        },
        kind="create",
    )


def plain(message: dict[str, Any]) -> dict[str, Any]:
    """The message without cache breakpoints."""
    content = [{k: v for k, v in b.items() if k != "cache_control"} for b in message["content"]]
    return {**message, "content": content}


def blocks(context: Context) -> list[tuple[str, dict[str, Any]]]:
    return [(m["role"], b) for m in context.messages for b in m["content"]]


def long_log(replies: int) -> LogBuilder:
    log = LogBuilder()
    log.user(TASK)
    for i in range(replies):
        log.reply(text=f"step {i}" if i % 3 == 0 else "")
    return log


async def test_a_short_conversation_is_sent_whole() -> None:
    log = long_log(5)
    context = await build(SlidingWindowPolicy(budget_tokens=100_000), log.events)
    expected = conversation.build_messages(log.events)
    expected[0]["content"][0] = {
        **expected[0]["content"][0],
        "cache_control": {"type": "ephemeral"},
    }
    assert context.messages == expected
    assert context.omitted is None
    check_valid(context)
    whole = await build(WholeLogPolicy(), log.events)
    assert whole.messages == conversation.build_messages(log.events)


async def test_a_long_conversation_keeps_the_task_and_the_latest_events() -> None:
    log = long_log(200)
    policy = SlidingWindowPolicy(budget_tokens=3000, step_events=20)
    context = await build(policy, log.events)
    check_valid(context)
    assert context.omitted is not None
    assert context.estimated_tokens <= policy.budget_tokens
    first = context.messages[0]["content"]
    assert first[0] == {"type": "text", "text": TASK, "cache_control": {"type": "ephemeral"}}
    assert first[1]["text"].startswith(
        f"[Context note: events 4 to {context.omitted[1]} of this session's log are left out"
    )
    full = conversation.build_messages(log.events)
    assert context.messages[-1] == full[-1]
    assert context.messages[-2] == full[-2]
    assert len(context.messages) < len(full) / 4
    # The window starts at a model request, so its first message is a whole reply.
    assert context.messages[1]["role"] == "assistant"


async def test_the_window_moves_in_coarse_steps_and_extends_in_between() -> None:
    log = LogBuilder()
    log.user(TASK)
    policy = SlidingWindowPolicy(budget_tokens=3000, step_events=30)
    previous: Context | None = None
    starts: list[int] = []
    extended = 0
    for _ in range(120):
        log.reply()
        context = await build(policy, log.events)
        check_valid(context)
        assert context.estimated_tokens <= policy.budget_tokens
        if context.omitted is None:
            previous = context
            continue
        start = context.omitted[1] + 1
        assert not starts or start >= starts[-1], "the window never moves back"
        if starts and start == starts[-1]:
            assert previous is not None
            # Same start: this request's prompt extends the previous one (a cache hit).
            assert blocks(context)[: len(blocks(previous))] == blocks(previous)
            extended += 1
        starts.append(start)
        previous = context
    moves = len(set(starts))
    assert moves >= 3, "the log outgrew the window several times"
    # 30 seqs per step at 4 events per reply: the start moves at most every 7 requests.
    assert len(starts) >= moves * 6
    assert extended >= len(starts) - moves


async def test_the_current_request_is_kept_when_older_than_the_window() -> None:
    log = long_log(30)
    log.add(ev.AGENT_MESSAGE, text="All counted.")
    log.idle()
    log.user("Now delete the temporary files.")
    for _ in range(60):
        log.reply()
    context = await build(SlidingWindowPolicy(budget_tokens=2500, step_events=10), log.events)
    check_valid(context)
    texts = [b.get("text") for b in context.messages[0]["content"]]
    assert texts[0] == TASK
    assert "Now delete the temporary files." in texts
    assert texts.index("Now delete the temporary files.") > 1  # after the marker


async def test_an_oversized_latest_reply_is_still_sent() -> None:
    log = long_log(10)
    log.reply(uses=3, output="y" * 20_000)
    context = await build(SlidingWindowPolicy(budget_tokens=2000, step_events=10), log.events)
    check_valid(context)
    assert context.messages[-1] == conversation.build_messages(log.events)[-1]


@st.composite
def logs(draw: st.DrawFn) -> list[LogEvent]:
    log = LogBuilder()
    log.user(TASK)
    for _ in range(draw(st.integers(0, 80))):
        action = draw(st.sampled_from(["reply", "reply", "reply", "text", "new_turn"]))
        if action == "reply":
            log.reply(
                uses=draw(st.integers(1, 3)),
                text=draw(st.sampled_from(["", "thinking aloud"])),
                output="z" * draw(st.integers(0, 1500)),
            )
        elif action == "text":
            log.add(ev.SPAN_START)
            log.add(ev.AGENT_MESSAGE, text="done for now")
            log.add(ev.SPAN_END)
            log.idle()
            log.user(f"next request {len(log.events)}")
        else:
            log.idle()
            log.user(f"another request {len(log.events)}")
    return log.events


@settings(max_examples=150, deadline=None)
@given(
    log=logs(),
    budget=st.integers(500, 20_000),
    step=st.integers(1, 40),
    page=st.integers(1, 50),
)
def test_every_request_is_valid_and_keeps_the_task_and_the_end(
    log: list[LogEvent], budget: int, step: int, page: int
) -> None:
    policy = SlidingWindowPolicy(budget_tokens=budget, step_events=step, page=page)
    context = asyncio.run(build(policy, log))
    full = conversation.build_messages(log)
    if full[-1]["role"] == "assistant":
        return  # the loop never asks the model here: the turn has ended
    check_valid(context)
    assert context.messages[0]["content"][0]["text"] == TASK
    # The most recent message (what the model answers) is always there, whole.
    assert plain(context.messages[-1]) == full[-1]
    if context.omitted is None:
        assert [m["role"] for m in context.messages] == [m["role"] for m in full]


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        SlidingWindowPolicy(budget_tokens=0)
    with pytest.raises(ValueError):
        SlidingWindowPolicy(step_events=0)
