"""Building the Messages request and reading the turn state from a log (pure functions)."""

from __future__ import annotations

from oma.servers.harness import conversation
from oma.servers.harness import events as ev
from oma.servers.harness.events import Definition, LogEvent, Usage


def _log(*specs: tuple[str, dict[str, object]]) -> list[LogEvent]:
    return [LogEvent(seq=i + 2, id=f"e{i}", type=t, **kw) for i, (t, kw) in enumerate(specs)]  # type: ignore[arg-type]


def test_tool_pairs_become_blocks_and_roles_alternate() -> None:
    log = _log(
        (ev.USER_MESSAGE, {"text": "hi"}),
        (ev.STATUS_RUNNING, {}),
        (ev.SPAN_START, {}),
        (ev.AGENT_MESSAGE, {"text": "let me look"}),
        (
            ev.AGENT_TOOL_USE,
            {"tool_use_id": "t1", "tool_name": "bash", "tool_input": {"command": "ls"}},
        ),
        (
            ev.AGENT_TOOL_USE,
            {"tool_use_id": "t2", "tool_name": "read", "tool_input": {"path": "a"}},
        ),
        (ev.SPAN_END, {}),
        (ev.AGENT_TOOL_RESULT, {"tool_use_id": "t1", "text": "a\n"}),
        (ev.AGENT_TOOL_RESULT, {"tool_use_id": "t2", "text": "boom", "is_error": True}),
    )
    messages = conversation.build_messages(log)
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert [b["type"] for b in messages[1]["content"]] == ["text", "tool_use", "tool_use"]
    assert messages[2]["content"][1] == {
        "type": "tool_result",
        "tool_use_id": "t2",
        "content": "boom",
        "is_error": True,
    }
    assert conversation.pending_tool_uses(log) == []
    assert conversation.has_work(log)


def test_tool_results_precede_text_in_a_user_turn() -> None:
    log = _log(
        (ev.USER_MESSAGE, {"text": "go"}),
        (ev.AGENT_TOOL_USE, {"tool_use_id": "t1", "tool_name": "bash"}),
        (ev.USER_MESSAGE, {"text": "also this"}),
        (ev.AGENT_TOOL_RESULT, {"tool_use_id": "t1", "text": "ok"}),
    )
    last = conversation.build_messages(log)[-1]
    assert [b["type"] for b in last["content"]] == ["tool_result", "text"]


def test_unanswered_tool_use_is_pending_and_left_out() -> None:
    log = _log(
        (ev.USER_MESSAGE, {"text": "go"}),
        (ev.AGENT_TOOL_USE, {"tool_use_id": "t1", "tool_name": "bash"}),
    )
    assert [e.tool_use_id for e in conversation.pending_tool_uses(log)] == ["t1"]
    assert conversation.build_messages(log) == [
        {"role": "user", "content": [{"type": "text", "text": "go"}]}
    ]


def test_has_work_after_idle_only_with_new_user_input() -> None:
    done = _log(
        (ev.USER_MESSAGE, {"text": "a"}),
        (ev.AGENT_MESSAGE, {"text": "b"}),
        (ev.STATUS_IDLE, {"stop_reason": ev.STOP_END_TURN}),
    )
    assert not conversation.has_work(done)
    assert conversation.has_work(
        [*done, LogEvent(seq=99, id="u", type=ev.USER_MESSAGE, text="more")]
    )
    # A harness died mid-turn: the turn resumes.
    crashed = _log((ev.USER_MESSAGE, {"text": "a"}), (ev.STATUS_RUNNING, {}), (ev.SPAN_START, {}))
    assert conversation.has_work(crashed)


def test_budgets() -> None:
    log = _log(
        (ev.USER_MESSAGE, {"text": "a"}),
        (ev.SPAN_START, {}),
        (ev.SPAN_END, {"usage": Usage(input_tokens=70, output_tokens=40)}),
    )
    assert (
        conversation.budget_reached(Definition("m", max_total_tokens=110), log)
        == "max_total_tokens"
    )
    assert conversation.budget_reached(Definition("m", max_total_tokens=111), log) == ""
    assert (
        conversation.budget_reached(Definition("m", max_model_calls_per_turn=1), log)
        == "max_model_calls_per_turn"
    )
    assert (
        conversation.budget_reached(Definition("m", max_output_tokens_per_turn=40), log)
        == "max_output_tokens_per_turn"
    )
    idle = [
        *log,
        LogEvent(seq=50, id="i", type=ev.STATUS_IDLE, stop_reason=ev.STOP_END_TURN),
        LogEvent(seq=51, id="u", type=ev.USER_MESSAGE, text="b"),
    ]
    # Per-turn budgets restart after an idle; the session's turn count does not.
    assert conversation.budget_reached(Definition("m", max_model_calls_per_turn=1), idle) == ""
    assert conversation.budget_reached(Definition("m", max_turns=1), idle) == "max_turns"
