"""Where OMA keeps its local state.

`data_dir()` is `$OMA_HOME`, or `~/.oma`. The default token file is `data_dir()/tokens.json`;
`ensure_tokens_file()` creates it (mode 0600, one fresh `secrets.token_urlsafe(32)` token per
role) when it is missing and never overwrites an existing one.
"""

from __future__ import annotations

import os
from pathlib import Path

TOKENS_FILE_NAME = "tokens.json"


def data_dir() -> Path:
    """`$OMA_HOME` if set, else `~/.oma` (not created here)."""
    home = os.environ.get("OMA_HOME")
    return Path(home).expanduser() if home else Path.home() / ".oma"


def default_tokens_file() -> Path:
    return data_dir() / TOKENS_FILE_NAME


def ensure_tokens_file(path: Path | None = None) -> Path:
    """Return `path` (default: the data dir's token file), creating it with fresh tokens
    when missing."""
    from oma.runtime.auth import TokenTable

    file = path if path is not None else default_tokens_file()
    if file.exists():
        return file
    file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    # Written aside, then linked into place: the link fails if another process created the
    # file meanwhile (its tokens win), and no reader ever sees a half-written file.
    staging = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    TokenTable.generate().save(staging)
    try:
        os.link(staging, file)
    except FileExistsError:
        pass
    finally:
        staging.unlink(missing_ok=True)
    return file
