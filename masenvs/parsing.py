"""Tolerant parsers for model output: take the last answer, never raise."""

from __future__ import annotations

import json
import re

_MOVE = re.compile(r"(?i)\b(up|down|left|right)\b|\b([UDLRudlr]+)\b")
_MOVE_WORDS = {"up": "U", "down": "D", "left": "L", "right": "R"}


_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """The content of the last well-formed, non-empty `\\boxed{...}` in `text`, or None."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    content = text[start:i].strip()
                    if content:
                        return content
                    break
    return None


def last_code_block(text: str, languages: tuple[str, ...] = ("python", "py", "")) -> str | None:
    """The last fenced code block in one of `languages` ("" = no language tag).

    A linear scan over the fences: regexes with lazy bodies go quadratic on inputs full of
    backticks, and model output is adversarial input.
    """
    fences, at = [], text.find("```")
    while at >= 0:
        fences.append(at)
        at = text.find("```", at + 3)
    found: str | None = None
    for i in range(0, len(fences), 2):
        open_at = fences[i] + 3
        newline = text.find("\n", open_at)
        if newline < 0:
            break
        lang = text[open_at:newline].strip().split(" ")[0].lower()
        if lang not in languages:
            continue
        if i + 1 < len(fences):
            found = text[newline + 1 : fences[i + 1]]
        elif lang in ("python", "py"):
            # A model that ran out of tokens leaves the last fence open; take what it wrote.
            found = text[newline + 1 :]
    return found


def answer_segment(text: str, marker: str = "####") -> str | None:
    """The text after the last `marker`, or the last bracketed list, or None."""
    if marker in text:
        return text.rsplit(marker, 1)[1]
    lists = re.findall(r"\[[^\[\]]*\]", text)
    return lists[-1] if lists else None


def parse_moves(text: str, max_moves: int = 10_000, marker: str = "####") -> list[str] | None:
    """Moves (U/D/L/R) from the last answer block; None when there is none.

    The answer is the bracketed list right after the marker, else the rest of its line:
    prose after it (`#### [R, D]\n\nThen move right ...`) is commentary, not more moves.
    """
    segment = answer_segment(text, marker)
    if segment is None:
        return None
    segment = _answer_only(segment)
    moves: list[str] = []
    for word, letters in _MOVE.findall(segment):
        if word:
            moves.append(_MOVE_WORDS[word.lower()])
        else:
            moves.extend(letters.upper())
        if len(moves) > max_moves:
            return None
    return moves or None


def _answer_only(segment: str) -> str:
    """The list that opens `segment` (to its `]`, or its line when unclosed), else its first
    non-empty line."""
    rest = segment.lstrip(" \t\r\n:*`")
    line = rest.split("\n", 1)[0]
    if rest.startswith("["):
        end = line.find("]")
        return line[: end + 1] if end >= 0 else line
    return line


def parse_json_list(segment: str) -> list | None:
    """A JSON list from `segment`, also accepting single quotes; None when it is not one."""
    # First "[" to last "]": what a greedy regex would match, without its quadratic backtracking.
    start, end = segment.find("["), segment.rfind("]")
    if start < 0 or end < start:
        return None
    raw = segment[start : end + 1]
    for candidate in (raw, raw.replace("'", '"')):
        try:
            value = json.loads(candidate)
        except (ValueError, RecursionError):
            continue
        if isinstance(value, list):
            return value
    return None


def clip_text(text: str, limit: int) -> str:
    """`text` cut to about `limit` characters, keeping its head and tail."""
    if len(text) <= limit:
        return text
    half = max(limit // 2 - 20, 0)
    return f"{text[:half]}\n... [{len(text) - 2 * half} characters cut] ...\n{text[-half:]}"
