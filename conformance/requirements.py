"""The requirement table: every `[AREA-TOPIC-NNN]` statement of the contract."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from pathlib import Path

TABLE = Path(__file__).with_name("requirements.json")


class Level(StrEnum):
    """RFC 2119 strength of a requirement, which decides what its failure means."""

    MUST = "MUST"  # a failure fails the run
    SHOULD = "SHOULD"  # a failure is reported, the run still passes
    MAY = "MAY"  # optional behaviour: checked only when the target advertises it
    INFO = "INFO"  # a numbered statement with no RFC 2119 word

    @property
    def rank(self) -> int:
        return ["INFO", "MAY", "SHOULD", "MUST"].index(self.value)


@dataclass(frozen=True)
class Requirement:
    """One statement of the contract, where it is written, and how strong it is."""

    id: str
    level: Level
    file: str
    line: int
    text: str

    @property
    def source(self) -> str:
        return f"{self.file}:{self.line}"


@cache
def requirements() -> dict[str, Requirement]:
    rows = json.loads(TABLE.read_text())
    return {
        row["id"]: Requirement(row["id"], Level(row["level"]), row["file"], row["line"], row["text"])
        for row in rows
    }
