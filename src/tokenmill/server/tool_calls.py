"""Tool calling on chat: tools in the prompt, and forced calls (tool_choice required or named) as grammars.

A chat template that takes `tools` renders them itself; for one that does not (SmolLM2's), a system
message lists them and asks for the call syntax of the model's family (server/tool_parsers.py reads the
calls back). A forced call is written in Hermes' syntax (also Qwen's):
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

from tokenmill.server.protocol import ChatCompletionRequest, ChatMessage, Tool
from tokenmill.structured.json_text import loads_nested_json
from tokenmill.structured.spec import StructuredOutput

if TYPE_CHECKING:
    from tokenmill.server.tool_parsers import ToolParser

OPEN, CLOSE = "<tool_call>", "</tool_call>"


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


def render_messages(messages: list[ChatMessage], mode: Optional[ToolMode], template_takes_tools: bool,
                    family: "ToolParser") -> tuple[list[dict[str, Any]], Optional[list[dict[str, Any]]]]:
    """The conversation for the chat template, and the `tools` argument to pass it (None: not passed);
    a template that takes no tools gets them in a system message, in `family`'s call syntax."""
    conversation = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        content = m.template_content()
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
        if m.reasoning_content is not None:
            message["reasoning_content"] = m.reasoning_content
        conversation.append(message)
    if mode is None:
        return conversation, None
    specs = [t.model_dump(exclude_none=True) for t in mode.tools]
    if template_takes_tools:
        return conversation, specs
    listing = family.instructions(specs)
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
