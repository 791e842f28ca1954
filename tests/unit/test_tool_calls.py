"""Tools in chat prompts, and the checks on tools / tool_choice (the calls' parsing: test_tool_parsers.py)."""

import pytest

from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.tool_calls import render_messages, tool_mode
from tokenmill.server.tool_parsers import tool_parser

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


def test_templates_without_tools_get_them_in_a_system_message():
    mode = tool_mode(request(tools=TOOLS))
    body = ChatCompletionRequest(messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    conversation, tools = render_messages(body.messages, mode, False, tool_parser("hermes", None))
    assert tools is None
    assert conversation[0]["content"].startswith("Be brief.") and "get_weather" in conversation[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>' in conversation[2]["content"]
    assert conversation[3] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    conversation, tools = render_messages(body.messages, mode, True, tool_parser("hermes", None))
    assert [t["function"]["name"] for t in tools] == ["get_weather", "get_time"]
    assert conversation[2]["tool_calls"][0]["function"]["arguments"] == {}


def test_a_chat_turn_reads_glm45_values_by_the_offered_tools_schemas():
    # the wiring from the request's tools to the parser: ChatHandler needs no engine to decide how an output
    # is read (importing serving_chat costs a few seconds alone, nothing in a suite run that has torch already)
    from tokenmill.server.serving_chat import ChatHandler

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
    parsing = ChatHandler(None, "m", None, tool_family="glm45")._parsing([1, 2], tool_mode(request(tools=tools)))
    text = ("Checking. <tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>1984</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>")
    turn = parsing.whole(text, [])
    assert (turn.content, [(c.name, c.arguments) for c in turn.calls]) == \
        ("Checking.", [("get_weather", '{"city": "1984", "days": 2}')])
    stream = parsing.stream()
    pushed = [stream.push(text[:5], [], False), stream.push(text[5:30], [], False), stream.push(text[30:], [], True)]
    assert "".join(p[1] for p in pushed) == "Checking. "
    assert [(c.name, c.arguments) for p in pushed for c in p[2]] == [("get_weather", '{"city": "1984", "days": 2}')]
