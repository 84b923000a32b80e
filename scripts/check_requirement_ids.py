#!/usr/bin/env python3
"""Check the requirement ids written in the contract's comments.

A requirement is a comment paragraph that starts with an id in brackets, e.g.
`// [SESSION-APPEND-003] The server MUST ...`. This check fails when
  * an id appears twice (ids are stable: never reused, never renumbered), or
  * a capitalised RFC 2119 word (MUST, SHOULD, MAY) stands in a paragraph that is not a
    requirement, so every checkable statement can be cited by the conformance suite.

    python scripts/check_requirement_ids.py          # check, print a summary
    python scripts/check_requirement_ids.py --json   # print the requirement table as JSON
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ID = r"(?:COMMON|SESSION|SANDBOX|VAULT|HARNESS)(?:-[A-Z0-9]+)+-\d{3}"
ID_AT_START = re.compile(rf"^(?:[-*]\s*)?\[({ID})\]\s*")
ANY_ID = re.compile(rf"\[({ID})\]")
KEYWORD = re.compile(r"\b(MUST NOT|MUST|SHOULD NOT|SHOULD|MAY)\b")


@dataclass
class Requirement:
    id: str
    level: str  # the strongest RFC 2119 word in the text: MUST > SHOULD > MAY
    file: str
    line: int
    text: str


def comment_paragraphs(path: Path) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of each comment paragraph; a paragraph ends at a blank
    comment line, a non-comment line, or a line that starts a new requirement."""
    paragraphs: list[tuple[int, list[str]]] = []
    current: list[str] = []
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        stripped = raw.strip()
        text = stripped[2:].strip() if stripped.startswith("//") else None
        if text is None or text == "" or ID_AT_START.match(text or ""):
            if current:
                paragraphs.append((start, current))
            current = []
            if text:
                current, start = [text], number
            continue
        if not current:
            start = number
        current.append(text)
    if current:
        paragraphs.append((start, current))
    return paragraphs


def level_of(text: str) -> str:
    words = set(KEYWORD.findall(text))
    for level in ("MUST", "SHOULD", "MAY"):
        if any(w.startswith(level) for w in words):
            return level
    return "INFO"


def scan(proto_root: Path) -> tuple[list[Requirement], list[str]]:
    requirements: list[Requirement] = []
    errors: list[str] = []
    seen: dict[str, Requirement] = {}
    for path in sorted(proto_root.rglob("*.proto")):
        rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        for line, lines in comment_paragraphs(path):
            text = " ".join(lines)
            head = ID_AT_START.match(text)
            for extra in ANY_ID.findall(text[head.end():] if head else text):
                errors.append(f"{rel}:{line}: [{extra}] is not at the start of a paragraph "
                              "(start a requirement with its id; cite others without brackets)")
            if head is None:
                if KEYWORD.search(text):
                    errors.append(f"{rel}:{line}: '{KEYWORD.search(text).group(1)}' outside a "  # type: ignore[union-attr]
                                  "requirement: start the paragraph with an id like "
                                  "[SESSION-TOPIC-001], or write the word in lower case")
                continue
            req = Requirement(head.group(1), level_of(text), rel, line, text[head.end():])
            if req.id in seen:
                first = seen[req.id]
                errors.append(f"{rel}:{line}: duplicate requirement id {req.id} "
                              f"(first at {first.file}:{first.line})")
                continue
            seen[req.id] = req
            requirements.append(req)
    return requirements, errors


def main() -> int:
    parser = argparse.ArgumentParser(description="check the contract's requirement ids")
    parser.add_argument("--json", action="store_true", help="print the requirement table")
    parser.add_argument("--proto-root", type=Path, default=ROOT / "proto")
    args = parser.parse_args()
    requirements, errors = scan(args.proto_root)
    if args.json:
        print(json.dumps([asdict(r) for r in requirements], indent=2))
    for error in errors:
        print(error, file=sys.stderr)
    if errors:
        print(f"requirement ids: {len(errors)} problem(s)", file=sys.stderr)
        return 1
    if not args.json:
        levels = {lvl: sum(r.level == lvl for r in requirements) for lvl in ("MUST", "SHOULD", "MAY")}
        print(f"requirement ids: {len(requirements)} unique ({levels})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
