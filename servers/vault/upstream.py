"""Talking to upstream HTTP servers: target checks, secret injection, redirects, limits.

Everything that touches the network on a credential's behalf goes through `Upstream`, whose
httpx client ignores proxy environment variables (a secret must never be handed to an
HTTP proxy the operator did not intend), keeps no cookies between requests (one session's
cookies must not leak into another's), and never follows redirects by itself.
"""

from __future__ import annotations

import base64
import http.cookiejar
import ipaddress
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx

from oma.servers.vault.errors import VaultError, invalid_field
from oma.servers.vault.models import (
    DEFAULT_GIT_USERNAME,
    AllowedHost,
    CredentialKind,
    HttpRequestSpec,
    Secret,
)

MAX_SAME_ORIGIN_REDIRECTS = 5
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "trailers",
    "transfer-encoding",
    "upgrade",
}
# Set by the vault itself; a caller's value would be wrong (length, host) or unsafe
# (an encoding we could not decode and therefore could not scrub).
_REQUEST_HEADERS_WE_SET = _HOP_BY_HOP | {"host", "content-length", "accept-encoding"}
_RESPONSE_HEADERS_WE_DROP = _HOP_BY_HOP | {"content-length", "content-encoding"}
DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class Target:
    scheme: str
    host: str
    port: int

    @property
    def display(self) -> str:
        """`host` or `host:port` when the port is not the scheme's default (audit rows)."""
        return self.host if DEFAULT_PORTS[self.scheme] == self.port else f"{self.host}:{self.port}"


def parse_target(url: str, field: str = "request.url") -> Target:
    """Validate an absolute http(s) URL without userinfo and return its origin."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        raise invalid_field(field, f"{field} is not a valid URL: {exc}") from None
    if parsed.scheme not in DEFAULT_PORTS:
        raise invalid_field(field, f"{field} must be an absolute http:// or https:// URL")
    if not parsed.host:
        raise invalid_field(field, f"{field} has no host")
    if parsed.userinfo:
        raise invalid_field(field, f"{field} must not carry user info; the vault adds credentials")
    port = parsed.port or DEFAULT_PORTS[parsed.scheme]
    return Target(parsed.scheme, parsed.host.lower(), port)


def normalize_host(host: str) -> str:
    """Lower-case a host name; IPv6 literals lose their brackets and are canonicalised."""
    host = host.strip().lower().removeprefix("[").removesuffix("]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def check_allowed(target: Target, allowed: tuple[AllowedHost, ...], credential_id: str) -> None:
    host = normalize_host(target.host)
    if not any(a.matches(host, target.port) for a in allowed):
        hosts = ", ".join(str(a) for a in allowed)
        raise VaultError(
            "HOST_NOT_ALLOWED",
            f"credential {credential_id!r} may only be sent to {hosts}; "
            f"{target.display} is not among them",
            {"host": target.display},
        )


def auth_header(secret: Secret) -> tuple[str, str]:
    """The header that carries the secret, per the credential's kind."""
    if secret.kind is CredentialKind.BEARER:
        return "Authorization", f"Bearer {secret.token}"
    if secret.kind is CredentialKind.HEADER:
        return secret.header_name, secret.value
    if secret.kind is CredentialKind.BASIC:
        return "Authorization", "Basic " + _basic(secret.username, secret.password)
    if secret.kind is CredentialKind.GIT_TOKEN:
        return "Authorization", "Basic " + _basic(
            secret.username or DEFAULT_GIT_USERNAME, secret.token
        )
    return "Authorization", f"Bearer {secret.access_token}"


def _basic(username: str, password: str) -> str:
    return base64.b64encode(f"{username}:{password}".encode()).decode()


def outgoing_headers(caller: list[tuple[str, str]], secret: Secret) -> list[tuple[bytes, bytes]]:
    name, value = auth_header(secret)
    dropped = _REQUEST_HEADERS_WE_SET | {name.lower()}
    headers = [
        (k.encode("latin-1"), v.encode("latin-1")) for k, v in caller if k.lower() not in dropped
    ]
    headers.append((b"Accept-Encoding", b"gzip, deflate"))
    # Secrets may be any UTF-8 text; sent as their UTF-8 bytes.
    headers.append((name.encode("latin-1"), value.encode("utf-8")))
    return headers


def response_headers(response: httpx.Response) -> list[tuple[str, str]]:
    """The upstream's headers minus those describing the wire encoding we undo."""
    return [
        (k.decode("latin-1"), v.decode("latin-1"))
        for k, v in response.headers.raw
        if k.decode("latin-1").lower() not in _RESPONSE_HEADERS_WE_DROP
    ]


class _NoCookies(http.cookiejar.DefaultCookiePolicy):
    def set_ok(self, cookie: http.cookiejar.Cookie, request: urllib.request.Request) -> bool:
        return False

    def return_ok(self, cookie: http.cookiejar.Cookie, request: urllib.request.Request) -> bool:
        return False


def map_transport_error(exc: httpx.HTTPError, target: Target) -> VaultError:
    if isinstance(exc, httpx.TimeoutException):
        return VaultError(
            "UPSTREAM_TIMEOUT",
            f"{target.display} did not answer in time ({type(exc).__name__})",
            {"host": target.display},
        )
    if isinstance(exc, httpx.DecodingError):
        return VaultError(
            "UPSTREAM_UNREACHABLE",
            f"{target.display} sent a body that could not be decoded: {exc}",
            {"host": target.display},
        )
    return VaultError(
        "UPSTREAM_UNREACHABLE",
        f"could not reach {target.display}: {type(exc).__name__}: {exc}",
        {"host": target.display},
    )


class Upstream:
    """One pooled httpx client for every upstream call of this vault."""

    def __init__(self, verify: bool | str = True) -> None:
        self.client = httpx.AsyncClient(
            trust_env=False,
            follow_redirects=False,
            verify=verify,
            cookies=httpx.Cookies(http.cookiejar.CookieJar(policy=_NoCookies())),
            limits=httpx.Limits(max_connections=200, max_keepalive_connections=50),
        )

    async def close(self) -> None:
        await self.client.aclose()

    @asynccontextmanager
    async def open(
        self, request: HttpRequestSpec, secret: Secret, target: Target, time_limit: float
    ) -> AsyncIterator[httpx.Response]:
        """Send `request` with the secret injected; follow only same-origin redirects.

        Yields the final response with its body not yet read.
        """
        outgoing = self.client.build_request(
            request.method or "GET",
            request.url,
            headers=outgoing_headers(request.headers, secret),
            content=request.body or None,
            timeout=httpx.Timeout(time_limit),
        )
        response: httpx.Response | None = None
        try:
            for _ in range(MAX_SAME_ORIGIN_REDIRECTS + 1):
                response = await self.client.send(outgoing, stream=True)
                following = response.next_request
                if following is None:
                    break
                origin = (
                    following.url.scheme,
                    following.url.host.lower(),
                    following.url.port or DEFAULT_PORTS.get(following.url.scheme, 0),
                )
                if origin != (target.scheme, target.host, target.port):
                    await response.aclose()
                    shown = f"{following.url.scheme}://{following.url.host}"
                    if following.url.port:
                        shown += f":{following.url.port}"
                    raise VaultError(
                        "REDIRECT_REFUSED",
                        f"{target.display} redirected to {shown}; the vault follows redirects "
                        "only within the same scheme, host and port",
                        {"host": target.display, "location_host": following.url.host},
                    )
                await response.aclose()
                outgoing = following
            assert response is not None
            yield response
        except httpx.HTTPError as exc:
            raise map_transport_error(exc, target) from None
        finally:
            if response is not None:
                await response.aclose()
