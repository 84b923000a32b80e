"""Real loopback HTTP servers the vault tests talk to: an echoing upstream that reflects the
secret back in every encoding the scrubber must remove, an OAuth token endpoint, a git
server (`git http-backend` behind basic auth) and an MCP server (streamable HTTP) that
rejects calls without the OAuth token."""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import os
import re
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, quote_plus

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route


class LoopbackServer:
    """A uvicorn server for `app` on 127.0.0.1 and a free port, in the running event loop."""

    def __init__(self, app: object) -> None:
        self.config = uvicorn.Config(
            app, host="127.0.0.1", port=0, log_level="warning", lifespan="auto", access_log=False
        )
        self.server = uvicorn.Server(self.config)
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self.task: asyncio.Task[None] | None = None
        self.port = 0

    async def start(self) -> LoopbackServer:
        self.task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self.task.done():
                self.task.result()
            await asyncio.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task


def secret_of(request: Request) -> str:
    """The secret the vault injected, whatever the credential kind."""
    if "x-api-key" in request.headers:
        return request.headers["x-api-key"]
    auth = request.headers.get("authorization", "")
    if auth.startswith("Bearer "):
        return auth.removeprefix("Bearer ")
    if auth.startswith("Basic "):
        return base64.b64decode(auth.removeprefix("Basic ")).decode().partition(":")[2]
    return request.headers.get("x-api-key", "")


def echo_forms(secret: str) -> dict[str, str]:
    """Every encoding of `secret` the contract says must be scrubbed (the test checks that
    none of these strings survives)."""
    raw = secret.encode()
    forms = {"plain": secret}
    for i, prefix in enumerate([b"", b"a", b"ab"]):
        forms[f"base64_{i}"] = base64.b64encode(prefix + raw + b"tail").decode()
        forms[f"base64url_{i}"] = base64.urlsafe_b64encode(prefix + raw).decode()
    forms["basic_header"] = base64.b64encode(b"someone:" + raw).decode()
    forms["url"] = quote(secret, safe="")
    forms["url_lower"] = re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), forms["url"])
    forms["url_plus"] = quote_plus(secret)
    forms["json"] = json.dumps(secret)[1:-1]
    return {k: v for k, v in forms.items() if v}


MARKER = "upstream-was-here"


async def forms(request: Request) -> Response:
    secret = secret_of(request)
    found = echo_forms(secret)
    # One JSON document holding each form inside a string, plus the raw forms after it.
    body = (
        json.dumps({"marker": MARKER, "json_inside": secret, **found})
        + "\n"
        + "\n".join(f"{k}={v}" for k, v in found.items())
    ).encode()
    headers = {
        "X-Echo": secret,
        "X-Echo-B64": base64.b64encode(secret.encode()).decode(),
        "Set-Cookie": f"sid={quote(secret, safe='')}; Path=/",
        "Content-Type": "text/plain",
    }
    if request.query_params.get("gzip"):
        headers["Content-Encoding"] = "gzip"
        body = gzip.compress(body)
    return Response(body, headers=headers)


async def stream(request: Request) -> Response:
    """Server-sent events with the secret split across many tiny chunks."""
    secret = secret_of(request)
    payload = "".join(
        f"data: {MARKER} {i} {form}\n\n" for i, form in enumerate(echo_forms(secret).values())
    ).encode()
    step = int(request.query_params.get("step", "3"))

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(payload), step):
            yield payload[i : i + step]
            await asyncio.sleep(0)

    gz = request.query_params.get("gzip")
    if gz:
        compressed = gzip.compress(payload)

        async def gz_chunks() -> AsyncIterator[bytes]:
            for i in range(0, len(compressed), 7):
                yield compressed[i : i + 7]

        return StreamingResponse(
            gz_chunks(), media_type="text/event-stream", headers={"Content-Encoding": "gzip"}
        )
    return StreamingResponse(chunks(), media_type="text/event-stream")


async def whoami(request: Request) -> Response:
    expected = request.app.state.expected
    if secret_of(request) != expected:
        return PlainTextResponse("who are you?", status_code=401)
    return JSONResponse(
        {
            "ok": True,
            "method": request.method,
            "body": (await request.body()).decode(),
            "headers": {
                k: v for k, v in request.headers.items() if k not in ("authorization", "x-api-key")
            },
        }
    )


async def big(request: Request) -> Response:
    size = int(request.query_params["size"])
    chunk = b"0123456789abcdef" * 4096

    async def body() -> AsyncIterator[bytes]:
        sent = 0
        while sent < size:
            piece = chunk[: size - sent]
            sent += len(piece)
            yield piece

    return StreamingResponse(body(), media_type="application/octet-stream")


async def slow(request: Request) -> Response:
    await asyncio.sleep(float(request.query_params.get("seconds", "10")))
    return PlainTextResponse("late")


async def redirect(request: Request) -> Response:
    return RedirectResponse(request.query_params["to"], status_code=302)


def echo_app(expected_secret: str = "") -> Starlette:
    app = Starlette(
        routes=[
            Route("/forms", forms, methods=["GET", "POST"]),
            Route("/stream", stream),
            Route("/whoami", whoami, methods=["GET", "POST", "PUT"]),
            Route("/big", big),
            Route("/slow", slow),
            Route("/redirect", redirect),
        ]
    )
    app.state.expected = expected_secret
    return app


@dataclass
class Recorder:
    """Counts requests that reached a server (to prove a refused redirect contacted nobody)."""

    hits: list[str] = field(default_factory=list)

    def app(self) -> Starlette:
        async def anything(request: Request) -> Response:
            self.hits.append(f"{request.method} {request.url.path}")
            return PlainTextResponse("reached")

        return Starlette(routes=[Route("/{path:path}", anything, methods=["GET", "POST"])])


@dataclass
class OAuthProvider:
    """A token endpoint (refresh grant) and a resource that accepts only the current token."""

    client_id: str = "oma-test-client"
    client_secret: str = field(default_factory=lambda: "cs-" + secrets.token_urlsafe(16))
    refresh_token: str = field(default_factory=lambda: "rt-" + secrets.token_urlsafe(16))
    access_token: str = field(default_factory=lambda: "at-" + secrets.token_urlsafe(16))
    expires_in: int = 3600
    refreshes: int = 0

    def rotate_access(self) -> None:
        self.access_token = "at-" + secrets.token_urlsafe(16)

    def app(self) -> Starlette:
        async def token(request: Request) -> Response:
            form = await request.form()
            auth = request.headers.get("authorization", "")
            expected_auth = (
                "Basic "
                + base64.b64encode(f"{self.client_id}:{self.client_secret}".encode()).decode()
            )
            if (
                form.get("grant_type") != "refresh_token"
                or form.get("refresh_token") != self.refresh_token
                or auth != expected_auth
            ):
                return JSONResponse({"error": "invalid_grant"}, status_code=400)
            self.refreshes += 1
            self.rotate_access()
            self.refresh_token = "rt-" + secrets.token_urlsafe(16)
            return JSONResponse(
                {
                    "access_token": self.access_token,
                    "token_type": "Bearer",
                    "expires_in": self.expires_in,
                    "refresh_token": self.refresh_token,
                }
            )

        async def resource(request: Request) -> Response:
            if request.headers.get("authorization") != f"Bearer {self.access_token}":
                return PlainTextResponse("bad token", status_code=401)
            return JSONResponse({"resource": "ok", "echo": self.access_token})

        return Starlette(
            routes=[Route("/token", token, methods=["POST"]), Route("/resource", resource)]
        )


def git_server_app(project_root: Path, username: str, token: str) -> Starlette:
    """`git http-backend` (CGI) behind HTTP basic auth demanding `username:token`."""
    expected = "Basic " + base64.b64encode(f"{username}:{token}".encode()).decode()

    async def backend(request: Request) -> Response:
        if request.headers.get("authorization") != expected:
            return PlainTextResponse(
                "authentication required",
                status_code=401,
                headers={"WWW-Authenticate": 'Basic realm="git"'},
            )
        body = await request.body()
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "GIT_PROJECT_ROOT": str(project_root),
            "GIT_HTTP_EXPORT_ALL": "1",
            "REQUEST_METHOD": request.method,
            "PATH_INFO": "/" + request.path_params["path"],
            "QUERY_STRING": request.url.query,
            "CONTENT_TYPE": request.headers.get("content-type", ""),
            "CONTENT_LENGTH": str(len(body)),
            "REMOTE_USER": username,
            "REMOTE_ADDR": "127.0.0.1",
            "GIT_HTTP_MAX_REQUEST_BUFFER": "100M",
        }
        if request.headers.get("content-encoding"):
            env["HTTP_CONTENT_ENCODING"] = request.headers["content-encoding"]
        if request.headers.get("git-protocol"):
            env["HTTP_GIT_PROTOCOL"] = request.headers["git-protocol"]
        process = await asyncio.create_subprocess_exec(
            "git",
            "http-backend",
            env=env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, _ = await process.communicate(body)
        head, _, payload = out.partition(b"\r\n\r\n")
        status = 200
        headers: dict[str, str] = {}
        for line in head.decode("latin-1").split("\r\n"):
            name, _, value = line.partition(":")
            if name.lower() == "status":
                status = int(value.strip().split()[0])
            elif name:
                headers[name] = value.strip()
        return Response(payload, status_code=status, headers=headers)

    return Starlette(routes=[Route("/{path:path}", backend, methods=["GET", "POST"])])


def make_bare_repository(root: Path, name: str, files: dict[str, str]) -> Path:
    """A bare repository `root/name.git` holding one commit on `main` with `files`."""
    import subprocess

    work = root / f"{name}-work"
    work.mkdir(parents=True)
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.com",
        "GIT_CONFIG_NOSYSTEM": "1",
        "HOME": str(root),
    }
    subprocess.run(["git", "init", "-q", "-b", "main", str(work)], check=True, env=env)
    for path, text in files.items():
        (work / path).parent.mkdir(parents=True, exist_ok=True)
        (work / path).write_text(text)
    subprocess.run(["git", "-C", str(work), "add", "-A"], check=True, env=env)
    subprocess.run(["git", "-C", str(work), "commit", "-q", "-m", "initial"], check=True, env=env)
    bare = root / f"{name}.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(bare)], check=True, env=env)
    return bare


def mcp_app(access_token_of: object) -> Starlette:
    """A real MCP server (streamable HTTP, `mcp` package) whose every request must carry
    `Authorization: Bearer <current token>`; `access_token_of()` gives the current token."""
    from mcp.server.mcpserver import MCPServer
    from starlette.middleware.base import BaseHTTPMiddleware

    server = MCPServer("vault-test")

    @server.tool()
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    app = server.streamable_http_app(stateless_http=True, json_response=False)

    class RequireToken(BaseHTTPMiddleware):
        async def dispatch(self, request, call_next):  # type: ignore[no-untyped-def]
            expected = f"Bearer {access_token_of()}"  # type: ignore[operator]
            if request.headers.get("authorization") != expected:
                return JSONResponse({"error": "invalid_token"}, status_code=401)
            return await call_next(request)

    app.add_middleware(RequireToken)
    return app


def now() -> float:
    return time.time()
