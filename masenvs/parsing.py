"""Tolerant parsers for model output: take the last answer, never raise."""

from __future__ import annotations

import json
import re

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_UNCLOSED_FENCE = re.compile(r"```[ \t]*(?:python|py)[^\n]*\n(.*)\Z", re.DOTALL | re.IGNORECASE)
_MOVE = re.compile(r"(?i)\b(up|down|left|right)\b|\b([UDLRudlr]+)\b")
_MOVE_WORDS = {"up": "U", "down": "D", "left": "L", "right": "R"}


def last_code_block(text: str, languages: tuple[str, ...] = ("python", "py", "")) -> str | None:
    """The last fenced code block in one of `languages` ("" = no language tag)."""
    blocks = [body for lang, body in _FENCE.findall(text) if lang.lower() in languages]
    if blocks:
        return blocks[-1]
    # A model that ran out of tokens leaves the last fence open; take what it wrote.
    unclosed = _UNCLOSED_FENCE.search(text)
    return unclosed.group(1) if unclosed else None


def answer_segment(text: str, marker: str = "####") -> str | None:
    """The text after the last `marker`, or the last bracketed list, or None."""
    if marker in text:
        return text.rsplit(marker, 1)[1]
    lists = re.findall(r"\[[^\[\]]*\]", text)
    return lists[-1] if lists else None


def parse_moves(text: str, max_moves: int = 10_000, marker: str = "####") -> list[str] | None:
    """Moves (U/D/L/R) from the last answer block; None when there is none."""
    segment = answer_segment(text, marker)
    if segment is None:
        return None
    moves: list[str] = []
    for word, letters in _MOVE.findall(segment):
        if word:
            moves.append(_MOVE_WORDS[word.lower()])
        else:
            moves.extend(letters.upper())
        if len(moves) > max_moves:
            return None
    return moves or None


def parse_json_list(segment: str) -> list | None:
    """A JSON list from `segment`, also accepting single quotes; None when it is not one."""
    match = re.search(r"\[.*\]", segment, re.DOTALL)
    if not match:
        return None
    raw = match.group(0)
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
