"""Tool calling on chat: tools in the prompt, forced calls as grammars, calls parsed out of the output.

The call format is Hermes' (also Qwen's): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
A chat template that takes `tools` renders them itself; for one that does not (SmolLM2's), a system
message lists them and asks for that format.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Union

from tokenmill.server.protocol import ChatCompletionRequest, ChatMessage, Tool
from tokenmill.structured.json_text import loads_nested_json
from tokenmill.structured.spec import StructuredOutput

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
DEFAULT_TOOL_PROMPT = (
    "You can call functions. To call one, answer with\n"
    "<tool_call>\n{\"name\": <function name>, \"arguments\": <its arguments as a JSON object>}\n</tool_call>\n"
    "The functions you can call:\n")


@dataclass
class ToolMode:
    """The tools a chat request offers and `choice`: "auto", "required", or the one function's name."""

    tools: list[Tool]
    choice: str

    @property
    def forced(self) -> bool:
        """Whether the output must be a call (required, or a named function)."""
        return self.choice != "auto"


def tool_mode(body: ChatCompletionRequest) -> Optional[ToolMode]:
    """How `body` uses tools (None: not at all); ValueError when tools and tool_choice disagree."""
    choice = body.tool_choice
    named = None if choice is None or isinstance(choice, str) else choice.function.name
    if not body.tools:
        if named is not None or choice == "required":
            raise ValueError("tool_choice requires tools: none were given")
        return None
    if choice == "none":
        return None
    names = [t.function.name for t in body.tools]
    if named is not None and named not in names:
        raise ValueError(f"tool_choice names function {named!r}, which is not among the tools ({', '.join(names)})")
    mode = ToolMode(body.tools, named or choice or "auto")
    if mode.forced and body.structured_output() is not None:
        raise ValueError("tool_choice required or a named function cannot be combined with another output constraint")
    return mode


def render_messages(messages: list[ChatMessage], mode: Optional[ToolMode], template_takes_tools: bool
                    ) -> tuple[list[dict[str, Any]], Optional[list[dict[str, Any]]]]:
    """The conversation for the chat template, and the `tools` argument to pass it (None: not passed)."""
    conversation = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        content = m.text()
        if m.tool_calls and not template_takes_tools:
            content += "".join(f"{OPEN}\n{_call_json(c.function.name, c.function.arguments)}\n{CLOSE}"
                               for c in m.tool_calls)
        message: dict[str, Any] = {"role": role, "content": content}
        if m.tool_calls and template_takes_tools:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                     for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        conversation.append(message)
    if mode is None:
        return conversation, None
    specs = [t.model_dump(exclude_none=True) for t in mode.tools]
    if template_takes_tools:
        return conversation, specs
    listing = DEFAULT_TOOL_PROMPT + "\n".join(json.dumps(s["function"]) for s in specs)
    if conversation and conversation[0]["role"] == "system":
        conversation[0] = {**conversation[0], "content": conversation[0]["content"] + "\n\n" + listing}
    else:
        conversation.insert(0, {"role": "system", "content": listing})
    return conversation, None


def _arguments(text: str) -> Any:
    return loads_nested_json(text, "tool call arguments")


def _call_json(name: str, arguments: Union[str, dict[str, Any]]) -> str:
    args = _arguments(arguments) if isinstance(arguments, str) else arguments
    return json.dumps({"name": name, "arguments": args})


def forced_call(mode: ToolMode) -> StructuredOutput:
    """The grammar of exactly one call, to the named function or (required) to any of the tools."""
    import xgrammar as xgr

    from tokenmill.structured.compiler import json_schema_ebnf, xgrammar_message

    def call(tool: Tool) -> Any:
        opening = f'{OPEN}\n{{"name": {json.dumps(tool.function.name)}, "arguments": '
        schema = tool.function.parameters or {"type": "object"}
        try:
            arguments = xgr.Grammar.from_ebnf(json_schema_ebnf(json.dumps(schema)))
        except RuntimeError as exc:
            raise ValueError(f"tool {tool.function.name!r} has invalid parameters: {xgrammar_message(exc)}") from None
        closing = "}\n" + CLOSE
        return xgr.Grammar.concat(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(opening)}"), arguments,
                                  xgr.Grammar.from_ebnf(f"root ::= {json.dumps(closing)}"))

    chosen = [t for t in mode.tools if mode.choice in ("required", t.function.name)]
    grammar = call(chosen[0]) if len(chosen) == 1 else xgr.Grammar.union(*(call(t) for t in chosen))
    return StructuredOutput.grammar(str(grammar))


def parse_tool_calls(text: str, mode: ToolMode) -> tuple[Optional[str], list[dict[str, Any]]]:
    """(the content outside the calls or None, the OpenAI tool_calls) of a finished output. Blocks that
    are not a JSON call to one of the tools stay in the content."""
    names = {t.function.name for t in mode.tools}
    calls, kept, last = [], [], 0
    for match in _CALL.finditer(text):
        try:
            data = loads_nested_json(match.group(1), "a tool call")
        except ValueError:  # not JSON, or too deep for the parser: the block stays text
            continue
        if not isinstance(data, dict) or data.get("name") not in names:
            continue
        arguments = data.get("arguments", data.get("parameters", {}))
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": data["name"], "arguments": json.dumps(arguments)}})
        kept.append(text[last:match.start()])
        last = match.end()
    if not calls:
        return text, []
    kept.append(text[last:])
    content = "".join(kept).strip()
    return content or None, calls


class ToolCallStream:
    """Streams a tool-enabled completion: content is sent as it comes, except from the first `<tool_call>`
    on (and any tail that may be its beginning), which is held until the end and parsed."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.sent = 0

    def push(self, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content to send now, tool calls to send now) for the cumulative `text`."""
        if finished:
            calls = parse_tool_calls(text, self.mode)[1]
            end = text.find(OPEN) if calls else len(text)  # after the first call, content is not streamed
        else:
            end = text.find(OPEN)
            if end < 0:
                end = len(text) - _held_tail(text)
            calls = []
        delta = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta, calls


def _held_tail(text: str) -> int:
    """The length of the longest tail of `text` that could still grow into `<tool_call>`."""
    for keep in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-keep:]):
            return keep
    return 0
