"""`oma bench session`: how much the session service costs over its database.

Prints details, then as its last line exactly

    append_ratio=X tail_read_ratio=Y stream_p50_ms=Z

- append_ratio: events appended per second through gRPC (4 concurrent writers, one session
  each, AppendEvents of batches of 100 to a server in its own process) divided by the same work
  done directly with the driver in the same run: same database, one transaction per batch, the
  same seq allocation (row lock / BEGIN IMMEDIATE), the same duplicate-id check and the same
  durability settings (on PostgreSQL 4 concurrent connections; on SQLite, which admits one
  writer at a time, the writers take turns on one connection). Batches of 1 are reported on a
  detail line. Target >= 0.5 for batches of 100.
- tail_read_ratio: median latency of reading the last 100 events (GetEvents, descending) of a
  1,000,000-event session divided by the same read on a 1,000-event session (the big session is
  bulk-loaded directly). Target <= 2.0.
- stream_p50_ms: median time from an append's acknowledgement at the client to a watcher
  (StreamEvents, follow) receiving the event; a watcher that is faster than the
  acknowledgement counts as 0. Target <= 2 ms.

On PostgreSQL a detail line also gives the latency with the watcher on a second server sharing
the database (the append reaches it through LISTEN/NOTIFY).

`--quick` shrinks every phase (100,000-event large session) to finish in under a minute.
"""

from __future__ import annotations

import argparse
from typing import Any

WORKERS = 4  # concurrent writers in the append phase, on both sides of the ratio


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small run, under a minute")
    parser.add_argument(
        "--db",
        metavar="URL",
        default=None,
        help="database to measure on: sqlite:///file.db or postgresql://user:pw@host/db "
        "(default: a SQLite file in a temporary directory)",
    )


def run(args: argparse.Namespace) -> int:
    import asyncio

    return asyncio.run(_main(args))


async def _main(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="oma-bench-session-") as tmp:
        db_url = args.db or f"sqlite:///{Path(tmp) / 'sessions.db'}"
        bench = _Bench(db_url, Path(tmp), quick=args.quick)
        await bench.start()
        try:
            append = await bench.append_ratios()
            tail = await bench.tail_read_ratio()
            stream = await bench.stream_p50_ms()
            if not bench.is_sqlite:
                await bench.cross_server_stream()
        finally:
            await bench.stop()
    print(f"append_ratio={append:.2f} tail_read_ratio={tail:.2f} stream_p50_ms={stream:.2f}")
    return 0


class _Bench:
    def __init__(self, db_url: str, tmp: Any, *, quick: bool) -> None:
        from oma.servers.session.database import normalize_url

        self.url = normalize_url(db_url)
        self.is_sqlite = self.url.get_backend_name() == "sqlite"
        self.tmp = tmp
        self.quick = quick
        self.proc: Any = None
        self.channel: Any = None
        self.stub: Any = None
        self.tokens: Any = None

    # -- server process ------------------------------------------------------------------------

    async def start(self) -> None:
        import asyncio

        from oma.runtime.auth import TokenTable
        from oma.runtime.client import connect
        from oma.session.v1.session_service_pb2_grpc import SessionServiceStub

        self.tokens = TokenTable.generate()
        tokens_file = self.tmp / "tokens.json"
        self.tokens.save(tokens_file)
        url = self.url.render_as_string(hide_password=False)
        self.proc = _spawn_server(url, tokens_file)
        line = await asyncio.to_thread(self.proc.stdout.readline)
        if "serving on" not in line:
            raise SystemExit(f"session server did not start: {line!r}")
        address = line.rsplit(" ", 1)[1].strip()
        self.channel = connect(address, token=self.tokens.token_for("harness"))
        self.stub = SessionServiceStub(self.channel)
        backend = "SQLite (WAL, synchronous=FULL)" if self.is_sqlite else "PostgreSQL"
        print(f"session server at {address} on {backend}; quick={self.quick}", flush=True)

    async def cross_server_stream(self) -> None:
        """Detail line: the same latency with the watcher on a second server sharing the
        PostgreSQL database (the append reaches it through LISTEN/NOTIFY)."""
        import asyncio

        from oma.runtime.client import connect
        from oma.session.v1.session_service_pb2_grpc import SessionServiceStub

        url = self.url.render_as_string(hide_password=False)
        second = _spawn_server(url, self.tmp / "tokens.json")
        channel = None
        try:
            line = await asyncio.to_thread(second.stdout.readline)
            if "serving on" not in line:
                raise SystemExit(f"second session server did not start: {line!r}")
            channel = connect(
                line.rsplit(" ", 1)[1].strip(), token=self.tokens.token_for("harness")
            )
            await self.stream_p50_ms(SessionServiceStub(channel), "stream across two servers")
        finally:
            if channel is not None:
                await channel.close()
            second.terminate()
            second.wait(timeout=30)

    def _sqlite_path(self) -> str:
        assert self.url.database is not None
        return self.url.database

    async def stop(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)

    async def new_session(self) -> str:
        from oma.session.v1 import definition_pb2
        from oma.session.v1 import session_service_pb2 as pb

        response = await self.stub.CreateSession(
            pb.CreateSessionRequest(definition=definition_pb2.SessionDefinition(model="bench"))
        )
        return str(response.session.id)

    # -- append ----------------------------------------------------------------------------------

    async def append_ratios(self) -> float:
        """Rounds interleave gRPC and direct runs (so machine noise hits both alike); each
        side's median rate over the rounds is compared."""
        ratio_100 = 0.0
        plan = ((1, 150 if self.quick else 600), (100, 12 if self.quick else 50))
        for size, per_worker in plan:
            grpc_rates, direct_rates = [], []
            for round_ in range(3 if self.quick else 5):
                grpc_sids = [await self.new_session() for _ in range(WORKERS)]
                direct_sids = [await self.new_session() for _ in range(WORKERS)]
                # Alternate which side goes first, so a burst of load elsewhere on the machine
                # does not always land on the same side.
                if round_ % 2:
                    direct_rates.append(await self._direct_appends(direct_sids, size, per_worker))
                grpc_rates.append(await self._grpc_appends(grpc_sids, size, per_worker, round_))
                if not round_ % 2:
                    direct_rates.append(await self._direct_appends(direct_sids, size, per_worker))
            grpc_rate, direct_rate = _median(grpc_rates), _median(direct_rates)
            ratio = grpc_rate / direct_rate
            print(
                f"append batch={size} ({WORKERS} concurrent writers, one session each): grpc "
                f"{grpc_rate:,.0f} events/s, direct driver {direct_rate:,.0f} events/s, "
                f"ratio {ratio:.2f}",
                flush=True,
            )
            if size == 100:
                ratio_100 = ratio
        return ratio_100

    async def _grpc_appends(self, sids: list[str], size: int, batches: int, round_: int) -> float:
        import asyncio
        import time

        from oma.session.v1 import session_service_pb2 as pb

        # Requests are built before the clock starts: the client's cost is not the service's.
        requests = {
            sid: [
                pb.AppendEventsRequest(session_id=sid, events=_events(f"g{round_}-{n}", b, size))
                for b in range(batches)
            ]
            for n, sid in enumerate(sids)
        }

        async def worker(sid: str) -> None:
            for request in requests[sid]:
                await self.stub.AppendEvents(request)

        for sid in sids:  # warm-up, outside the measurement
            await self.stub.AppendEvents(
                pb.AppendEventsRequest(session_id=sid, events=_events("warm", 0, size))
            )
        start = time.perf_counter()
        await asyncio.gather(*(worker(sid) for sid in sids))
        return len(sids) * batches * size / (time.perf_counter() - start)

    async def _direct_appends(self, sids: list[str], size: int, batches: int) -> float:
        if self.is_sqlite:
            import asyncio

            return await asyncio.to_thread(self._sqlite_direct, sids, size, batches)
        return await self._pg_direct(sids, size, batches)

    def _sqlite_direct(self, sids: list[str], size: int, batches: int) -> float:
        """SQLite admits one writer at a time, so the best a direct user can do is take turns
        on one connection (competing connections would only add busy-waits)."""
        import sqlite3
        import time

        conn = sqlite3.connect(self._sqlite_path(), isolation_level=None, timeout=30)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        try:
            for sid in sids:
                _sqlite_batch(conn, sid, _events("warm", 0, size))
            work = [[_events(f"d-{n}", b, size) for n in range(len(sids))] for b in range(batches)]
            start = time.perf_counter()
            for per_session in work:
                for sid, events in zip(sids, per_session, strict=True):
                    _sqlite_batch(conn, sid, events)
            return len(sids) * batches * size / (time.perf_counter() - start)
        finally:
            conn.close()

    async def _pg_direct(self, sids: list[str], size: int, batches: int) -> float:
        """One asyncpg connection per writer, running concurrently, as the service does."""
        import asyncio
        import time

        import asyncpg

        dsn = self.url.set(drivername="postgresql").render_as_string(hide_password=False)
        conns = [
            await asyncpg.connect(dsn, server_settings={"synchronous_commit": "on"}) for _ in sids
        ]

        work = {
            sid: [_events(f"d-{n}", b, size) for b in range(batches)] for n, sid in enumerate(sids)
        }

        async def worker(conn: Any, sid: str) -> None:
            for events in work[sid]:
                await _pg_batch(conn, sid, events)

        try:
            for conn, sid in zip(conns, sids, strict=True):
                await _pg_batch(conn, sid, _events("warm", 0, size))
            start = time.perf_counter()
            await asyncio.gather(*(worker(c, s) for c, s in zip(conns, sids, strict=True)))
            return len(sids) * batches * size / (time.perf_counter() - start)
        finally:
            for conn in conns:
                await conn.close()

    # -- tail read -------------------------------------------------------------------------------

    async def tail_read_ratio(self) -> float:
        import time

        small, large = 1000, (100_000 if self.quick else 1_000_000)
        small_sid, large_sid = await self.new_session(), await self.new_session()
        start = time.perf_counter()
        await self._bulk_load(small_sid, small)
        await self._bulk_load(large_sid, large)
        print(
            f"bulk-loaded {small:,} + {large:,} events in {time.perf_counter() - start:.1f} s",
            flush=True,
        )
        rounds = 100 if self.quick else 300
        small_times, large_times = [], []
        for _ in range(10):  # warm-up
            await self._tail(small_sid)
            await self._tail(large_sid)
        for _ in range(rounds):  # interleaved, so machine noise hits both alike
            small_times.append(await self._tail(small_sid))
            large_times.append(await self._tail(large_sid))
        small_p50, large_p50 = _median(small_times), _median(large_times)
        print(
            f"tail read (last 100): {small:,}-event session p50 {small_p50 * 1000:.2f} ms, "
            f"{large:,}-event session p50 {large_p50 * 1000:.2f} ms",
            flush=True,
        )
        return large_p50 / small_p50

    async def _tail(self, sid: str) -> float:
        import time

        from oma.session.v1 import session_service_pb2 as pb

        start = time.perf_counter()
        response = await self.stub.GetEvents(
            pb.GetEventsRequest(session_id=sid, order=pb.EVENT_ORDER_DESCENDING, page_size=100)
        )
        elapsed = time.perf_counter() - start
        assert len(response.events) == 100
        return elapsed

    async def _bulk_load(self, sid: str, count: int) -> None:
        """Events 2..count appended straight into the tables (what a long session leaves)."""
        body_of = _body_factory()
        chunk = 50_000
        if self.is_sqlite:
            import asyncio
            import sqlite3

            def load() -> None:
                conn = sqlite3.connect(self._sqlite_path(), isolation_level=None, timeout=30)
                try:
                    pk = conn.execute("SELECT pk FROM oma_sessions WHERE id=?", (sid,)).fetchone()[
                        0
                    ]
                    for low in range(2, count + 1, chunk):
                        high = min(count, low + chunk - 1)
                        conn.execute("BEGIN IMMEDIATE")
                        conn.executemany(
                            "INSERT INTO oma_events (session_pk, seq, event_id, type, body) "
                            "VALUES (?, ?, ?, 'user.message', ?)",
                            ((pk, s, f"bulk-{s}", body_of(s)) for s in range(low, high + 1)),
                        )
                        conn.execute(
                            "UPDATE oma_sessions SET last_seq=?, last_user_seq=? WHERE pk=?",
                            (high, high, pk),
                        )
                        conn.execute("COMMIT")
                finally:
                    conn.close()

            await asyncio.to_thread(load)
            return
        import asyncpg

        dsn = self.url.set(drivername="postgresql").render_as_string(hide_password=False)
        conn = await asyncpg.connect(dsn)
        try:
            pk = await conn.fetchval("SELECT pk FROM oma_sessions WHERE id=$1", sid)
            for low in range(2, count + 1, chunk):
                high = min(count, low + chunk - 1)
                async with conn.transaction():
                    await conn.copy_records_to_table(
                        "oma_events",
                        records=[
                            (pk, s, f"bulk-{s}", "user.message", body_of(s))
                            for s in range(low, high + 1)
                        ],
                        columns=["session_pk", "seq", "event_id", "type", "body"],
                    )
                    await conn.execute(
                        "UPDATE oma_sessions SET last_seq=$1, last_user_seq=$1 WHERE pk=$2",
                        high,
                        pk,
                    )
            await conn.execute("ANALYZE oma_events")
        finally:
            await conn.close()

    # -- stream latency --------------------------------------------------------------------------

    async def stream_p50_ms(self, watch_stub: Any = None, label: str = "stream") -> float:
        """Appends go to this bench's server; the watcher reads from `watch_stub` (default the
        same server; on PostgreSQL also a second server, through LISTEN/NOTIFY)."""
        import asyncio
        import time

        from oma.session.v1 import session_service_pb2 as pb

        sid = await self.new_session()
        received: dict[int, float] = {}
        arrived: dict[int, asyncio.Event] = {}
        stream = (watch_stub or self.stub).StreamEvents(
            pb.StreamEventsRequest(session_id=sid, follow=True)
        )

        async def watch() -> None:
            async for item in stream:
                seq = item.event.seq
                received[seq] = time.perf_counter()
                if seq in arrived:
                    arrived[seq].set()

        watcher = asyncio.create_task(watch())
        samples, signed = [], []
        count = 200 if self.quick else 1000
        for i in range(count + 20):
            response = await self.stub.AppendEvents(
                pb.AppendEventsRequest(session_id=sid, events=_events("s", i, 1))
            )
            acked = time.perf_counter()
            seq = response.seqs[0]
            if seq not in received:
                arrived[seq] = asyncio.Event()
                await asyncio.wait_for(arrived[seq].wait(), 30)
            if i >= 20:  # the first ones warm the stream up
                signed.append(received[seq] - acked)
                samples.append(max(0.0, received[seq] - acked))
        stream.cancel()
        watcher.cancel()
        samples.sort()
        p50, p99 = samples[len(samples) // 2], samples[int(len(samples) * 0.99)]
        early = sum(1 for d in signed if d <= 0)
        print(
            f"{label}: ack→watcher p50 {p50 * 1000:.2f} ms, p99 {p99 * 1000:.2f} ms over "
            f"{len(samples)} appends ({early} reached the watcher before the appender got its "
            f"ack; signed median {_median(signed) * 1000:+.2f} ms)",
            flush=True,
        )
        return p50 * 1000


def _spawn_server(url: str, tokens_file: Any) -> Any:
    """`oma serve session` in its own process, so the client's CPU is not the server's."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "oma.cli.main", "serve", "session"]
    command += ["--listen", "127.0.0.1:0", "--db", url, "--tokens", str(tokens_file)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _events(prefix: str, batch: int, size: int) -> list[Any]:
    from oma.session.v1 import events_pb2

    return [
        events_pb2.Event(
            id=f"{prefix}-{batch}-{i}",
            user_message=events_pb2.UserMessage(
                content=[events_pb2.ContentBlock(text=f"message {batch}.{i} of the benchmark")]
            ),
        )
        for i in range(size)
    ]


def _body_factory() -> Any:
    import time

    from oma.session.v1 import events_pb2

    now_us = time.time_ns() // 1000

    def body(seq: int) -> bytes:
        event = events_pb2.Event(
            id=f"bulk-{seq}",
            seq=seq,
            type="user.message",
            user_message=events_pb2.UserMessage(
                content=[events_pb2.ContentBlock(text=f"bulk message {seq}")]
            ),
        )
        event.create_time.FromMicroseconds(now_us)
        return event.SerializeToString()

    return body


def _prepare(events: list[Any], last_seq: int, now_us: int) -> list[tuple[int, str, bytes]]:
    rows = []
    for offset, event in enumerate(events, start=1):
        event.seq = last_seq + offset
        event.type = "user.message"
        event.create_time.FromMicroseconds(now_us)
        rows.append((event.seq, event.id, event.SerializeToString()))
    return rows


def _sqlite_batch(conn: Any, sid: str, events: list[Any]) -> None:
    """What AppendEvents does, straight on sqlite3: lock, dedupe, allocate seqs, insert, update."""
    import time

    ids = [e.id for e in events]
    conn.execute("BEGIN IMMEDIATE")
    try:
        pk, last_seq, status = conn.execute(
            "SELECT pk, last_seq, status FROM oma_sessions WHERE id=?", (sid,)
        ).fetchone()
        marks = ",".join("?" * len(ids))
        known = conn.execute(
            f"SELECT event_id, seq FROM oma_events WHERE session_pk=? AND event_id IN ({marks})",
            (pk, *ids),
        ).fetchall()
        if known or status == 4:
            raise RuntimeError("benchmark ids collided")
        now_us = time.time_ns() // 1000
        rows = _prepare(events, last_seq, now_us)
        conn.executemany(
            "INSERT INTO oma_events (session_pk, seq, event_id, type, body) "
            "VALUES (?, ?, ?, 'user.message', ?)",
            [(pk, seq, event_id, body) for seq, event_id, body in rows],
        )
        new_last = last_seq + len(rows)
        conn.execute(
            "UPDATE oma_sessions SET last_seq=?, last_user_seq=?, update_time_us=? WHERE pk=?",
            (new_last, new_last, now_us, pk),
        )
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


async def _pg_batch(conn: Any, sid: str, events: list[Any]) -> None:
    """What AppendEvents does, straight on asyncpg: row lock, dedupe, allocate, insert, update."""
    import time

    ids = [e.id for e in events]
    async with conn.transaction():
        row = await conn.fetchrow(
            "SELECT pk, last_seq, status FROM oma_sessions WHERE id=$1 FOR UPDATE", sid
        )
        known = await conn.fetch(
            "SELECT event_id, seq FROM oma_events WHERE session_pk=$1 AND event_id = ANY($2)",
            row["pk"],
            ids,
        )
        if known or row["status"] == 4:
            raise RuntimeError("benchmark ids collided")
        now_us = time.time_ns() // 1000
        rows = _prepare(events, row["last_seq"], now_us)
        await conn.executemany(
            "INSERT INTO oma_events (session_pk, seq, event_id, type, body) "
            "VALUES ($1, $2, $3, 'user.message', $4)",
            [(row["pk"], seq, event_id, body) for seq, event_id, body in rows],
        )
        new_last = row["last_seq"] + len(rows)
        await conn.execute(
            "UPDATE oma_sessions SET last_seq=$1, last_user_seq=$1, update_time_us=$2 WHERE pk=$3",
            new_last,
            now_us,
            row["pk"],
        )
