"""An assistant turn as every API shows it: thinking, answer text and tool calls, parsed out of the output.

Chat Completions, Responses and Messages all read one generated output through the same two parsers, in
this order: the reasoning parser splits the thinking off (server/reasoning.py), then the tool parser of the
model's family finds the calls in the answer (server/tool_parsers.py). A GPT-OSS model's output is read
instead by harmony's parser from its token ids (server/harmony.py), which gives all three at once. So the
same output is the same turn through every route, whole or streamed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from tokenmill.server.harmony import HarmonyParsing, HarmonyStream
from tokenmill.server.reasoning import ReasoningParser, ReasoningStream
from tokenmill.server.tool_parsers import CallDelta, ParsedCall, ToolParser, ToolStream


@dataclass(frozen=True)
class TurnParsing:
    """How one request's output is read: its reasoning parser and how its prompt left the thinking
    (`ReasoningParser.opening`), and the tool parser with the functions it may call, each name with its
    parameters' JSON schema (None: no tools); or, for a GPT-OSS model, `harmony`, which then reads the
    output alone."""

    reasoning: Optional[ReasoningParser] = None
    opening: Optional[str] = None
    tools: Optional[ToolParser] = None
    names: Mapping[str, Any] = field(default_factory=dict)
    harmony: Optional[HarmonyParsing] = None

    def whole(self, text: str, token_ids: list[int]) -> "Turn":
        """The turn of a finished output: its `text`, or its `token_ids` for harmony."""
        if self.harmony is not None:
            thinking, content, calls = self.harmony.whole(token_ids)
            return Turn(thinking, (content.strip() or None) if calls else content, calls)
        thinking, answer = self.reasoning.split(text, self.opening) if self.reasoning else (None, text)
        if self.tools is None:
            return Turn(thinking, answer, [])
        content, calls = self.tools.parse(answer, self.names)
        return Turn(thinking, content, calls)

    def stream(self) -> "TurnStream":
        """A parser for one streamed output."""
        return TurnStream(self)


@dataclass(frozen=True)
class Turn:
    """A finished turn: the thinking (None: the model wrote none), the answer text (None when it is empty
    around tool calls) and the calls."""

    thinking: Optional[str]
    content: Optional[str]
    calls: list[ParsedCall]


class TurnStream:
    """Reads a streamed output delta by delta into (thinking, text, call deltas) to send now."""

    def __init__(self, parsing: TurnParsing) -> None:
        self.harmony: Optional[HarmonyStream] = parsing.harmony.stream() if parsing.harmony is not None else None
        self.reasoning: Optional[ReasoningStream] = (
            parsing.reasoning.stream(parsing.opening) if parsing.reasoning is not None else None)
        self.tools: Optional[ToolStream] = parsing.tools.stream(parsing.names) if parsing.tools else None
        self.answer = ""  # the whole answer so far: the tool parser reads it cumulatively
        self.called = False  # whether any call was sent (the turn then ends in tool use)

    def push(self, delta: str, token_ids: list[int], finished: bool) -> tuple[str, str, list[CallDelta]]:
        """(thinking, answer text, tool-call deltas) to send for the output's next `delta` of text, which is
        its next `token_ids` (harmony reads those)."""
        if self.harmony is not None:
            thinking, text, calls = self.harmony.push(token_ids, finished)
            self.called = self.called or bool(calls)
            return thinking, text, calls
        thinking, answer = self.reasoning.push(delta, finished) if self.reasoning is not None else ("", delta)
        if self.tools is None:
            return thinking, answer, []
        self.answer += answer
        text, calls = self.tools.push(self.answer, finished)
        self.called = self.called or bool(calls)
        return thinking, text, calls
