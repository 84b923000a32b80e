"""Scrubbing: replace every echo of a secret in upstream responses by `[REDACTED]`.

An upstream may echo a secret plainly, base64-encoded (standard or URL-safe alphabet, at any
of the three byte alignments, e.g. inside `base64("user:" + password)`), percent-encoded, or
escaped inside a JSON string. For each secret we precompute every such form and match them
all with one regular expression. Streams are scrubbed with an overlap window as long as the
longest form minus one byte, so a secret split across chunk boundaries is still caught.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterable
from urllib.parse import quote, quote_plus

REDACTED = b"[REDACTED]"
_PERCENT = re.compile(rb"%[0-9A-F]{2}")


def _base64_cores(secret: bytes) -> set[bytes]:
    """The base64 characters determined by `secret` alone, for each byte alignment.

    Encoded after k unknown bytes, the secret's bits start at bit 8k; a base64 character i
    covers bits [6i, 6i+6), so the characters wholly inside the secret are
    [ceil(8k/6), floor(8(k+n)/6)).
    """
    cores: set[bytes] = set()
    n = len(secret)
    for k in range(3):
        encoded = base64.b64encode(b"\0" * k + secret)
        core = encoded[-(-8 * k // 6) : (8 * (k + n)) // 6]
        if core:
            cores.add(core)
            cores.add(core.translate(bytes.maketrans(b"+/", b"-_")))
    return cores


def secret_forms(secret: bytes) -> set[bytes]:
    """Every encoding of `secret` the scrubber removes."""
    forms = {secret}
    forms |= _base64_cores(secret)
    for encoded in (quote(secret, safe=""), quote_plus(secret, safe=""), quote(secret)):
        raw = encoded.encode()
        forms.add(raw)
        forms.add(_PERCENT.sub(lambda m: m.group(0).lower(), raw))
    try:
        text = secret.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None:
        for ensure_ascii in (True, False):
            escaped = json.dumps(text, ensure_ascii=ensure_ascii)[1:-1].encode("utf-8")
            forms.add(escaped)
            forms.add(escaped.replace(b"/", b"\\/"))
    return {form for form in forms if form}


class Scrubber:
    """Removes every form of a fixed set of secrets from bytes and streams."""

    def __init__(self, secrets: Iterable[str | bytes]) -> None:
        forms: set[bytes] = set()
        for secret in secrets:
            raw = secret.encode("utf-8") if isinstance(secret, str) else secret
            if raw:
                forms |= secret_forms(raw)
        # Longest first, so that at one position the longest form wins.
        ordered = sorted(forms, key=lambda f: (-len(f), f))
        self._pattern = re.compile(b"|".join(re.escape(f) for f in ordered)) if ordered else None
        self.window = max((len(f) for f in ordered), default=1) - 1

    def scrub(self, data: bytes) -> tuple[bytes, int]:
        """`data` with every secret form replaced, and how many were replaced."""
        if self._pattern is None or not data:
            return data, 0
        return self._pattern.subn(REDACTED, data)

    def finds(self, data: bytes) -> bool:
        """Whether `data` holds any form of any secret."""
        return self._pattern is not None and self._pattern.search(data) is not None

    def scrub_text(self, text: str) -> tuple[str, int]:
        out, count = self.scrub(text.encode("latin-1", errors="surrogateescape"))
        return out.decode("latin-1"), count

    def stream(self) -> StreamScrubber:
        return StreamScrubber(self)


class StreamScrubber:
    """Scrubs a byte stream chunk by chunk, holding back only `window` bytes.

    A match that starts before the held-back tail is complete (every form fits between its
    start and the end of the buffer), so it can be replaced and emitted at once; anything
    starting inside the tail waits for the next chunk.
    """

    def __init__(self, scrubber: Scrubber) -> None:
        self._scrubber = scrubber
        self._carry = b""
        self.count = 0

    def feed(self, chunk: bytes) -> bytes:
        buffer = self._carry + chunk
        pattern = self._scrubber._pattern
        if pattern is None:
            self._carry = b""
            return buffer
        safe_end = len(buffer) - self._scrubber.window
        out = bytearray()
        pos = 0
        for match in pattern.finditer(buffer):
            if match.start() >= safe_end:
                break
            out += buffer[pos : match.start()]
            out += REDACTED
            pos = match.end()
            self.count += 1
        cut = max(pos, safe_end)
        out += buffer[pos:cut]
        self._carry = buffer[cut:]
        return bytes(out)

    def flush(self) -> bytes:
        rest, count = self._scrubber.scrub(self._carry)
        self._carry = b""
        self.count += count
        return rest
