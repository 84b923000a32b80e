"""The runtime's pieces on their own: token table and file, trace parsing, method rules,
authorization decisions, errors, CLI flags — plus the fail-closed rule over a real server."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import stat
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest

from oma.runtime import auth, paths, trace
from oma.runtime._handlers import authorize
from oma.runtime.auth import MethodRule, TokenTable, method_rule
from oma.runtime.cli import add_server_arguments, announce, server_options_from_args
from oma.runtime.errors import OmaError, error_info
from oma.runtime.server import ServerOptions, Service, start_server

ROOT = Path(__file__).resolve().parents[2]


# --- tokens -------------------------------------------------------------------------------


def test_generated_table_has_one_distinct_token_per_role() -> None:
    table = TokenTable.generate()
    tokens = {role: table.token_for(role) for role in auth.ROLES}
    assert len(set(tokens.values())) == len(auth.ROLES)
    for role, token in tokens.items():
        assert table.role_of(token) == role
    assert table.role_of("x" * 43) is None
    assert table.role_of("") is None


def test_token_file_round_trips_with_mode_0600(tmp_path: Path) -> None:
    table = TokenTable.generate()
    path = tmp_path / "sub" / "tokens.json"
    table.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    data = json.loads(path.read_text())
    assert set(data) == set(auth.ROLES)
    loaded = TokenTable.load(path)
    assert all(loaded.token_for(r) == table.token_for(r) for r in auth.ROLES)


def test_overwriting_a_loose_token_file_tightens_it_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tokens.json"
    path.write_text("{}")
    path.chmod(0o644)
    modes: list[int] = []
    real_dump = json.dump

    def dump_noting_the_mode(*args: Any, **kwargs: Any) -> None:
        modes.append(stat.S_IMODE(path.stat().st_mode))
        real_dump(*args, **kwargs)

    monkeypatch.setattr(auth.json, "dump", dump_noting_the_mode)
    TokenTable.generate().save(path)
    assert modes == [0o600]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_loading_a_world_readable_token_file_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tokens.json"
    TokenTable.generate().save(path)
    with caplog.at_level(logging.WARNING, logger="oma.runtime"):
        TokenTable.load(path)
    assert not caplog.records
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="oma.runtime"):
        TokenTable.load(path)
    assert "chmod 600" in caplog.text


def test_token_table_accepts_several_tokens_per_role_for_rotation() -> None:
    table = TokenTable({"client": ["a" * 20, "b" * 20]})
    assert table.role_of("a" * 20) == table.role_of("b" * 20) == "client"
    assert table.token_for("client") == "a" * 20
    with pytest.raises(KeyError, match="no token for role 'admin'"):
        table.token_for("admin")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[]", "JSON object"),
        ('{"root": "' + "x" * 20 + '"}', "unknown role 'root'"),
        ('{"client": "short"}', "16\\+ characters"),
    ],
)
def test_bad_token_files_are_rejected_with_the_path(
    tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "tokens.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as caught:
        TokenTable.load(path)
    assert str(path) in str(caught.value)
    with pytest.raises(ValueError, match="does not exist"):
        TokenTable.load(tmp_path / "missing.json")


def test_default_tokens_file_is_created_once_in_oma_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMA_HOME", str(tmp_path / "home"))
    assert paths.data_dir() == tmp_path / "home"
    assert paths.default_tokens_file() == tmp_path / "home" / "tokens.json"
    created = paths.ensure_tokens_file()
    assert created == paths.default_tokens_file()
    assert stat.S_IMODE(created.stat().st_mode) == 0o600
    first = TokenTable.load(created).token_for("admin")
    paths.ensure_tokens_file()
    assert TokenTable.load(created).token_for("admin") == first  # never overwritten
    assert list(created.parent.iterdir()) == [created]  # no staging file left behind


def test_data_dir_defaults_to_home(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMA_HOME", raising=False)
    assert paths.data_dir() == Path.home() / ".oma"


# --- trace context ----------------------------------------------------------------------


def test_traceparent_parsing_follows_w3c() -> None:
    good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    ctx = trace.parse(good, "a=1")
    assert ctx is not None and ctx.traceparent == good and ctx.tracestate == "a=1"
    assert trace.parse(good.upper()) is not None
    for bad in [
        None,
        "",
        "garbage",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
    ]:
        assert trace.parse(bad) is None, bad
    # A future version may carry more fields; its first four are still read.
    assert trace.parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-xyz") is not None


def test_trace_context_from_metadata_and_children() -> None:
    ctx = trace.from_metadata(
        [
            ("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            ("tracestate", "a=1"),
            ("tracestate", "b=2"),
            ("x-bin", b"\x00"),
        ]
    )
    assert ctx is not None and ctx.tracestate == "a=1,b=2"
    child = ctx.child()
    assert child.trace_id == ctx.trace_id and child.parent_id != ctx.parent_id
    assert trace.current() is None
    assert trace.outgoing().trace_id != ctx.trace_id  # outside any trace: a new one
    with trace.use(ctx):
        assert trace.current() == ctx
        assert trace.outgoing().trace_id == ctx.trace_id
    assert trace.current() is None


# --- method rules and authorization -----------------------------------------------------


def test_rules_come_from_the_contract_and_unknown_methods_are_admin_only() -> None:
    importlib.import_module("oma.session.v1.session_service_pb2")
    rule = method_rule("/oma.session.v1.SessionService/AcquireLease")
    assert rule.declared and rule.roles == frozenset({"harness"})
    assert rule.allows("harness") and rule.allows("admin") and not rule.allows("client")
    unknown = method_rule("/no.such.v1.Service/Method")
    assert not unknown.declared and unknown.roles == frozenset()
    assert unknown.allows("admin") and not unknown.allows("client")


def test_authorize_names_method_and_roles_in_every_refusal() -> None:
    tokens = TokenTable.generate()
    rule = MethodRule("/p.S/M", frozenset({"client"}))

    def refusal(header: str | None) -> OmaError:
        with pytest.raises(OmaError) as caught:
            authorize(rule, header, tokens)
        return caught.value

    missing = refusal(None)
    assert (missing.code, missing.reason) == (grpc.StatusCode.UNAUTHENTICATED, "TOKEN_MISSING")
    assert "/p.S/M" in missing.message and "client, admin" in missing.message
    assert refusal("Bearer").reason == "TOKEN_INVALID"
    assert refusal("Token abc").reason == "TOKEN_INVALID"
    assert refusal("Bearer " + "z" * 43).reason == "TOKEN_INVALID"
    denied = refusal("Bearer " + tokens.token_for("harness"))
    assert (denied.code, denied.reason) == (grpc.StatusCode.PERMISSION_DENIED, "ROLE_FORBIDDEN")
    assert "'harness'" in denied.message and "client, admin" in denied.message
    assert authorize(rule, "bearer " + tokens.token_for("client"), tokens) == "client"
    assert authorize(rule, "Bearer " + tokens.token_for("admin"), tokens) == "admin"
    open_rule = MethodRule("/p.S/Proxy", frozenset(), request_authenticated=True)
    assert authorize(open_rule, None, tokens) is None
    assert authorize(open_rule, "Bearer nonsense", tokens) is None
    assert authorize(open_rule, "Bearer " + tokens.token_for("harness"), tokens) == "harness"


# --- errors -----------------------------------------------------------------------------


def test_oma_error_rejects_unknown_reasons_and_ok() -> None:
    with pytest.raises(ValueError, match="unknown error reason 'LEASE_LOSTT'"):
        OmaError(grpc.StatusCode.ABORTED, "LEASE_LOSTT", "typo")
    with pytest.raises(ValueError, match="OK"):
        OmaError(grpc.StatusCode.OK, "INTERNAL", "not an error")
    error = OmaError(grpc.StatusCode.ABORTED, "SEQUENCE_MISMATCH", "m", {"last_seq": 41})  # type: ignore[dict-item]
    status = error.to_status()
    assert status.code == grpc.StatusCode.ABORTED.value[0] and status.message == "m"
    assert error.metadata == {"last_seq": "41"}


def test_error_info_is_none_without_rich_status() -> None:
    class Plain:
        def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
            return (("x", "y"),)

    assert error_info(Plain()) is None
    assert error_info(object()) is None


# --- CLI flags --------------------------------------------------------------------------


def _parse(argv: list[str], default_listen: str = "127.0.0.1:7400") -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser, default_listen=default_listen)
    return parser.parse_args(argv)


def test_cli_flags_become_server_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMA_HOME", str(tmp_path / "home"))
    options = server_options_from_args(_parse([]))
    assert options.listen == "127.0.0.1:7400" and options.tls is None
    assert (tmp_path / "home" / "tokens.json").exists()  # created on first use
    cert, key, ca = (tmp_path / n for n in ("c.pem", "k.pem", "ca.pem"))
    for file in (cert, key, ca):
        file.write_text("x")
    tokens = tmp_path / "t.json"
    TokenTable.generate().save(tokens)
    options = server_options_from_args(
        _parse(
            [
                "--listen=unix:/tmp/x.sock",
                f"--tls-cert={cert}",
                f"--tls-key={key}",
                f"--tls-client-ca={ca}",
                f"--tokens={tokens}",
                "--grace-seconds=3",
                "--max-message-bytes=1000",
            ]
        )
    )
    assert options.listen == "unix:/tmp/x.sock"
    assert options.tls is not None and options.tls.client_ca == ca
    assert options.grace_seconds == 3 and options.max_message_bytes == 1000
    assert options.tokens.token_for("admin") == TokenTable.load(tokens).token_for("admin")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tls-key=k.pem"], "together"),
        (["--tls-cert=missing.pem", "--tls-key=missing.pem"], "no such file"),
        (["--tokens=missing.json"], "does not exist"),
        (["--grace-seconds=-1"], ">= 0"),
    ],
)
def test_bad_cli_flags_say_what_is_wrong(
    argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMA_HOME", str(tmp_path / "home"))
    with pytest.raises(SystemExit, match=message):
        server_options_from_args(_parse(argv))


async def test_announce_prints_the_ready_line(capsys: pytest.CaptureFixture[str]) -> None:
    class Running:
        address = "127.0.0.1:1234"

    announce("session", Running())  # type: ignore[arg-type]
    assert capsys.readouterr().out == "oma session serving on 127.0.0.1:1234\n"


# --- fail closed, over a real server ----------------------------------------------------


@pytest.fixture(scope="module")
def fail_closed_module(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModuleType, ModuleType]:
    """Compile the test-only proto under tests/runtime/protos with grpc_tools."""
    import grpc_tools

    out = tmp_path_factory.mktemp("gen")
    protos = Path(__file__).with_name("protos")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{protos}",
            f"-I{ROOT / 'proto'}",
            f"-I{Path(grpc_tools.__file__).parent / '_proto'}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            "omatest/runtime/v1/probe.proto",
        ],
        check=True,
    )
    sys.path.insert(0, str(out))
    try:
        pb = importlib.import_module("omatest.runtime.v1.probe_pb2")
        pb_grpc = importlib.import_module("omatest.runtime.v1.probe_pb2_grpc")
    finally:
        sys.path.remove(str(out))
    return pb, pb_grpc


async def test_methods_without_a_rule_are_admin_only(
    fail_closed_module: tuple[ModuleType, ModuleType],
) -> None:
    pb, pb_grpc = fail_closed_module

    class Servicer(pb_grpc.FailClosedServiceServicer):  # type: ignore[name-defined,misc]
        async def Undeclared(self, request: Any, context: Any) -> Any:
            return pb.PingResponse()

        async def EmptyRule(self, request: Any, context: Any) -> Any:
            return pb.PingResponse()

        async def ClientRule(self, request: Any, context: Any) -> Any:
            return pb.PingResponse()

    from oma.runtime.client import connect

    tokens = TokenTable.generate()
    running = await start_server(
        [
            Service(
                Servicer(),
                pb_grpc.add_FailClosedServiceServicer_to_server,
                "omatest.runtime.v1.FailClosedService",
            )
        ],
        ServerOptions(tokens=tokens),
    )
    try:
        for role in ("client", "harness", "sandbox_server"):
            async with connect(running.address, token=tokens.token_for(role)) as channel:
                stub = pb_grpc.FailClosedServiceStub(channel)
                for method in (stub.Undeclared, stub.EmptyRule):
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await method(pb.PingRequest())
                    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
                    assert "roles accepted: admin" in (caught.value.details() or "")
                if role == "client":
                    await stub.ClientRule(pb.PingRequest())
        async with connect(running.address, token=tokens.token_for("admin")) as channel:
            stub = pb_grpc.FailClosedServiceStub(channel)
            await stub.Undeclared(pb.PingRequest())
            await stub.EmptyRule(pb.PingRequest())
            await stub.ClientRule(pb.PingRequest())
    finally:
        await running.stop(0)


async def test_unknown_service_names_are_refused_at_start() -> None:
    with pytest.raises(ValueError, match="not in the protobuf descriptor pool"):
        await start_server(
            [Service(object(), lambda s, server: None, "oma.nope.v1.NopeService")],
            ServerOptions(tokens=TokenTable.generate()),
        )
