"""The built-in tools and the output contract, on both backends."""

from __future__ import annotations

import grpc
from google.protobuf import duration_pb2
from sandbox_helpers import SandboxServer, expect_error

INVALID = grpc.StatusCode.INVALID_ARGUMENT


async def test_bash_runs_in_the_workspace_and_failures_are_results(
    sandbox_server: SandboxServer, sandbox_id: str
) -> None:
    ok = await sandbox_server.bash(sandbox_id, "pwd; echo out; echo err >&2")
    assert not ok.is_error and ok.exit_code == 0
    assert ok.output == "/workspace\nout\nerr\n"
    failed = await sandbox_server.bash(sandbox_id, "echo before; exit 7")
    assert failed.is_error and failed.exit_code == 7 and not failed.timed_out
    assert failed.output == "before\n"
    # Each call is a fresh process: shell state does not carry over, files do.
    await sandbox_server.bash(sandbox_id, "export GONE=1; cd /tmp; echo kept > /workspace/note.txt")
    state = await sandbox_server.bash(sandbox_id, 'echo "[${GONE:-}]"; pwd; cat note.txt')
    assert state.output == "[]\n/workspace\nkept\n"


async def test_write_read_edit(sandbox_server: SandboxServer, sandbox_id: str) -> None:
    wrote = await sandbox_server.execute(
        sandbox_id, "write", {"path": "src/app.py", "content": "a = 1\nb = 2\na = 1\n"}
    )
    assert not wrote.is_error, wrote.output
    read = await sandbox_server.execute(sandbox_id, "read", {"path": "/workspace/src/app.py"})
    assert read.output == "1\ta = 1\n2\tb = 2\n3\ta = 1"
    window = await sandbox_server.execute(
        sandbox_id, "read", {"path": "src/app.py", "offset": 2, "limit": 1}
    )
    assert window.output == "2\tb = 2"

    ambiguous = await sandbox_server.execute(
        sandbox_id, "edit", {"path": "src/app.py", "old_string": "a = 1", "new_string": "a = 3"}
    )
    assert ambiguous.is_error and "occurs 2 times" in ambiguous.output
    missing = await sandbox_server.execute(
        sandbox_id, "edit", {"path": "src/app.py", "old_string": "zzz", "new_string": "y"}
    )
    assert missing.is_error and "not found" in missing.output
    unique = await sandbox_server.execute(
        sandbox_id, "edit", {"path": "src/app.py", "old_string": "b = 2", "new_string": "b = 5"}
    )
    assert not unique.is_error, unique.output
    every = await sandbox_server.execute(
        sandbox_id,
        "edit",
        {"path": "src/app.py", "old_string": "a = 1", "new_string": "a = 0", "replace_all": True},
    )
    assert not every.is_error, every.output
    content = await sandbox_server.bash(sandbox_id, "cat src/app.py")
    assert content.output == "a = 0\nb = 5\na = 0\n"

    absent = await sandbox_server.execute(sandbox_id, "read", {"path": "nope.txt"})
    assert absent.is_error and "does not exist" in absent.output


async def test_glob_and_grep(sandbox_server: SandboxServer, sandbox_id: str) -> None:
    await sandbox_server.bash(
        sandbox_id,
        "mkdir -p pkg/sub && echo 'def hello():' > pkg/a.py && echo 'HELLO = 1' > pkg/sub/b.py"
        " && echo hello > notes.txt",
    )
    found = await sandbox_server.execute(sandbox_id, "glob", {"pattern": "**/*.py"})
    assert sorted(found.output.splitlines()) == ["pkg/a.py", "pkg/sub/b.py"]
    none = await sandbox_server.execute(sandbox_id, "glob", {"pattern": "*.rs"})
    assert not none.is_error and none.output == "No files found."

    grep = await sandbox_server.execute(
        sandbox_id, "grep", {"pattern": "hel+o", "ignore_case": True, "glob": "*.py"}
    )
    assert sorted(grep.output.splitlines()) == [
        "pkg/a.py:1:def hello():",
        "pkg/sub/b.py:1:HELLO = 1",
    ]
    files = await sandbox_server.execute(
        sandbox_id, "grep", {"pattern": "hello", "files_with_matches": True, "path": "pkg"}
    )
    assert files.output.splitlines() == ["pkg/a.py"]
    broken = await sandbox_server.execute(sandbox_id, "grep", {"pattern": "("})
    assert broken.is_error and broken.exit_code == 1 and broken.output
    nothing = await sandbox_server.execute(sandbox_id, "grep", {"pattern": "absent-text"})
    assert not nothing.is_error and nothing.output == "No matches found."


async def test_bad_input_gets_its_documented_error(
    sandbox_server: SandboxServer, sandbox_id: str
) -> None:
    await expect_error(
        sandbox_server.execute(sandbox_id, "python", {"code": "1"}), INVALID, "UNKNOWN_TOOL"
    )
    await expect_error(
        sandbox_server.execute(sandbox_id, "bash", '{"command": "echo'),
        INVALID,
        "INVALID_TOOL_INPUT",
    )
    await expect_error(
        sandbox_server.execute(sandbox_id, "bash", "[1, 2]"), INVALID, "INVALID_TOOL_INPUT"
    )
    await expect_error(
        sandbox_server.execute(sandbox_id, "read", {"offset": 3}), INVALID, "INVALID_TOOL_INPUT"
    )
    await expect_error(
        sandbox_server.execute(sandbox_id, "read", {"path": "../../etc/passwd"}),
        INVALID,
        "PATH_OUTSIDE_WORKSPACE",
    )
    await expect_error(
        sandbox_server.execute(sandbox_id, "write", {"path": "/etc/evil", "content": "x"}),
        INVALID,
        "PATH_OUTSIDE_WORKSPACE",
    )
    # A symbolic link inside the workspace does not lead the file tools out of it.
    await sandbox_server.bash(sandbox_id, "ln -s /etc escape")
    await expect_error(
        sandbox_server.execute(sandbox_id, "read", {"path": "escape/passwd"}),
        INVALID,
        "PATH_OUTSIDE_WORKSPACE",
    )
    await expect_error(
        sandbox_server.execute("sb-000000000000000000000000", "bash", {"command": "true"}),
        grpc.StatusCode.NOT_FOUND,
        "SANDBOX_NOT_FOUND",
    )


async def test_huge_output_is_truncated_with_the_whole_kept_inside(
    sandbox_server: SandboxServer, sandbox_id: str
) -> None:
    cap = sandbox_server.manager.limits.max_output_bytes
    total = cap * 4
    result = await sandbox_server.bash(
        sandbox_id, f"head -c {total} /dev/zero | tr '\\0' 'x'; echo; echo THE-END"
    )
    assert result.output_truncated and not result.is_error
    assert result.full_output_bytes == total + len("\nTHE-END\n")
    assert len(result.output.encode()) <= cap + 512
    assert f"{result.full_output_bytes} bytes in total" in result.output
    assert result.full_output_path in result.output
    assert result.output.rstrip().endswith("THE-END")  # the tail survives truncation
    size = await sandbox_server.bash(sandbox_id, f"wc -c < {result.full_output_path}")
    assert int(size.output) == result.full_output_bytes


async def test_binary_output_is_replaced_and_flagged(
    sandbox_server: SandboxServer, sandbox_id: str
) -> None:
    result = await sandbox_server.bash(sandbox_id, r"printf 'ok\xff\xfe\n'; printf 'caf\xc3\xa9\n'")
    assert result.invalid_utf8_replaced
    assert result.output == "ok\ufffd\ufffd\ncafé\n"
    await sandbox_server.bash(sandbox_id, r"printf 'bad \xff byte\n' > latin.txt")
    read = await sandbox_server.execute(sandbox_id, "read", {"path": "latin.txt"})
    assert read.invalid_utf8_replaced and read.output == "1\tbad \ufffd byte"
    clean = await sandbox_server.bash(sandbox_id, "printf 'café\\n'")
    assert not clean.invalid_utf8_replaced and clean.output == "café\n"


async def test_a_command_that_never_ends_is_killed_with_its_group(
    sandbox_server: SandboxServer, sandbox_id: str
) -> None:
    result = await sandbox_server.bash(
        sandbox_id,
        "echo started; (sleep 1000; echo never > leaked.txt) & sleep 1000",
        timeout=duration_pb2.Duration(seconds=1),
    )
    assert result.timed_out and result.is_error
    assert result.output.startswith("started\n")
    assert "timed out after 1000 ms" in result.output
    # The background job of the call died with it.
    survivors = await sandbox_server.bash(sandbox_id, "ps -eo args | grep -c '^sleep 1000' || true")
    assert survivors.output.strip() == "0"
    via_input = await sandbox_server.execute(
        sandbox_id, "bash", {"command": "sleep 1000", "timeout_ms": 300}
    )
    assert via_input.timed_out and via_input.exit_code == 137
