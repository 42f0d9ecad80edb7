"""Tool calls parsed back out of generated text, chosen by what the chat template contains.

A chat template that renders `tools` also fixes how the model writes a call. The endpoint
picks the parser whose marker appears in the template (Hermes/Qwen: `<tool_call>{json}
</tool_call>`; Mistral: `[TOOL_CALLS][...]`); a template with no tool syntax (SmolLM2)
gets no parser, and the text is returned as plain content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ParsedOutput:
    """Text split into the content the user sees and OpenAI-shaped tool calls."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ToolParser:
    """Base: `start` is the marker after which text may be a call (held back when streaming)."""

    name: str = ""
    start: str = ""
    template_markers: tuple[str, ...] = ()

    def matches(self, chat_template: str) -> bool:
        return any(marker in chat_template for marker in self.template_markers)

    def parse(self, text: str) -> ParsedOutput:
        raise NotImplementedError


def _tool_call(name: str, arguments: Any) -> dict[str, Any]:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _call_from_json(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return _tool_call(obj["name"], arguments)


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen2.5, Qwen3)."""

    name = "hermes"
    start = "<tool_call>"
    template_markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedOutput:
        if self.start not in text:
            return ParsedOutput(content=text)
        calls = []
        for body in self._block.findall(text):
            try:
                call = _call_from_json(json.loads(body))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return ParsedOutput(content=text)  # malformed: show the model's text as is
            calls.append(call)
        content = text[: text.index(self.start)].strip()
        return ParsedOutput(content=content or None, tool_calls=calls)


class MistralToolParser(ToolParser):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral instruct models)."""

    name = "mistral"
    start = "[TOOL_CALLS]"
    template_markers = ("[TOOL_CALLS]",)

    def parse(self, text: str) -> ParsedOutput:
        if self.start not in text:
            return ParsedOutput(content=text)
        head, _, tail = text.partition(self.start)
        try:
            payload = json.loads(tail.strip())
        except json.JSONDecodeError:
            return ParsedOutput(content=text)
        items = payload if isinstance(payload, list) else [payload]
        calls = [_call_from_json(item) for item in items]
        if not calls or any(call is None for call in calls):
            return ParsedOutput(content=text)
        return ParsedOutput(content=head.strip() or None, tool_calls=calls)  # type: ignore[arg-type]


TOOL_PARSERS: dict[str, ToolParser] = {p.name: p for p in (HermesToolParser(), MistralToolParser())}


def tool_parser_for(chat_template: str | None) -> ToolParser | None:
    """The parser whose call syntax the template renders, or None if it renders none."""
    if not chat_template:
        return None
    for parser in TOOL_PARSERS.values():
        if parser.matches(chat_template):
            return parser
    return None
