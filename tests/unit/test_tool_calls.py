"""Parsing tool calls out of chat output, whole and streamed, and the checks on tools / tool_choice."""

import json

import pytest

from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.tool_calls import ToolCallStream, parse_tool_calls, render_messages, tool_mode

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time"}}]


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_tool_mode_follows_tool_choice():
    assert tool_mode(request()) is None
    assert tool_mode(request(tools=TOOLS, tool_choice="none")) is None
    assert tool_mode(request(tools=TOOLS)).choice == "auto"
    named = tool_mode(request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert named.choice == "get_time" and named.forced
    with pytest.raises(ValueError, match="requires tools"):
        tool_mode(request(tool_choice="required"))
    with pytest.raises(ValueError, match="cannot be combined"):
        tool_mode(request(tools=TOOLS, tool_choice="required", guided_regex="a"))


def test_calls_are_parsed_and_other_text_stays_content():
    mode = tool_mode(request(tools=TOOLS))
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = parse_tool_calls(text, mode)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert len({c["id"] for c in calls}) == 2
    # not JSON, not a tool, no call, and arguments nested 50,000 deep (a parser would recurse once per level)
    deep = '<tool_call>{"name": "get_time", "arguments": ' + "[" * 50000 + "]" * 50000 + "}</tool_call>"
    for broken in ("<tool_call>{not json}</tool_call>", '<tool_call>{"name": "unknown"}</tool_call>', "no calls", deep):
        assert parse_tool_calls(broken, mode) == (broken, [])


def test_streams_hold_back_what_may_become_a_call():
    mode = tool_mode(request(tools=TOOLS))
    stream = ToolCallStream(mode)
    assert stream.push("Sure <tool", False) == ("Sure ", [])
    assert stream.push("Sure <tool_call>{", False) == ("", [])
    done, calls = stream.push('Sure <tool_call>{"name": "get_time", "arguments": {}}</tool_call>', True)
    assert done == "" and calls[0]["function"]["name"] == "get_time"
    plain = ToolCallStream(mode)
    assert plain.push("a < b", False) == ("a < b", [])
    assert plain.push("a < b <", False) == (" ", [])  # the "<" waits: it may open a call
    assert plain.push("a < b <= c", True) == ("<= c", [])


def test_templates_without_tools_get_them_in_a_system_message():
    mode = tool_mode(request(tools=TOOLS))
    body = ChatCompletionRequest(messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    conversation, tools = render_messages(body.messages, mode, template_takes_tools=False)
    assert tools is None
    assert conversation[0]["content"].startswith("Be brief.") and "get_weather" in conversation[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>' in conversation[2]["content"]
    assert conversation[3] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    conversation, tools = render_messages(body.messages, mode, template_takes_tools=True)
    assert [t["function"]["name"] for t in tools] == ["get_weather", "get_time"]
    assert conversation[2]["tool_calls"][0]["function"]["arguments"] == {}
