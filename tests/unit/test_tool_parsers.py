"""Tool calls parsed per model family (hermes, llama3_json, mistral, pythonic, glm45, granite, deepseek_v3,
deepseek_v31), whole and streamed.

Streamed content is defined as: the whole text when the output has no calls; otherwise the text before the
first call's marker, exactly as generated (not stripped): `<tool_call>` (hermes, glm45), `[TOOL_CALLS]`
(mistral), `<｜tool▁calls▁begin｜>` (deepseek_v3, deepseek_v31), and nothing at all for llama3_json,
pythonic and granite, whose whole output is the calls.
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
BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"  # DeepSeek's full-width bars and ▁


def glm(name, **arguments):
    """A GLM-4.5 call block, its values written as GLM's template writes them (strings raw, others JSON)."""
    pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}</arg_value>\n"
                    for k, v in arguments.items())
    return f"<tool_call>{name}\n{pairs}</tool_call>"


def v3(name, arguments="{}"):
    """One DeepSeek-V3 call (without the section's begin and end)."""
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{arguments}\n```<｜tool▁call▁end｜>"


def v31(name, arguments="{}"):
    """One DeepSeek-V3.1 call (without the section's begin and end)."""
    return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{arguments}<｜tool▁call▁end｜>"



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
    ("glm45", glm("get_weather", city="Oslo"), None, [WEATHER], ""),
    ("glm45", "Let me check. " + glm("get_weather", city="Oslo") + "\n" + glm("get_time") + " Done.",
     "Let me check. \n Done.", [WEATHER, TIME], "Let me check. "),
    ("glm45", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>", None,
     [WEATHER], ""),  # GLM-4.7 writes no newlines
    ("glm45", glm("get_weather", **NESTED), None, [ParsedCall("get_weather", json.dumps(NESTED))], ""),
    ("glm45", "<tool_call>get_time</tool_call>", None, [TIME], ""),
    ("glm45", "a <tool_call>nope\n</tool_call> b " + glm("get_time") + " <tool_call>get_w",
     "a <tool_call>nope\n</tool_call> b  <tool_call>get_w", [TIME], "a <tool_call>nope\n</tool_call> b "),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', None, [WEATHER], ""),
    ("granite", ' <tool_call> [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", '
     '"arguments": {}}]\n', None, [WEATHER, TIME], ""),
    ("granite", '[{"name": "get_weather", "arguments": ' + json.dumps(NESTED) + "}]", None,
     [ParsedCall("get_weather", json.dumps(NESTED))], ""),
    ("granite", '<|tool_call|>[{"name": "get_time"}]', None, [TIME], ""),
    ("deepseek_v3", BEGIN + v3("get_weather", '{"city": "Oslo"}') + END, None, [WEATHER], ""),
    ("deepseek_v3", "Let me check.\n" + BEGIN + v3("get_weather", '{"city": "Oslo"}') + "\n" + v3("get_time") + END
     + " Done.", "Let me check.\n Done.", [WEATHER, TIME], "Let me check.\n"),
    ("deepseek_v3", BEGIN + v3("get_weather", json.dumps(NESTED, indent=2)) + END, None,
     [ParsedCall("get_weather", json.dumps(NESTED))], ""),
    ("deepseek_v3", BEGIN + v3("get_time"), None, [TIME], ""),  # cut at the section's end
    ("deepseek_v31", BEGIN + v31("get_weather", '{"city": "Oslo"}') + END, None, [WEATHER], ""),
    ("deepseek_v31", "Sure. " + BEGIN + v31("get_weather", '{"city": "Oslo"}') + v31("get_time") + END, "Sure.",
     [WEATHER, TIME], "Sure. "),
    ("deepseek_v31", BEGIN + v31("get_weather", json.dumps(NESTED)) + END, None,
     [ParsedCall("get_weather", json.dumps(NESTED))], ""),
    ("deepseek_v31", BEGIN + v31("get_time"), None, [TIME], ""),
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
    "glm45": ["<tool_call>nope\n</tool_call>", "<tool_call>get_time\n<arg_key>a</arg_key></tool_call>",
              "<tool_call>get_time\nstray text\n</tool_call>", glm("get_time", a=1)[:-12] + "junk</tool_call>",
              '<tool_call>{"name": "get_time"}</tool_call>', "<tool_call>get_time <arg_value>1</arg_value></tool_call>",
              "<tool_call>get_time\n<arg_key>a", "<tool_call>" + DEEP + "</tool_call>"],
    "granite": ['<|tool_call|>[{"name": "get_time", "arguments": {}}', '<|tool_call|>[{"name": "nope"}]',
                '<|tool_call|>[{"name": "get_time"}, {"name": "nope"}]', "<|tool_call|>[]",
                '<|tool_call|>{"name": "get_time"}', 'Sure: <|tool_call|>[{"name": "get_time"}]',
                '<|tool_call|>[{"name": "get_time", "arguments": [1]}]', "<|tool_call|>" + DEEP,
                '[{"name": "get_time", "arguments": ' + DEEP + "}]"],
    "deepseek_v3": [BEGIN + v3("get_time")[:-len("<｜tool▁call▁end｜>")], BEGIN + v3("nope") + END,
                    BEGIN + v3("get_time") + v3("nope") + END, BEGIN + END, BEGIN + v3("get_time") + " junk" + END,
                    BEGIN + v3("get_time", "{bad}") + END, BEGIN + v3("get_time", DEEP) + END,
                    BEGIN + v31("get_time") + END, v3("get_time")],
    "deepseek_v31": [BEGIN + v31("get_time")[:-len("<｜tool▁call▁end｜>")], BEGIN + v31("nope") + END,
                     BEGIN + v31("get_time") + v31("nope") + END, BEGIN + END, BEGIN + v31("get_time") + " junk",
                     BEGIN + v31("get_time", "{bad") + END, BEGIN + v31("get_time", DEEP) + END,
                     BEGIN + v3("get_time") + END, v31("get_time")],
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
    marker = {"hermes": "<tool_call>", "glm45": "<tool_call>", "mistral": "[TOOL_CALLS]", "deepseek_v3": BEGIN,
              "deepseek_v31": BEGIN}.get(family)
    assert text[len(streamed):].startswith(marker) if marker else streamed == ""
    assert streamed_calls == calls


@pytest.mark.parametrize("family", PARSERS)
def test_streams_of_text_send_it_unchanged(family):
    for text in PLAIN + [t for t in BROKEN[family] if len(t) < 1000]:
        assert stream(family, text)[:2] == (text, [])


@pytest.mark.parametrize("family,text", [
    ("hermes", 'Hi <tool_call>{"name": "get_time"}</tool_call> and <tool_call>{"name": "get_weather"}</tool_call>'),
    ("glm45", "Hi " + glm("get_time") + " and " + glm("get_weather", city="Oslo")),
])
def test_block_families_stream_each_call_when_its_block_closes(family, text):
    assert stream(family, text)[2] == [text.index("</tool_call>") + 12, len(text)]
    streamer = PARSERS[family]().stream(NAMES)
    assert streamer.push("a < b <", False) == ("a < b ", [])
    assert streamer.push("a < b <= c", True) == ("<= c", [])


def test_streamed_calls_of_whole_output_families_wait_for_the_end():
    for family, text in [("llama3_json", '{"name": "get_time"}; {"name": "get_weather"}'),
                         ("mistral", "[TOOL_CALLS]get_time{}[TOOL_CALLS]get_weather{}"),
                         ("pythonic", "[get_time(), get_weather()]"),
                         ("granite", '<|tool_call|>[{"name": "get_time"}, {"name": "get_weather"}]'),
                         ("deepseek_v3", BEGIN + v3("get_time") + v3("get_weather") + END),
                         ("deepseek_v31", BEGIN + v31("get_time") + v31("get_weather") + END)]:
        assert stream(family, text)[2] == [len(text) + 1] * 2


def test_instructions_show_each_familys_syntax():
    listing = "\n".join(json.dumps(s["function"]) for s in SPECS)
    hermes = ('You can call functions. To call one, answer with\n<tool_call>\n{"name": <function name>, '
              '"arguments": <its arguments as a JSON object>}\n</tool_call>\nThe functions you can call:\n')
    assert PARSERS["hermes"]().instructions(SPECS) == hermes + listing
    for family, syntax in [("llama3_json", '"parameters"'), ("mistral", "[TOOL_CALLS]"), ("pythonic", "func_name1("),
                           ("glm45", "</arg_key>\n<arg_value>"), ("granite", "<|tool_call|>[{"),
                           ("deepseek_v3", "<｜tool▁sep｜><function name>\n```json\n"),
                           ("deepseek_v31", "<｜tool▁sep｜><its arguments")]:
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
    ("output the function name and arguments within the following XML format:\n<tool_call>{function-name}\n"
     "<arg_key>{arg-key-1}</arg_key>", "glm45"),
    ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] "
     "+ '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}",
     "deepseek_v3"),
    ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + "
     "tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}", "deepseek_v31"),
    ("When a tool is required to answer the user's query, respond with <|tool_call|> followed by a JSON list of "
     "tools used.", "granite"),
])
def test_auto_picks_the_family_a_template_shows(template, family):
    assert parser_for_template(template) == family
    assert tool_parser("auto", template).name == family


def test_parsers_are_found_by_name():
    assert {name: tool_parser(name, None).name for name in PARSERS} == {name: name for name in PARSERS}
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic", "glm45", "granite", "deepseek_v3",
                            "deepseek_v31"}
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, pythonic, glm45, granite, deepseek_v3, "
                                         "deepseek_v31"):
        tool_parser("nope", None)


# what the server passes: each offered function with its parameters' schema
SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                             "opts": {"type": "object"}}}, "get_time": {}}


@pytest.mark.parametrize("value,declared_string,undeclared", [
    ("123", "123", 123), ("true", "true", True), ('{"a": [1, null]}', '{"a": [1, null]}', {"a": [1, None]}),
    ('{\\"a\\": 1}', '{\\"a\\": 1}', {"a": 1}),  # escaped JSON, as GLM sometimes writes objects
    ("None", "None", None), ("{'a': (1, 2)}", "{'a': (1, 2)}", {"a": [1, 2]}),  # Python literals
    ("Oslo", "Oslo", "Oslo"), ("1e999", "1e999", "1e999"), ("{1, 2}", "{1, 2}", "{1, 2}"), ("NaN", "NaN", "NaN"),
    ("-" * 50000 + "1", "-" * 50000 + "1", "-" * 50000 + "1"), ("[" * 50000, "[" * 50000, "[" * 50000),
])
def test_glm45_values_are_json_unless_the_parameter_is_a_string(value, declared_string, undeclared):
    text = f"<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>{value}</arg_value>\n<arg_key>days</arg_key>" \
           f"\n<arg_value>{value}</arg_value>\n</tool_call>"
    expected = ParsedCall("get_weather", json.dumps({"city": declared_string, "days": undeclared}))
    assert PARSERS["glm45"]().parse(text, SCHEMAS) == (None, [expected])
    # without schemas (a plain set of names) no type is known: every value is read as JSON where it is one
    assert PARSERS["glm45"]().parse(text, set(SCHEMAS))[1] == [
        ParsedCall("get_weather", json.dumps({"city": undeclared, "days": undeclared}))]
    streamer = PARSERS["glm45"]().stream(SCHEMAS)
    assert streamer.push(text, False)[1][0].arguments == expected.arguments
