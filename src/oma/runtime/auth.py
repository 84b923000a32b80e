"""Bearer tokens by role, and the rule each OMA method declares.

Promises:
- A `TokenTable` maps role names (`client`, `harness`, `sandbox_server`, `admin`) to bearer
  tokens and is stored as a JSON object `{"<role>": "<token>", ...}` in a file with mode
  0600. A role may also map to a list of tokens (to rotate without downtime).
- `role_of(token)` compares against every known token with `hmac.compare_digest`, so the
  time it takes does not reveal how much of a guessed token was right.
- `method_rule(full_method)` reads the method's `(oma.common.v1.auth)` option from the
  protobuf descriptor pool: the contract and the enforcement can never disagree. A method
  with no `auth` option is admin-only (fail closed); `admin` may call every method.
- `current_role()` tells a handler the role of the token its caller presented (None for a
  `request_authenticated` method called without a token).
"""

from __future__ import annotations

import contextvars
import hmac
import json
import logging
import os
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import descriptor_pool

from oma.common.v1 import common_pb2

logger = logging.getLogger("oma.runtime")

CLIENT = "client"
HARNESS = "harness"
SANDBOX_SERVER = "sandbox_server"
ADMIN = "admin"
ROLES: tuple[str, ...] = (CLIENT, HARNESS, SANDBOX_SERVER, ADMIN)

_current_role: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "oma_current_role", default=None
)


def current_role() -> str | None:
    """The role of the caller of the RPC being handled (None outside a call, or for a
    `request_authenticated` method called without a valid bearer token)."""
    return _current_role.get()


def role_name(role: int) -> str:
    """`oma.common.v1.Role` value → role name (`ROLE_SANDBOX_SERVER` → `sandbox_server`)."""
    return common_pb2.Role.Name(role).removeprefix("ROLE_").lower()  # type: ignore[arg-type]


class TokenTable:
    """Role name → bearer tokens. Immutable once built."""

    def __init__(self, tokens: Mapping[str, str | Iterable[str]]) -> None:
        table: dict[str, tuple[str, ...]] = {}
        for role, value in tokens.items():
            if role not in ROLES:
                raise ValueError(f"unknown role {role!r} in token table; roles are {ROLES}")
            values = (value,) if isinstance(value, str) else tuple(value)
            for token in values:
                if not isinstance(token, str) or len(token) < 16:
                    raise ValueError(f"token for role {role!r} must be a string of 16+ characters")
            table[role] = values
        self._tokens = table
        # Flattened once so role_of can run in time independent of which token matched.
        self._pairs: tuple[tuple[bytes, str], ...] = tuple(
            (token.encode(), role) for role, values in table.items() for token in values
        )

    @classmethod
    def generate(cls) -> TokenTable:
        """A fresh table with one random token (`secrets.token_urlsafe(32)`) per role."""
        return cls({role: secrets.token_urlsafe(32) for role in ROLES})

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TokenTable:
        """Read a JSON token file; errors name the file and what is wrong with it."""
        file = Path(path)
        try:
            if file.stat().st_mode & 0o077:
                logger.warning(
                    "token file %s is readable by other users; run: chmod 600 %s", file, file
                )
            data = json.loads(file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(f"token file {file} does not exist") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"token file {file} is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"token file {file} must hold a JSON object of role → token")
        try:
            return cls(data)
        except ValueError as exc:
            raise ValueError(f"token file {file}: {exc}") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the table as JSON, readable by its owner only (mode 0600)."""
        file = Path(path)
        file.parent.mkdir(parents=True, exist_ok=True)
        data = {role: (v[0] if len(v) == 1 else list(v)) for role, v in self._tokens.items()}
        # 0600 before any byte is written, so the secret is never briefly readable by others
        # (O_CREAT's mode applies only to a new file; an existing one keeps its own).
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(data, out, indent=2)
            out.write("\n")

    def token_for(self, role: str) -> str:
        """The (first) token of `role`; KeyError names the roles the table has."""
        try:
            return self._tokens[role][0]
        except KeyError:
            raise KeyError(
                f"no token for role {role!r}; this table has {sorted(self._tokens)}"
            ) from None

    def role_of(self, token: str) -> str | None:
        """The role holding `token`, or None. Constant-time in the token's content."""
        candidate = token.encode()
        found: str | None = None
        for known, role in self._pairs:
            if hmac.compare_digest(candidate, known) and found is None:
                found = role
        return found

    def roles(self) -> tuple[str, ...]:
        return tuple(self._tokens)


@dataclass(frozen=True)
class MethodRule:
    """Who may call one method: `roles` (admin is always added) or, when
    `request_authenticated`, anyone (the request carries its own credential)."""

    method: str
    roles: frozenset[str]
    request_authenticated: bool = False
    declared: bool = True

    def allows(self, role: str) -> bool:
        return role == ADMIN or role in self.roles

    def accepted(self) -> str:
        """Roles accepted, for error messages: `client, harness, admin`."""
        ordered = [r for r in ROLES if r in self.roles or r == ADMIN]
        return ", ".join(ordered)


def method_rule(full_method: str) -> MethodRule:
    """The auth rule of `/package.Service/Method`, read from the default descriptor pool.

    A method the pool does not know, or one without an `auth` option, is admin-only. The
    server reads each rule once, when the method is registered (its `_pb2` is imported by
    then); results are not cached here, so an early lookup cannot pin a wrong answer.
    """
    name = full_method.lstrip("/").replace("/", ".")
    try:
        method = descriptor_pool.Default().FindMethodByName(name)
    except KeyError:
        return MethodRule(full_method, frozenset(), declared=False)
    options = method.GetOptions()
    if not options.HasExtension(common_pb2.auth):
        return MethodRule(full_method, frozenset(), declared=False)
    auth = options.Extensions[common_pb2.auth]
    roles = frozenset(role_name(r) for r in auth.roles if r != common_pb2.ROLE_UNSPECIFIED)
    return MethodRule(full_method, roles, request_authenticated=auth.request_authenticated)
