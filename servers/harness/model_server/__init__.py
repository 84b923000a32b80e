"""A scripted Anthropic Messages API server for tests, demos and benchmarks.

It plays scripted assistant turns (see `script.py` for the file format) to any client of the
Messages API, in particular the real `anthropic` SDK pointed at `base_url`; validates each
request as strictly as the real API (`validate.py`); simulates prompt caching in its usage
figures (`cache.py`); and waits a configurable time to first token (`ttft.py`).

    server = await start_model_server("examples/demo.json", ttft="fixed:20")
    client = anthropic.AsyncAnthropic(base_url=server.base_url, api_key="test", max_retries=0)
    ...
    assert server.rejections() == []
    await server.stop()
"""

from pathlib import Path

from oma.servers.harness.model_server.app import ServerState, build_app
from oma.servers.harness.model_server.script import (
    Failure,
    Script,
    ScriptBook,
    ScriptError,
    Turn,
    load_script_file,
    parse_scripts,
)
from oma.servers.harness.model_server.server import (
    AsyncModelServer,
    ModelServer,
    ThreadedModelServer,
    fetch_rejections,
    start_model_server,
    start_model_server_in_thread,
)
from oma.servers.harness.model_server.ttft import Ttft

EXAMPLES_DIR = Path(__file__).parent / "examples"
DEMO_SCRIPT = EXAMPLES_DIR / "demo.json"

__all__ = [
    "DEMO_SCRIPT",
    "EXAMPLES_DIR",
    "AsyncModelServer",
    "Failure",
    "ModelServer",
    "Script",
    "ScriptBook",
    "ScriptError",
    "ServerState",
    "ThreadedModelServer",
    "Ttft",
    "Turn",
    "build_app",
    "fetch_rejections",
    "load_script_file",
    "parse_scripts",
    "start_model_server",
    "start_model_server_in_thread",
]
