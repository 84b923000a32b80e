"""`oma model-server` as a process, the script file format, and the bundled demo script."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anthropic
import pytest
from model_server_scripts import MODEL, TOOLS

from oma.servers.harness.model_server import (
    DEMO_SCRIPT,
    EXAMPLES_DIR,
    ScriptError,
    load_script_file,
    parse_scripts,
    start_model_server,
)
from oma.servers.harness.model_server.ttft import Ttft

ADDRESS = re.compile(r"listening on (http://\S+)")


async def _start_cli(*args: str) -> tuple[asyncio.subprocess.Process, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "oma.cli.main",
        "model-server",
        "--listen",
        "127.0.0.1:0",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    line = (await asyncio.wait_for(process.stdout.readline(), 60)).decode()
    match = ADDRESS.search(line)
    if not match:
        process.kill()
        _, err = await process.communicate()
        pytest.fail(f"no address in {line!r}; stderr: {err.decode()}")
    return process, match.group(1)


async def test_cli_serves_a_script_file_and_stops_on_sigterm(tmp_path: Path) -> None:
    script = tmp_path / "one.json"
    script.write_text(json.dumps({"name": "one", "turns": [{"text": "from the CLI"}]}))
    process, base_url = await _start_cli("--script", str(script), "--ttft", "uniform:0,5")
    try:
        async with anthropic.AsyncAnthropic(
            base_url=base_url, api_key="k", max_retries=0
        ) as client:
            message = await client.messages.create(
                model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "hi"}]
            )
        assert message.content[0].text == "from the CLI"
    finally:
        process.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(process.wait(), 30)
    assert code == 0


async def test_cli_defaults_to_the_demo_script() -> None:
    process, base_url = await _start_cli()
    try:
        async with anthropic.AsyncAnthropic(
            base_url=base_url, api_key="k", max_retries=0
        ) as client:
            message = await client.messages.create(
                model=MODEL,
                max_tokens=10,
                tools=TOOLS,
                messages=[{"role": "user", "content": "demo"}],
            )
        assert message.stop_reason == "tool_use"
    finally:
        process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.wait(), 30)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--script", "/nonexistent/script.json"], "No such file"),
        (["--ttft", "gaussian:1"], "expected fixed:MS"),
        (["--ttft", "fixed:5", "--ttft-ms", "5"], "not both"),
    ],
)
def test_cli_rejects_bad_arguments(args: list[str], fragment: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "oma.cli.main", "model-server", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert fragment in result.stderr


def test_script_shapes() -> None:
    turns = [{"text": "a"}]
    assert list(parse_scripts(turns).scripts) == ["default"]
    named = parse_scripts({"name": "x", "turns": turns})
    assert list(named.scripts) == ["x"] and named.default == "x"
    many = parse_scripts({"scripts": {"a": turns, "b": {"turns": turns}}})
    assert many.default is None and sorted(many.scripts) == ["a", "b"]
    tool_turn = parse_scripts([{"content": [{"type": "tool_use", "name": "bash", "input": {}}]}])
    assert tool_turn.scripts["default"].turns[0].stop_reason == "tool_use"


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ([], "non-empty list of turns"),
        ([{"content": []}], "non-empty `content`"),
        ([{"content": [{"type": "image"}]}], "type one of text, tool_use, thinking"),
        ([{"content": [{"type": "tool_use", "name": "x"}]}], "object `input`"),
        ([{"text": "a", "stop_reason": "done"}], "stop_reason must be one of"),
        ([{"text": "a", "fail": {"status": 529}}], 'expected {"error"'),
        ({"scripts": {"a": [{"text": "a"}]}, "default": "b"}, "default script 'b'"),
    ],
)
def test_bad_scripts_are_refused_with_the_place(raw: Any, fragment: str) -> None:
    with pytest.raises(ScriptError) as caught:
        parse_scripts(raw)
    assert fragment in str(caught.value)


def test_yaml_script(tmp_path: Path) -> None:
    path = tmp_path / "greeting.yaml"
    path.write_text(
        "- text: hello from YAML\n"
        "- content:\n"
        "  - {type: tool_use, name: bash, input: {command: ls}}\n"
    )
    book = load_script_file(path)
    assert book.default == "greeting"
    turns = book.scripts["greeting"].turns
    assert turns[0].content[0]["text"] == "hello from YAML"
    assert turns[1].stop_reason == "tool_use"


def test_every_bundled_example_loads() -> None:
    examples = sorted(EXAMPLES_DIR.glob("*.json"))
    assert DEMO_SCRIPT in examples
    for path in examples:
        assert load_script_file(path).scripts


def test_ttft_specs() -> None:
    assert Ttft.parse("50").sample_ms() == 50
    assert Ttft.parse("fixed:12.5").sample_ms() == 12.5
    uniform = Ttft.parse("uniform:10,20", seed=1)
    assert all(10 <= uniform.sample_ms() <= 20 for _ in range(100))
    lognormal = Ttft.parse("lognormal:50,0.5", seed=1)
    draws = sorted(lognormal.sample_ms() for _ in range(1001))
    assert 35 < draws[500] < 70  # the median sits near 50
    assert draws[-1] > draws[500] * 1.5  # with a right tail
    for bad in ("lognormal:50", "fixed:-1", "uniform:5,1", "fixed:x"):
        with pytest.raises(ValueError):
            Ttft.parse(bad)


async def test_demo_script_writes_runs_and_answers(tmp_path: Path) -> None:
    """Play the demo as a harness would, running its tools for real in a temporary directory."""
    server = await start_model_server(DEMO_SCRIPT)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Write and run a small program."}]
    seen: list[str] = []
    outputs: list[str] = []
    try:
        async with anthropic.AsyncAnthropic(
            base_url=server.base_url, api_key="k", max_retries=0
        ) as client:
            for _ in range(5):
                async with client.messages.stream(
                    model=MODEL,
                    max_tokens=1000,
                    tools=TOOLS,
                    messages=messages,
                    system="[script:demo]",
                ) as stream:
                    final = await stream.get_final_message()
                messages.append({"role": "assistant", "content": final.content})
                if final.stop_reason != "tool_use":
                    break
                results = []
                for block in final.content:
                    if block.type != "tool_use":
                        continue
                    seen.append(block.name)
                    args: dict[str, str] = block.input
                    if block.name == "write":
                        (tmp_path / args["path"]).write_text(args["content"])
                        output = f"wrote {args['path']}"
                    else:
                        command = args["command"].replace("python3", sys.executable)
                        run = await asyncio.create_subprocess_shell(
                            command,
                            cwd=tmp_path,
                            stdout=asyncio.subprocess.PIPE,
                            stderr=asyncio.subprocess.PIPE,
                        )
                        out, err = await asyncio.wait_for(run.communicate(), 60)
                        assert run.returncode == 0, err.decode()
                        output = out.decode()
                        outputs.append(output)
                    results.append(
                        {"type": "tool_result", "tool_use_id": block.id, "content": output}
                    )
                messages.append({"role": "user", "content": results})
        assert server.rejections() == []
    finally:
        await server.stop()
    assert seen == ["write", "bash"]
    assert "count: 15" in outputs[0]
    answer = final.content[0].text
    assert final.stop_reason == "end_turn" and "15 primes" in answer
