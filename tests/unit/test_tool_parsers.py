"""Tool calls parsed per model family (hermes, llama3_json, mistral, pythonic), whole and streamed.

Streamed content is defined as: the whole text when the output has no calls; otherwise the text before the
first call's marker, exactly as generated (not stripped): `<tool_call>` (hermes), `[TOOL_CALLS]` (mistral),
and nothing at all for llama3_json and pythonic, whose whole output is the calls.
"""

import json
import re

import pytest

from tokenmill.server.tool_parsers import (PARSERS, CallDelta, ParsedCall, parser_for_template, tool_parser)

NAMES = {"get_weather", "get_time"}
SPECS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time"}}]
DEEP = "[" * 50000 + "]" * 50000
NESTED = {"q": 'say "hi" <tool_call> [TOOL_CALLS]; done', "opts": {"a": [1, {"b": None}], "ok": True}}
WEATHER = ParsedCall("get_weather", '{"city": "Oslo"}')
TIME = ParsedCall("get_time", "{}")


def parse(family, text):
    return PARSERS[family]().parse(text, NAMES)


# (family, output, content parse() gives, calls parse() gives, content a stream sends)
CALLS = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', None,
     [WEATHER], ""),
    ("hermes", 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
     '\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call> Done.', "Let me check. \n Done.",
     [WEATHER, TIME], "Let me check. "),
    ("hermes", '<tool_call>{"name": "get_weather", "parameters": ' + json.dumps(NESTED) + "}</tool_call>", None,
     [ParsedCall("get_weather", json.dumps(NESTED))], ""),
    ("hermes", '<tool_call>{"name": "get_time"}</tool_call>', None, [TIME], ""),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>', None,
     [WEATHER], ""),
    ("hermes", 'a <tool_call>{bad}</tool_call> b <tool_call>{"name": "get_time"}</tool_call> <tool_call>{"na',
     'a <tool_call>{bad}</tool_call> b  <tool_call>{"na', [TIME], "a <tool_call>{bad}</tool_call> b "),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None, [WEATHER], ""),
    ("llama3_json", ' <|python_tag|>{"name": "get_weather", "arguments": {"city": "Oslo"}}; {"name": "get_time", '
     '"parameters": {}}\n', None, [WEATHER, TIME], ""),
    ("llama3_json", '{"name": "get_weather", "parameters": ' + json.dumps(NESTED) + "};", None,
     [ParsedCall("get_weather", json.dumps(NESTED))], ""),
    ("llama3_json", '{"name": "get_time"}', None, [TIME], ""),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]', None, [WEATHER], ""),
    ("mistral", 'Let me look. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
     '{"name": "get_time", "arguments": {}}]', "Let me look.", [WEATHER, TIME], "Let me look. "),
    ("mistral", 'Sure.\n[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}', "Sure.",
     [WEATHER, TIME], "Sure.\n"),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Oslo"}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}', None,
     [WEATHER, TIME], ""),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]" + json.dumps(NESTED), None,
     [ParsedCall("get_weather", json.dumps(NESTED))], ""),
    ("mistral", '[TOOL_CALLS][{"name": "get_time"}]', None, [TIME], ""),
    ("pythonic", '[get_weather(city="Oslo")]', None, [WEATHER], ""),
    ("pythonic", '<|python_start|>[get_weather(city=\'Oslo\'), get_time()]<|python_end|>', None, [WEATHER, TIME], ""),
    ("pythonic", "\n[get_weather(q='say \"hi\" <tool_call> [TOOL_CALLS]; done', opts={'a': [1, {'b': None}], "
     "'ok': True})]", None, [ParsedCall("get_weather", json.dumps(NESTED))], ""),
    ("pythonic", "[get_time()]", None, [TIME], ""),
]

# outputs that are no calls for any family, some with what starts like a call marker
PLAIN = ["A plain answer.", "", "  \n ", "Use a <tool to fix it, or <tool_call", "a < b <= c",
         "See [TOOL tags and [TOOL_CALLS", "[TOOL_CALLS] nothing here", "[1, 2, 3] are numbers",
         '{"answer": 42}', "<|python_tag|>print(1)", "a <|python_ta b", "<|python_start|>[x]",
         '<tool_call>{"name": "get_time"', '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>']

BROKEN = {  # outputs that look like calls but are not: broken, unknown functions, too deep, not literals
    "hermes": ["<tool_call>{not json}</tool_call>", '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
               '<tool_call>{"name": ["get_time"]}</tool_call>', '<tool_call>{"name": "get_time", "arguments": [1]}'
               "</tool_call>", '<tool_call>{"name": "get_time", "arguments": ' + DEEP + "}</tool_call>",
               "<tool_call>" + DEEP + "</tool_call>"],
    "llama3_json": ['{"name": "get_time", "parameters": {}', '{"name": "nope", "parameters": {}}',
                    '{"name": "get_time"}; {"name": "nope"}', '{"name": "get_time"}; {broken',
                    'Sure: {"name": "get_time"}', '{"name": "get_time", "parameters": ' + DEEP + "}",
                    "{" * 50000 + "}" * 50000],
    "mistral": ['[TOOL_CALLS][{"name": "get_time", "arguments": {}', '[TOOL_CALLS][{"name": "nope"}]',
                '[TOOL_CALLS]get_time{}[TOOL_CALLS]nope{}', "[TOOL_CALLS]get_time", "[TOOL_CALLS][]",
                "[TOOL_CALLS]get_time[ARGS]" + DEEP, "[TOOL_CALLS]" + DEEP, '[TOOL_CALLS]get_time[ARGS]"{x"'],
    "pythonic": ['[get_time(]', "[get_weather('Oslo')]", "[get_weather(city=oslo)]", "[nope()]",
                 "[get_time(), nope()]", "[get_weather(**kw)]", "[get_weather(city={1, 2})]",
                 "[get_weather(n=1e999)]", "[get_weather(b=b'x')]", "[os.system(c='ls')]", "[]", "get_time()",
                 "Sure: [get_time()]", "[get_time(x=\0)]", DEEP, "[get_time(x=" + DEEP + ")]",
                 "[get_time(x=" + "{'a': " * 50000 + "1" + "}" * 50000 + ")]", "[get_time(x=" + "-" * 50000 + "1)]",
                 "[get_time(s='" + "x" * 300_000 + "')]"],
}


@pytest.mark.parametrize("family,text,content,calls,_", CALLS)
def test_calls_parse(family, text, content, calls, _):
    assert parse(family, text) == (content, calls)


@pytest.mark.parametrize("family", PARSERS)
def test_what_is_no_call_stays_text(family):
    for text in PLAIN + BROKEN[family]:
        assert parse(family, text) == (text, [])


def stream(family, text):
    """Streams `text` cut at every character: (the content sent, the calls sent, how many pushes came
    before each call's first delta)."""
    streamer = PARSERS[family]().stream(NAMES)
    content, deltas, announced = "", [], []
    for cut in range(len(text) + 1):
        piece, new = streamer.push(text[:cut], False)
        content += piece
        deltas += new
        announced += [cut] * len(new)
    piece, new = streamer.push(text, True)
    deltas += new
    return content + piece, calls_of(deltas), announced + [len(text) + 1] * len(new)


def calls_of(deltas: list[CallDelta]) -> list[ParsedCall]:
    """The calls the deltas make, checking their ids and that each call starts with its id and name."""
    calls, ids = [], {}
    for delta in deltas:
        if delta.index not in ids:
            assert delta.index == len(calls) and delta.name and re.fullmatch(r"call_[0-9a-f]{24}", delta.id)
            ids[delta.index] = delta.id
            calls.append([delta.name, ""])
        else:
            assert delta.name is None and delta.id in (None, ids[delta.index])
        calls[delta.index][1] += delta.arguments
    assert len(set(ids.values())) == len(ids)
    return [ParsedCall(name, arguments) for name, arguments in calls]


@pytest.mark.parametrize("family,text,_,calls,streamed", CALLS)
def test_streams_send_the_text_before_the_calls_then_the_calls(family, text, _, calls, streamed):
    content, streamed_calls, _ = stream(family, text)
    assert content == streamed
    marker = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}.get(family)
    assert text[len(streamed):].startswith(marker) if marker else streamed == ""
    assert streamed_calls == calls


@pytest.mark.parametrize("family", PARSERS)
def test_streams_of_text_send_it_unchanged(family):
    for text in PLAIN + [t for t in BROKEN[family] if len(t) < 1000]:
        assert stream(family, text)[:2] == (text, [])


def test_hermes_streams_each_call_when_its_block_closes():
    text = 'Hi <tool_call>{"name": "get_time"}</tool_call> and <tool_call>{"name": "get_weather"}</tool_call>'
    assert stream("hermes", text)[2] == [text.index("</tool_call>") + 12, len(text)]
    streamer = PARSERS["hermes"]().stream(NAMES)
    assert streamer.push("a < b <", False) == ("a < b ", [])
    assert streamer.push("a < b <= c", True) == ("<= c", [])


def test_streamed_calls_of_whole_output_families_wait_for_the_end():
    for family, text in [("llama3_json", '{"name": "get_time"}; {"name": "get_weather"}'),
                         ("mistral", "[TOOL_CALLS]get_time{}[TOOL_CALLS]get_weather{}"),
                         ("pythonic", "[get_time(), get_weather()]")]:
        assert stream(family, text)[2] == [len(text) + 1] * 2


def test_instructions_show_each_familys_syntax():
    listing = "\n".join(json.dumps(s["function"]) for s in SPECS)
    hermes = ('You can call functions. To call one, answer with\n<tool_call>\n{"name": <function name>, '
              '"arguments": <its arguments as a JSON object>}\n</tool_call>\nThe functions you can call:\n')
    assert PARSERS["hermes"]().instructions(SPECS) == hermes + listing
    for family, syntax in [("llama3_json", '"parameters"'), ("mistral", "[TOOL_CALLS]"), ("pythonic", "func_name1(")]:
        prompt = PARSERS[family]().instructions(SPECS)
        assert syntax in prompt and prompt.endswith(listing)


@pytest.mark.parametrize("template,family", [
    (None, "hermes"), ("{{ messages }}", "hermes"),
    ('For each function call, return a json object within <tool_call></tool_call> XML tags', "hermes"),
    ("{%- if message.tool_calls %}{{- '[TOOL_CALLS][' }}", "mistral"),
    ("{{- '<|python_tag|>' + tool_call.name + '.call(' }}", "llama3_json"),
    ("you MUST put it in the format of [func_name1(params_name1=params_value1, params_name2=params_value2...), "
     "func_name2(params)]", "pythonic"),
    ("[func_name1(params) ... {{- '<|python_tag|>' }}", "pythonic"),
    ("call them as func_name(param=value)", "pythonic"),
])
def test_auto_picks_the_family_a_template_shows(template, family):
    assert parser_for_template(template) == family
    assert tool_parser("auto", template).name == family


def test_parsers_are_found_by_name():
    assert {name: tool_parser(name, None).name for name in PARSERS} == {name: name for name in PARSERS}
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic"}
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, pythonic"):
        tool_parser("nope", None)
