"""Tool calls parsed out of generated text, one parser per model family, like vLLM's `--tool-call-parser`.

hermes       `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, any number, anywhere in the text.
llama3_json  the whole output is `{"name": "f", "parameters": {...}}`, or several joined by `;`, maybe after
             `<|python_tag|>`.
mistral      text, then `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` (v1-v3 tokenizers) or
             `[TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g{...}` (v11+).
pythonic     the whole output is a Python list of calls with keyword arguments: `[f(city="Paris"), g()]`,
             maybe inside `<|python_start|>` ... `<|python_end|>`.
glm45        `<tool_call>f\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>`, any number,
             anywhere (GLM-4.5/4.6); a value is JSON (or a Python literal) unless its parameter is a string.
granite      the whole output is `<|tool_call|>[{"name": "f", "arguments": {...}}, ...]` (or `<tool_call>[...]`).
deepseek_v3  text, then `<｜tool▁calls▁begin｜>` and per call
             `<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{...}\n```<｜tool▁call▁end｜>`, then
             `<｜tool▁calls▁end｜>` (DeepSeek-V3, R1).
deepseek_v31 the same without the type and the code fence: `<｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`.

Output that does not parse as calls (broken JSON, unknown functions, nesting deeper than MAX_NESTING) is
content, never an exception. Apart from hermes and glm45, whose blocks count one by one, a family's calls are
all or nothing: one bad call makes the whole output content.

`names`, everywhere below, holds the functions the request offers. A Mapping from each name to its parameters'
JSON schema (what the server passes) also tells glm45 which argument values are strings.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Collection, Mapping, Optional

from tokenmill.engine.stop_strings import partial_stop_suffix
from tokenmill.structured.json_text import JSON_STRING, MAX_NESTING, bracket_depth, loads_nested_json

HERMES_PROMPT = (  # the prompt tokenmill has always used
    "You can call functions. To call one, answer with\n"
    "<tool_call>\n{\"name\": <function name>, \"arguments\": <its arguments as a JSON object>}\n</tool_call>\n"
    "The functions you can call:\n")
MAX_PYTHONIC_CHARS = 200_000  # longer pythonic output stays text: ast builds a node per token
_PYTHON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"' r"|'(?:[^'\\]|\\.)*'")


@dataclass(frozen=True)
class ParsedCall:
    """One tool call found in the output: the function name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class CallDelta:
    """A piece of a streamed call: `index` counts calls from 0 in output order; the first delta of a call
    has `id` and `name`, later ones only pieces of `arguments`, which concatenate to ParsedCall.arguments."""

    index: int
    id: Optional[str] = None
    name: Optional[str] = None
    arguments: str = ""


_Found = tuple[list[ParsedCall], str, int]  # (the calls, the content around them, where the first call starts)
_NOTHING: _Found = ([], "", 0)


class ToolParser:
    """Parses one family's tool calls. Subclasses set `name`, `prompt`, and implement `_find`; those whose
    calls may begin mid-output override `_settled`."""

    name = ""
    prompt = ""
    _openers: tuple[str, ...] = ()  # whole-output families: how an output of calls begins, after whitespace

    def instructions(self, tool_specs: list[dict[str, Any]]) -> str:
        """System-prompt text asking for calls in this family's syntax, listing the OpenAI tool dicts."""
        return self.prompt + "\n".join(json.dumps(s["function"]) for s in tool_specs)

    def parse(self, text: str, names: Collection[str]) -> tuple[Optional[str], list[ParsedCall]]:
        """(the content outside the calls, stripped, or None; the calls) of a finished output. Without calls
        to functions in `names`: (text, [])."""
        calls, content, _ = self._find(text, names)
        if not calls:
            return text, []
        return content.strip() or None, calls

    def stream(self, names: Collection[str]) -> ToolStream:
        """A stream over one output's cumulative text."""
        return ToolStream(self, names)

    def _find(self, text: str, names: Collection[str]) -> _Found:
        """The calls of a finished `text`; _NOTHING's empty list when there are none."""
        raise NotImplementedError

    def _settled(self, text: str, names: Collection[str]) -> tuple[int, list[ParsedCall]]:
        """For an unfinished `text`: how much of it is content for sure, and the calls that are sure.
        Invariant (ToolStream relies on it): for every text that `text` may grow into, those calls are the
        first calls _find gives it, and the content end is no later than where its first call starts."""
        stripped = text.lstrip()
        if not stripped or any(stripped.startswith(o) or o.startswith(stripped) for o in self._openers):
            return 0, []
        return len(text), []


def call_id() -> str:
    """A tool call's id, like OpenAI's."""
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolStream:
    """Streams one output: content as it comes, calls as they are sure (a call is announced with its id,
    name and whole arguments at once). Content stops where the first call starts."""

    def __init__(self, parser: ToolParser, names: Collection[str]) -> None:
        self._parser, self._names = parser, names
        self._sent = 0
        self._ids: list[str] = []

    def push(self, text: str, finished: bool) -> tuple[str, list[CallDelta]]:
        """(content to send now, call deltas to send now) for the cumulative `text`."""
        if finished:
            calls, _, first = self._parser._find(text, self._names)
            end = first if calls else len(text)
        else:
            end, calls = self._parser._settled(text, self._names)
        deltas = []
        for index in range(len(self._ids), len(calls)):
            self._ids.append(call_id())
            deltas.append(CallDelta(index, self._ids[index], calls[index].name, calls[index].arguments))
        content = text[self._sent:end]
        self._sent = max(self._sent, end)
        return content, deltas


def known_call(name: Any, arguments: Any, names: Collection[str]) -> Optional[ParsedCall]:
    """The call to `name`, when it is one of `names` and `arguments` is an object, JSON text of one, or None."""
    if not isinstance(name, str) or name not in names:
        return None
    if isinstance(arguments, str):
        try:
            arguments = loads_nested_json(arguments, "tool call arguments")
        except ValueError:
            return None
    if arguments is None:
        arguments = {}
    return ParsedCall(name, json.dumps(arguments)) if isinstance(arguments, dict) else None


def _json_call(data: Any, names: Collection[str]) -> Optional[ParsedCall]:
    """The call a parsed `{"name": ..., "arguments" or "parameters": ...}` object makes, if any."""
    if not isinstance(data, dict):
        return None
    return known_call(data.get("name"), data.get("arguments", data.get("parameters")), names)


def _split_json(text: str, separator: str) -> list[str]:
    """`text` split at each `separator` outside a JSON string."""
    masked = JSON_STRING.sub(lambda m: "_" * len(m.group()), text)
    ends = [m.start() for m in re.finditer(re.escape(separator), masked)]
    starts = [0] + [end + len(separator) for end in ends]
    return [text[start:end] for start, end in zip(starts, ends + [len(text)])]


class HermesParser(ToolParser):
    """`<tool_call>` blocks holding a JSON call; a block that is not a call to a known function stays text."""

    name, prompt = "hermes", HERMES_PROMPT
    OPEN = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def _blocks(self, text: str, names: Collection[str]) -> tuple[list[tuple[re.Match[str], ParsedCall]], int]:
        """The closed blocks that are calls, and where the last closed block ends. A closed block matches
        the same in every text that this one grows into: the match ends at the first `</tool_call>`."""
        calls, last = [], 0
        for match in self._BLOCK.finditer(text):
            last = match.end()
            try:
                call = self._block_call(match.group(1), names)
            except ValueError:
                continue
            if call is not None:
                calls.append((match, call))
        return calls, last

    def _block_call(self, body: str, names: Collection[str]) -> Optional[ParsedCall]:
        """The call a block's stripped `body` makes, if any (ValueError also means none)."""
        return _json_call(loads_nested_json(body, "a tool call"), names)

    def _find(self, text: str, names: Collection[str]) -> _Found:
        blocks, _ = self._blocks(text, names)
        if not blocks:
            return _NOTHING
        kept, last = [], 0
        for match, _ in blocks:
            kept.append(text[last:match.start()])
            last = match.end()
        kept.append(text[last:])
        return [call for _, call in blocks], "".join(kept), blocks[0][0].start()

    def _settled(self, text: str, names: Collection[str]) -> tuple[int, list[ParsedCall]]:
        if self.OPEN[0] not in text:
            return len(text), []
        blocks, last = self._blocks(text, names)
        if blocks:
            return blocks[0][0].start(), [call for _, call in blocks]
        opened = text.find(self.OPEN, last)
        return (opened if opened >= 0 else len(text) - partial_stop_suffix(text, [self.OPEN])), []


class Llama3JsonParser(ToolParser):
    """The whole output is JSON calls separated by `;`, optionally after `<|python_tag|>`."""

    name = "llama3_json"
    prompt = ("You can call functions. To call one, answer with nothing but\n"
              "{\"name\": <function name>, \"parameters\": <its arguments as a JSON object>}\n"
              "To call several, separate them with \";\".\nThe functions you can call:\n")
    TAG = "<|python_tag|>"
    _openers = ("{", TAG)

    def _find(self, text: str, names: Collection[str]) -> _Found:
        body = text.strip()
        body = body[len(self.TAG):] if body.startswith(self.TAG) else body
        if not body.lstrip().startswith("{"):
            return _NOTHING
        calls = []
        for piece in _split_json(body, ";"):
            if not piece.strip():
                continue
            try:
                call = _json_call(loads_nested_json(piece, "a tool call"), names)
            except ValueError:
                return _NOTHING
            if call is None:
                return _NOTHING
            calls.append(call)
        return calls, "", 0


class MistralParser(ToolParser):
    """Text, then calls after `[TOOL_CALLS]`: a JSON list of them, or `name[ARGS]{...}` / `name{...}`
    segments each led by `[TOOL_CALLS]`."""

    name = "mistral"
    prompt = ("You can call functions. To call them, answer with\n"
              "[TOOL_CALLS][{\"name\": <function name>, \"arguments\": <its arguments as a JSON object>}]\n"
              "(the list may hold several calls)\nThe functions you can call:\n")
    MARK = "[TOOL_CALLS]"

    def _find(self, text: str, names: Collection[str]) -> _Found:
        first = text.find(self.MARK)
        if first < 0:
            return _NOTHING
        calls: list[Optional[ParsedCall]] = []
        for segment in _split_json(text[first + len(self.MARK):], self.MARK):
            segment = segment.strip()
            try:
                if segment[:1] in ("[", "{"):
                    data = loads_nested_json(segment, "tool calls")
                    calls += [_json_call(item, names) for item in (data if isinstance(data, list) else [data])]
                elif segment:
                    head, args_mark, arguments = segment.partition("[ARGS]")
                    if not args_mark:
                        brace = segment.find("{")
                        head, arguments = (segment[:brace], segment[brace:]) if brace > 0 else (segment, "")
                    name = head.partition("[CALL_ID]")[0].strip()
                    calls.append(known_call(name, loads_nested_json(arguments, "tool call arguments"), names))
            except ValueError:
                return _NOTHING
        if not calls or None in calls:
            return _NOTHING
        return [c for c in calls if c is not None], text[:first], first

    def _settled(self, text: str, names: Collection[str]) -> tuple[int, list[ParsedCall]]:
        first = text.find(self.MARK)
        return (first if first >= 0 else len(text) - partial_stop_suffix(text, [self.MARK])), []


class PythonicParser(ToolParser):
    """The whole output is a Python list of calls with keyword arguments whose values are literals,
    optionally inside `<|python_start|>` ... `<|python_end|>`."""

    name = "pythonic"
    prompt = ("You can call functions. To call them, answer with nothing but a Python list of calls with "
              "keyword arguments, like\n[func_name1(param1=value1, param2=value2), func_name2(param=value)]\n"
              "The functions you can call:\n")
    START, END = "<|python_start|>", "<|python_end|>"
    _openers = ("[", START)

    def _find(self, text: str, names: Collection[str]) -> _Found:
        body = text.strip()
        if body.startswith(self.START):
            body = body[len(self.START):]
            body = body[:-len(self.END)] if body.endswith(self.END) else body
        body = body.strip()
        if not body.startswith("[") or len(body) > MAX_PYTHONIC_CHARS or _python_depth(body) > MAX_NESTING:
            return _NOTHING
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return _NOTHING
            calls = [self._call(node, names) for node in tree.elts]
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return _NOTHING
        return (_NOTHING if None in calls else ([c for c in calls if c is not None], "", 0))

    @staticmethod
    def _call(node: ast.expr, names: Collection[str]) -> Optional[ParsedCall]:
        """The call `node` makes, if it is `name(key=literal, ...)`; ValueError/TypeError from literals
        that are not JSON (sets, bytes, complex numbers, inf)."""
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        if any(k.arg is None for k in node.keywords):
            return None
        arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        json.dumps(arguments, allow_nan=False)
        return known_call(node.func.id, arguments, names)


class Glm45Parser(HermesParser):
    """GLM-4.5's `<tool_call>` blocks: the function's name, then `<arg_key>`/`<arg_value>` pairs. A block is
    a call when it holds nothing else and names a known function; otherwise it stays text, as in hermes."""

    name = "glm45"
    prompt = ("You can call functions. To call one, answer with\n<tool_call><function name>\n"
              "<arg_key><argument name></arg_key>\n<arg_value><argument value></arg_value>\n...\n</tool_call>\n"
              "The functions you can call:\n")
    _PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)

    def _block_call(self, body: str, names: Collection[str]) -> Optional[ParsedCall]:
        first_key = body.find("<arg_key>")
        at = len(body) if first_key < 0 else first_key
        name, arguments = body[:at].strip(), {}
        while at < len(body):
            pair = self._PAIR.match(body, at)
            if pair is None:
                return None
            key = pair.group(1).strip()
            arguments[key] = glm_value(pair.group(2).strip(), _declared_type(names, name, key))
            at = pair.end()
        return known_call(name, arguments, names)


def glm_value(text: str, declared_type: Any) -> Any:
    """An argument value as GLM writes it (vLLM's rule): the text itself for a parameter declared a string;
    else the JSON it is, or the JSON it is once its escapes are undone (`{\\"a\\": 1}`), or the Python
    literal it is, whichever comes first, and the text when none is JSON."""
    if declared_type == "string":
        return text
    for read in (_json_text, _escaped_json_text, _python_literal):
        try:
            value = read(text)
            json.dumps(value, allow_nan=False)  # NaN, sets, bytes... are no JSON value
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            continue
        return value
    return text


def _json_text(text: str) -> Any:
    return loads_nested_json(text, "an argument value")


def _escaped_json_text(text: str) -> Any:
    return loads_nested_json(json.loads(f'"{text}"'), "an argument value")


def _python_literal(text: str) -> Any:
    if len(text) > MAX_PYTHONIC_CHARS or _python_depth(text) > MAX_NESTING:
        raise ValueError("too long or deep for ast")  # ast builds a node per token and recurses per level
    return ast.literal_eval(text)


def _declared_type(names: Collection[str], function: str, key: str) -> Any:
    """The JSON schema type `function` declares for its parameter `key`; None when unknown (`names` is no
    Mapping to schemas, or the schema does not say)."""
    schema = names.get(function) if isinstance(names, Mapping) else None
    properties = schema.get("properties") if isinstance(schema, dict) else None
    parameter = properties.get(key) if isinstance(properties, dict) else None
    return parameter.get("type") if isinstance(parameter, dict) else None


class GraniteParser(ToolParser):
    """The whole output is a JSON list of calls after `<|tool_call|>` (Granite 3.0) or `<tool_call>` (3.1+)."""

    name = "granite"
    prompt = ("You can call functions. To call them, answer with nothing but\n"
              "<|tool_call|>[{\"name\": <function name>, \"arguments\": <its arguments as a JSON object>}]\n"
              "(the list may hold several calls)\nThe functions you can call:\n")
    TOKEN, TAG = "<|tool_call|>", "<tool_call>"
    _openers = ("[", TOKEN, TAG)

    def _find(self, text: str, names: Collection[str]) -> _Found:
        body = text.strip().removeprefix(self.TOKEN).removeprefix(self.TAG).lstrip()
        if not body.startswith("["):
            return _NOTHING
        try:
            data = loads_nested_json(body, "tool calls")
        except ValueError:
            return _NOTHING
        calls = [_json_call(item, names) for item in data] if isinstance(data, list) else []
        return _NOTHING if not calls or None in calls else ([c for c in calls if c is not None], "", 0)


class DeepSeekV3Parser(ToolParser):
    """Text, then a section of calls between `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>` holding
    nothing but calls, each `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`.
    Text after the section is content too."""

    name = "deepseek_v3"
    BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    prompt = ("You can call functions. To call them, answer with\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
              "<｜tool▁sep｜><function name>\n```json\n<its arguments as a JSON object>\n```<｜tool▁call▁end｜>"
              "<｜tool▁calls▁end｜>\n(one <｜tool▁call▁begin｜>...<｜tool▁call▁end｜> per call)\n"
              "The functions you can call:\n")
    # (name, arguments); the arguments end at the first fence that closes the call
    _CALL = re.compile(r"\s*<｜tool▁call▁begin｜>[^<\n]*<｜tool▁sep｜>([^<\n]*)\n\s*```(?:json)?\s*(.*?)\s*```\s*"
                       r"<｜tool▁call▁end｜>", re.DOTALL)

    def _find(self, text: str, names: Collection[str]) -> _Found:
        first = text.find(self.BEGIN)
        if first < 0:
            return _NOTHING
        calls, at = [], first + len(self.BEGIN)
        while (match := self._CALL.match(text, at)) is not None:
            call = known_call(match.group(1).strip(), match.group(2), names)
            if call is None:
                return _NOTHING
            calls.append(call)
            at = match.end()
        rest = text[at:].lstrip()
        if not calls or (rest and not rest.startswith(self.END)):
            return _NOTHING  # no call, or something in the section that is none
        return calls, text[:first] + rest[len(self.END):], first

    def _settled(self, text: str, names: Collection[str]) -> tuple[int, list[ParsedCall]]:
        first = text.find(self.BEGIN)
        return (first if first >= 0 else len(text) - partial_stop_suffix(text, [self.BEGIN])), []


class DeepSeekV31Parser(DeepSeekV3Parser):
    """DeepSeek-V3.1's calls: as deepseek_v3's, each `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`."""

    name = "deepseek_v31"
    prompt = ("You can call functions. To call them, answer with\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
              "<function name><｜tool▁sep｜><its arguments as a JSON object><｜tool▁call▁end｜><｜tool▁calls▁end｜>\n"
              "(one <｜tool▁call▁begin｜>...<｜tool▁call▁end｜> per call)\nThe functions you can call:\n")
    _CALL = re.compile(r"\s*<｜tool▁call▁begin｜>([^<\n]*)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)


def _python_depth(text: str) -> int:
    """How deep brackets nest in Python source, strings not counted (roughly: prefixes and triple quotes
    are not told apart, which can only overcount)."""
    return bracket_depth(text, _PYTHON_STRING, "([{", ")]}")


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesParser, Llama3JsonParser, MistralParser, PythonicParser, Glm45Parser, GraniteParser, DeepSeekV3Parser,
    DeepSeekV31Parser)}
_PYTHONIC_TEMPLATE = re.compile(r"\[\s*func_name\w*\(|func_name\w*\(\s*param")


def parser_for_template(chat_template: Optional[str]) -> str:
    """The family `auto` picks for a chat template: the one whose call syntax the template shows; hermes
    when it shows none (tokenmill's own system prompt asks for Hermes calls then)."""
    template = chat_template or ""
    if "<arg_key>" in template:  # before hermes: GLM's calls are <tool_call> blocks too
        return "glm45"
    if DeepSeekV3Parser.BEGIN in template:
        return "deepseek_v3" if "```json" in template else "deepseek_v31"
    if GraniteParser.TOKEN in template:
        return "granite"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if _PYTHONIC_TEMPLATE.search(template):
        return "pythonic"
    if "<|python_tag|>" in template:
        return "llama3_json"
    return "hermes"


def tool_parser(name: str, chat_template: Optional[str]) -> ToolParser:
    """The parser called `name` ("auto": the one parser_for_template picks); ValueError for unknown names."""
    if name == "auto":
        name = parser_for_template(chat_template)
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: auto, {', '.join(PARSERS)}")
    return PARSERS[name]()
