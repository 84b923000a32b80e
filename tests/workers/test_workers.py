"""`oma serve harness --worker`: workers take pushed sessions, share them, survive each other.

Every server is a real child process; sessions run on PostgreSQL, tools in bubblewrap
sandboxes, the model is the scripted model server (which rejects malformed requests).
"""

from __future__ import annotations

import asyncio
import signal
import time

from workers_helpers import Client, Stack, check_complete, tool_outputs

PATIENCE = 90.0  # hang protection only; nothing here asserts a duration


async def wait_for(condition: object, what: str, limit: float = PATIENCE) -> None:
    deadline = time.monotonic() + limit
    while True:
        result = condition() if callable(condition) else condition
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def test_a_pushed_session_starts_without_polling(stack: Stack, client: Client) -> None:
    """The worker learns of a session from the WatchPendingSessions stream it holds open: the
    id arrives as a push and the turn starts from it, with no second stream and no Wake."""
    worker = stack.start_worker("solo")
    first = await client.create("chat")
    await client.wait_done([first], PATIENCE)
    # The worker has now received an id over its stream, so the stream is open; a session
    # created from here on can only reach the worker as a live push on that same stream.
    second = await client.create("chat")
    await client.wait_done([second], PATIENCE)

    text = worker.text()
    assert worker.streams() == 1, text
    pushed_at = text.index(f"session {second} pushed")
    assert text.index(f"session {second}: turn started from a push") > pushed_at
    assert worker.started() == [first, second]
    check_complete(await client.events(second), "Hello from a worker.")


async def test_three_workers_finish_thirty_sessions_when_one_is_killed(
    stack: Stack, client: Client
) -> None:
    workers = [stack.start_worker(name, max_sessions=4) for name in ("a", "b", "c")]
    victim = workers[0]
    sessions = [await client.create("work") for _ in range(30)]

    # Kill the victim while it drives a session that has started and not finished.
    mid_turn: list[str] = []

    async def victim_mid_turn() -> bool:
        for session_id in victim.started():
            events = await client.events(session_id)
            if events[-1].type != "session.status_idle" and any(
                e.type == "session.status_running" for e in events
            ):
                mid_turn.append(session_id)
                return True
        return False

    await wait_for(victim_mid_turn, "the victim to be midway through a session")
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait()

    await client.wait_done(sessions, PATIENCE)
    for session_id in sessions:
        events = await client.events(session_id)
        check_complete(events, "The answer is 42.")
        assert [o.strip() for o in tool_outputs(events)] == ["42"], events

    # The session the victim was driving was resumed by a survivor after its lease expired.
    resumed = await client.events(mid_turn[0])
    assert [e.type for e in resumed].count("session.status_running") >= 2
    survivors = workers[1:]
    assert any(mid_turn[0] in w.started() for w in survivors)
    # The load was shared: every worker drove sessions, never more than its cap at once.
    for worker in workers:
        assert worker.started(), worker.name
        assert worker.most_at_once() <= 4, worker.name
    assert set(sessions) <= {s for w in workers for s in w.started()}
    for worker in survivors:
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.proc.wait(30) == 0, worker.text()[-2000:]


async def test_sigterm_hands_a_session_back_to_another_worker(stack: Stack, client: Client) -> None:
    workers = [stack.start_worker(name, max_sessions=1, lease_ttl_seconds=60) for name in "xy"]
    session_id = await client.create("slow")

    async def tool_running() -> bool:
        events = await client.events(session_id)
        return any(e.type == "agent.tool_use" for e in events) and not any(
            e.type == "agent.tool_result" for e in events
        )

    await wait_for(tool_running, "the first tool call to start")
    [driver] = [w for w in workers if session_id in w.started()]
    [other] = [w for w in workers if w is not driver]
    driver.proc.send_signal(signal.SIGTERM)
    assert driver.proc.wait(20) == 0, driver.text()[-2000:]
    # Finished before the 60 s lease could have expired on its own: the session was handed
    # back (its lease released), not abandoned.
    await client.wait_done([session_id], 45)
    events = await client.events(session_id)
    check_complete(events, "Napped once.")
    types = [e.type for e in events]
    rescheduled = types.index("session.status_rescheduled")
    assert types[:rescheduled].count("session.status_running") == 1
    assert "session.status_running" in types[rescheduled:]
    assert session_id in other.started()
    # The interrupted tool call ran once: the successor re-attached to it by execution id.
    assert tool_outputs(events)[-1].split() == ["run"], tool_outputs(events)
    other.proc.send_signal(signal.SIGTERM)
    assert other.proc.wait(30) == 0


async def test_the_worker_reopens_its_stream_when_the_session_service_restarts(
    stack: Stack, client: Client
) -> None:
    worker = stack.start_worker("steady")
    before = await client.create("chat")
    await client.wait_done([before], PATIENCE)

    stack.restart_session()
    await wait_for(lambda: worker.streams() >= 2, "the worker to reopen its stream")
    after = await client.create("chat")
    await client.wait_done([after], PATIENCE)

    text = worker.text()
    assert "the pending-session stream failed" in text or "stream ended" in text
    assert text.rindex("watching pending sessions") < text.index(f"session {after} pushed")
    assert worker.started() == [before, after]
    check_complete(await client.events(after), "Hello from a worker.")
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.proc.wait(30) == 0


async def test_a_session_with_nothing_to_answer_is_not_woken_again_and_again(
    stack: Stack, client: Client
) -> None:
    """The session service calls a session pending when any `user.*` event follows its last
    idle; a `user.interrupt` on an idle session leaves the harness nothing to answer. The
    worker tries it once, and does not take it again on the push its own release causes."""
    worker = stack.start_worker("memo")
    quiet = await client.create("chat")
    await client.wait_done([quiet], PATIENCE)
    await client.append_interrupt(quiet)
    await wait_for(
        lambda: f"session {quiet}: nothing to answer" in worker.text(), "the worker to look"
    )
    # Releasing the lease it took made the session pending again: it is pushed once more.
    await wait_for(
        lambda: worker.pushed().count(quiet) >= 3, "the push caused by the worker's release"
    )
    later = await client.create("chat")
    await client.wait_done([later], PATIENCE)
    assert worker.text().count(f"session {quiet}: nothing to answer") == 1
    assert worker.started() == [quiet, later]
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.proc.wait(30) == 0
