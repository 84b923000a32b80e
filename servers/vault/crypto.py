"""Encryption at rest: AES-256-GCM under a master key, with the credential id and version
bound as associated data (so a ciphertext copied onto another row or version fails to
decrypt), and a keyring that lets the master key rotate while the server keeps serving.

Master key sources, in order: the `OMA_VAULT_MASTER_KEY` environment variable (base64 of 32
bytes; the server cannot rotate such a key itself, but restarted with the new key there and
old ones in `OMA_VAULT_PREVIOUS_MASTER_KEYS` (comma-separated) it re-encrypts every secret
under the new key while serving), else a key file (created 0600 with a
fresh random key when missing). A key file holds one base64 key per line, the current key
first; older lines are kept only while a rotation is re-encrypting secrets.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MASTER_KEY_ENV = "OMA_VAULT_MASTER_KEY"
PREVIOUS_KEYS_ENV = "OMA_VAULT_PREVIOUS_MASTER_KEYS"
KEY_BYTES = 32
NONCE_BYTES = 12


class MasterKeyError(Exception):
    """The master key is missing, malformed or cannot be written."""


def key_id_of(key: bytes) -> str:
    """Non-secret fingerprint of a key: the first 16 hex digits of its SHA-256."""
    return hashlib.sha256(b"oma-vault-key-id\x00" + key).hexdigest()[:16]


def associated_data(credential_id: str, version: int) -> bytes:
    return f"oma.vault.v1/credential/{credential_id}/version/{version}".encode()


@dataclass(frozen=True)
class Sealed:
    key_id: str
    nonce: bytes
    ciphertext: bytes


def _decode_key(text: str, where: str) -> bytes:
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise MasterKeyError(f"{where}: master key is not valid base64") from None
    if len(key) != KEY_BYTES:
        raise MasterKeyError(f"{where}: master key must be {KEY_BYTES} bytes, got {len(key)}")
    return key


def _write_key_file(path: Path, keys: list[bytes]) -> None:
    """Atomically replace the key file, never letting it be readable by others."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as out:
        for key in keys:
            out.write(base64.b64encode(key).decode() + "\n")
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


class Keyring:
    """The current master key plus retired ones still able to decrypt.

    Retired keys stay in memory for the life of the process even after a rotation has
    removed them from the key file, so a request that read a row just before the row was
    re-encrypted still decrypts it.
    """

    def __init__(self, current: bytes, retired: list[bytes], key_file: Path | None) -> None:
        self._keys: dict[str, bytes] = {key_id_of(k): k for k in [*retired, current]}
        self._current = key_id_of(current)
        self.key_file = key_file

    @classmethod
    def load(cls, key_file: Path, environ: dict[str, str] | None = None) -> Keyring:
        """From `OMA_VAULT_MASTER_KEY` if set, else from `key_file` (created if missing)."""
        env = os.environ if environ is None else environ
        if env.get(MASTER_KEY_ENV):
            previous = [
                _decode_key(item, PREVIOUS_KEYS_ENV)
                for item in env.get(PREVIOUS_KEYS_ENV, "").split(",")
                if item.strip()
            ]
            return cls(_decode_key(env[MASTER_KEY_ENV], MASTER_KEY_ENV), previous, None)
        if not key_file.exists():
            _write_key_file(key_file, [secrets.token_bytes(KEY_BYTES)])
        lines = [ln for ln in key_file.read_text(encoding="ascii").splitlines() if ln.strip()]
        if not lines:
            raise MasterKeyError(f"{key_file}: key file is empty")
        keys = [_decode_key(line, str(key_file)) for line in lines]
        return cls(keys[0], keys[1:], key_file)

    @property
    def current_id(self) -> str:
        return self._current

    def holds(self, key_id: str) -> bool:
        return key_id in self._keys

    @property
    def external(self) -> bool:
        """True when the key comes from outside (environment) and cannot be rotated here."""
        return self.key_file is None

    def seal(self, plaintext: bytes, credential_id: str, version: int) -> Sealed:
        nonce = secrets.token_bytes(NONCE_BYTES)
        aead = AESGCM(self._keys[self._current])
        ciphertext = aead.encrypt(nonce, plaintext, associated_data(credential_id, version))
        return Sealed(self._current, nonce, ciphertext)

    def open(self, sealed: Sealed, credential_id: str, version: int) -> bytes:
        key = self._keys.get(sealed.key_id)
        if key is None:
            raise MasterKeyError(
                f"secret of credential {credential_id!r} is encrypted under master key "
                f"{sealed.key_id}, which this server does not hold"
            )
        aead = AESGCM(key)
        return aead.decrypt(
            sealed.nonce, sealed.ciphertext, associated_data(credential_id, version)
        )

    def begin_rotation(self) -> str:
        """Make a fresh key current (written first in the key file, old keys after it)."""
        if self.key_file is None:
            raise MasterKeyError("master key comes from the environment")
        new = secrets.token_bytes(KEY_BYTES)
        old_keys = [self._keys[self._current]] + [
            k for kid, k in self._keys.items() if kid != self._current
        ]
        _write_key_file(self.key_file, [new, *old_keys])
        self._keys[key_id_of(new)] = new
        self._current = key_id_of(new)
        return self._current

    def finish_rotation(self) -> None:
        """Drop retired keys from the key file once no secret needs them."""
        if self.key_file is not None:
            _write_key_file(self.key_file, [self._keys[self._current]])

    def mac(self, data: bytes) -> bytes:
        """HMAC under a key derived from the current master key (for page tokens)."""
        derived = hmac.new(self._keys[self._current], b"oma-vault-page-token", "sha256").digest()
        return hmac.new(derived, data, "sha256").digest()[:16]

    def verify_mac(self, data: bytes, tag: bytes) -> bool:
        for key in self._keys.values():
            derived = hmac.new(key, b"oma-vault-page-token", "sha256").digest()
            if hmac.compare_digest(hmac.new(derived, data, "sha256").digest()[:16], tag):
                return True
        return False
