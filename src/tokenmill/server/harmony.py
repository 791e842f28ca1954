"""GPT-OSS's chat format, harmony: prompts rendered and outputs read by openai-harmony, token by token.

A GPT-OSS model talks in messages on channels: `<|start|>assistant<|channel|>analysis<|message|>...<|end|>`
is its thinking, the `final` channel its answer, and a `commentary` message addressed `to=functions.NAME`
(ended by `<|call|>`) a tool call whose content is the JSON arguments. tokenmill renders a chat request as
harmony's `render_conversation_for_completion` does (the token ids are harmony's own, not a template's), and
reads the output with harmony's StreamableParser, as vLLM does for `--tool-call-parser openai` and
`--reasoning-parser openai_gptoss`: analysis -> the thinking, final (and commentary without a recipient, a
preamble) -> the answer text, calls to offered functions -> tool calls. A call is announced whole when its
message ends; one cut off (max_tokens) is dropped. Output harmony cannot parse (a model off its format)
is answer text from where parsing failed, never an exception.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Collection, Optional

from tokenmill.server.harmony_vocab import load_encoding
from tokenmill.server.tool_parsers import CallDelta, ParsedCall, call_id, known_call

if TYPE_CHECKING:
    from tokenmill.server.protocol import ChatMessage
    from tokenmill.server.tool_calls import ToolMode

HARMONY_ARCHITECTURES = ("GptOssForCausalLM",)
TOOL_PARSER, REASONING_PARSER = "openai", "openai_gptoss"  # vLLM's names for reading harmony output
EFFORTS = ("low", "medium", "high")
FUNCTIONS = "functions."


class Harmony:
    """The harmony format over a loaded openai-harmony encoding: prompts (`prompt_ids`) and output readers
    (`reader`). Thread-safe: each reader has its own parser."""

    def __init__(self, encoding: Any) -> None:
        import openai_harmony

        self.encoding = encoding
        self._h = openai_harmony
        # <|return|> ends the answer, <|call|> a tool call: a turn's ends, whatever the checkpoint's eos says
        self.stop_token_ids = tuple(encoding.stop_tokens_for_assistant_actions())

    @classmethod
    def load(cls, tokenizer: Any) -> "Harmony":
        """The format for a GPT-OSS model whose tokenizer is `tokenizer` (harmony_vocab.load_encoding)."""
        return cls(load_encoding(tokenizer))

    def prompt_ids(self, messages: list["ChatMessage"], tools: Optional["ToolMode"] = None,
                   template_kwargs: Optional[dict[str, Any]] = None) -> list[int]:
        """The tokens harmony renders for the conversation, ending where the assistant's reply begins:
        a system message (the reasoning effort, `template_kwargs["reasoning_effort"]` as GPT-OSS's template
        takes it), a developer message with the request's system and developer texts as instructions and the
        offered tools, then the conversation. ValueError for what harmony cannot express."""
        h = self._h
        effort = (template_kwargs or {}).get("reasoning_effort", "medium")
        if effort not in EFFORTS:
            raise ValueError(f"reasoning_effort must be one of {', '.join(EFFORTS)}, got {effort!r}")
        system = h.SystemContent.new().with_reasoning_effort(h.ReasoningEffort(effort.capitalize()))
        instructions = "\n\n".join(m.text() for m in messages if m.role in ("system", "developer"))
        developer = h.DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions(instructions)
        if tools is not None:
            developer = developer.with_function_tools([
                h.ToolDescription.new(t.function.name, t.function.description or "",
                                      parameters=t.function.parameters or {"type": "object", "properties": {}})
                for t in tools.tools])
        conversation = [h.Message.from_role_and_content(h.Role.SYSTEM, system)]
        if instructions or tools is not None:
            conversation.append(h.Message.from_role_and_content(h.Role.DEVELOPER, developer))
        conversation += self._messages(messages)
        return list(self.encoding.render_conversation_for_completion(
            h.Conversation.from_messages(conversation), h.Role.ASSISTANT))

    def _messages(self, messages: list["ChatMessage"]) -> list[Any]:
        """The user, assistant and tool messages as harmony messages; a tool result is addressed from the
        function its call named (`name`, else the call its `tool_call_id` answers)."""
        h = self._h
        called: dict[str, str] = {}  # tool call id -> function name
        out = []
        for m in messages:
            if m.role == "user":
                out.append(h.Message.from_role_and_content(h.Role.USER, m.text()))
            elif m.role == "assistant":
                if m.reasoning_content:
                    out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, m.reasoning_content)
                               .with_channel("analysis"))
                if m.text():
                    out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, m.text()).with_channel("final"))
                for call in m.tool_calls or []:
                    called[call.id] = call.function.name
                    out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, call.function.arguments)
                               .with_channel("commentary").with_recipient(FUNCTIONS + call.function.name)
                               .with_content_type("<|constrain|>json"))
            elif m.role == "tool":
                name = m.name or called.get(m.tool_call_id or "")
                if name is None:
                    raise ValueError("a tool message needs `name` or the `tool_call_id` of an earlier assistant "
                                     "tool call (harmony addresses a result from its function)")
                out.append(h.Message.from_author_and_content(h.Author.new(h.Role.TOOL, FUNCTIONS + name), m.text())
                           .with_channel("commentary").with_recipient("assistant"))
        return out

    def reader(self, names: Collection[str]) -> "HarmonyReader":
        """A reader of one output, counting calls to the functions in `names` as tool calls."""
        return HarmonyReader(self, names)


@dataclass
class HarmonyPiece:
    """What one push of output tokens gives: thinking and answer text to send, and calls now complete."""

    thinking: str = ""
    text: str = ""
    calls: tuple[ParsedCall, ...] = ()


class HarmonyReader:
    """Reads one output token by token through harmony's StreamableParser.

    Invariant: every token pushed went either through the parser (`broken` empty) or, from the first the
    parser refused on, into `broken`, which is answer text decoded when the output finishes."""

    def __init__(self, harmony: Harmony, names: Collection[str]) -> None:
        h = harmony._h
        self.harmony, self.names = harmony, names
        self.parser = h.StreamableParser(harmony.encoding, h.Role.ASSISTANT)
        self.done = 0  # messages of parser.messages already read
        self.broken: list[int] = []

    def push(self, token_ids: list[int], finished: bool) -> HarmonyPiece:
        """The piece the output's next `token_ids` make; `finished` on the last push."""
        piece = HarmonyPiece()
        calls: list[ParsedCall] = []
        for token in token_ids:
            if self.broken:
                self.broken.append(token)
                continue
            try:
                self.parser.process(token)
            except Exception:  # HarmonyError: the output left the format; the rest is plain text
                self.broken.append(token)
                continue
            self._take_delta(piece)
            calls += self._finished_calls()
        if finished and self.broken:
            piece.text += self.harmony.encoding.decode(self.broken)
        piece.calls = tuple(calls)
        return piece

    def _take_delta(self, piece: HarmonyPiece) -> None:
        """Add the text the last token added to the open message, by its channel (calls wait for its end)."""
        delta = self.parser.last_content_delta
        if not delta or self._call_name(self.parser.current_recipient) is not None:
            return
        if self.parser.current_channel == "analysis":
            piece.thinking += delta
        else:
            piece.text += delta

    def _finished_calls(self) -> list[ParsedCall]:
        """The calls among the messages completed since the last look."""
        messages = self.parser.messages
        calls = []
        for message in messages[self.done:]:
            name = self._call_name(message.recipient)
            if name is not None:
                text = "".join(getattr(c, "text", "") for c in message.content)
                call = known_call(name, text, self.names)
                if call is not None:
                    calls.append(call)
        self.done = len(messages)
        return calls

    def _call_name(self, recipient: Optional[str]) -> Optional[str]:
        """The offered function a message's recipient names, else None (its content is then text)."""
        if recipient and recipient.startswith(FUNCTIONS) and recipient[len(FUNCTIONS):] in self.names:
            return recipient[len(FUNCTIONS):]
        return None


@dataclass(frozen=True)
class HarmonyParsing:
    """How one request's output is read in harmony: the format and the function names it may call."""

    harmony: Harmony
    names: frozenset[str] = frozenset()

    def whole(self, token_ids: list[int]) -> tuple[Optional[str], str, list[ParsedCall]]:
        """(thinking, None when the model wrote none; the answer text; the calls) of a finished output."""
        piece = self.harmony.reader(self.names).push(list(token_ids), True)
        return (piece.thinking or None), piece.text, list(piece.calls)

    def stream(self) -> "HarmonyStream":
        """A reader of one streamed output, in call deltas."""
        return HarmonyStream(self.harmony.reader(self.names))


class HarmonyStream:
    """A streamed output's pieces as (thinking, text, call deltas), each call announced whole."""

    def __init__(self, reader: HarmonyReader) -> None:
        self.reader = reader
        self.count = 0

    def push(self, token_ids: list[int], finished: bool) -> tuple[str, str, list[CallDelta]]:
        """(thinking, answer text, call deltas) to send for the output's next `token_ids`."""
        piece = self.reader.push(token_ids, finished)
        deltas = []
        for call in piece.calls:
            deltas.append(CallDelta(self.count, call_id(), call.name, call.arguments))
            self.count += 1
        return piece.thinking, piece.text, deltas


def harmony_for(architecture: str, tokenizer: Any, reasoning_parser: Optional[str],
                tool_call_parser: str) -> Optional[Harmony]:
    """The harmony format when the model is GPT-OSS, else None; ValueError for parsers that do not fit the
    model: GPT-OSS reads its thinking and calls only through harmony (reasoning parser none or openai_gptoss,
    tool parser auto or openai), and the harmony parsers need a GPT-OSS model."""
    if architecture not in HARMONY_ARCHITECTURES:
        if reasoning_parser == REASONING_PARSER or tool_call_parser == TOOL_PARSER:
            raise ValueError(f"--reasoning-parser {REASONING_PARSER} and --tool-call-parser {TOOL_PARSER} read "
                             f"GPT-OSS's harmony format; this model is {architecture}")
        return None
    if reasoning_parser not in (None, REASONING_PARSER):
        raise ValueError(f"GPT-OSS writes its reasoning in the harmony format: --reasoning-parser must be "
                         f"{REASONING_PARSER} or unset, got {reasoning_parser}")
    if tool_call_parser not in ("auto", TOOL_PARSER):
        raise ValueError(f"GPT-OSS writes its tool calls in the harmony format: --tool-call-parser must be "
                         f"{TOOL_PARSER} or auto, got {tool_call_parser}")
    return Harmony.load(tokenizer)
