"""Tool calls in generated text: which parser a backend's chat template needs, parsing a
finished choice, and holding back streamed text that may be the start of a call."""

from __future__ import annotations

from masenvs.adapters.tool_parsers import TOOL_PARSERS, ParsedOutput, ToolParser, tool_parser_for
from masenvs.engine.protocol import Backend


class HeldText:
    """Streams a choice's text, holding back whatever may be the start of a tool call."""

    def __init__(self, parser: ToolParser | None) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0
        self.in_call = False

    def push(self, piece: str) -> str:
        self.text += piece
        if self.parser is None:
            self.sent = len(self.text)
            return piece
        if self.in_call:
            return ""
        marker = self.parser.start
        found = self.text.find(marker, self.sent)
        if found >= 0:
            self.in_call = True
            out, self.sent = self.text[self.sent : found], found
            return out
        # Keep back a tail that could grow into the marker.
        keep = 0
        for k in range(min(len(marker) - 1, len(self.text) - self.sent), 0, -1):
            if marker.startswith(self.text[-k:]):
                keep = k
                break
        end = len(self.text) - keep
        out, self.sent = self.text[self.sent : end], end
        return out

    def rest(self, output: ParsedOutput) -> str:
        """Text not yet sent that belongs to the content: none when the rest is tool calls
        (everything before the call marker has been sent)."""
        return "" if output.tool_calls else self.text[self.sent :]


def parse_tools(text: str, parser: ToolParser | None) -> ParsedOutput:
    """`text` split into content and tool calls (all content without a parser)."""
    return parser.parse(text) if parser is not None else ParsedOutput(content=text)


def choose_tool_parser(backend: Backend, choice: str | None) -> ToolParser | None:
    """The parser named by `choice`; "auto" picks the one the backend's chat template needs."""
    if choice is None or choice == "none":
        return None
    if choice != "auto":
        if choice not in TOOL_PARSERS:
            raise ValueError(f"unknown tool parser {choice!r}; known: {', '.join(TOOL_PARSERS)}")
        return TOOL_PARSERS[choice]
    template = getattr(backend, "chat_template", None)
    if template is None:
        tokenizer = getattr(backend, "tokenizer", None)
        template = getattr(tokenizer, "chat_template", None)
    return tool_parser_for(template if isinstance(template, str) else None)
