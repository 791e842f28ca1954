"""Reasoning parsers: the model's thinking (`<think>…</think>`) split from its answer, whole or streamed.

The names are vLLM's `--reasoning-parser` names. The families write their thinking between `<think>` and
`</think>`; they differ in what an output without the closing tag means:

- `deepseek_r1` (DeepSeek-R1 and its distills, whose templates open `<think>` in the prompt): everything
  before `</think>` is thinking, with or without an opening tag in the output.
- `qwen3` (Qwen3, SmolLM3, whose thinking can be switched off): thinking only when the output opens
  `<think>` itself (or the prompt did); an output that does not is all answer.
- `glm45` (GLM-4.5/4.6): the qwen3 rule, but the prompt's tags count only after its last `<|assistant|>`:
  GLM's template writes a closed `<think></think>` into every earlier assistant turn, which says nothing
  about the turn being generated.

Either way an output cut off before `</think>` is all thinking. The prompt's last tag overrides both
(`ReasoningParser.opening`): one it opened means the output starts thinking; one it closed (thinking
switched off) means the qwen3 rule. The tags must be tokens of the model's vocabulary: the engine starts a
request's output constraint after the end tag's token, so structured output applies to the answer only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from tokenmill.engine.stop_strings import partial_stop_suffix

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    """Splits thinking from the answer for one family (`name`); the tags' token ids tell from a prompt
    whether the template already opened or closed the thinking."""

    name: str
    start_token_id: int
    end_token_id: int
    turn_token_id: Optional[int] = None  # where the turn being generated starts (glm45's `<|assistant|>`)

    def opening(self, prompt_token_ids: list[int]) -> Optional[str]:
        """How the output begins, by the last tag in the prompt: "thinking" when the template opened
        `<think>` (DeepSeek-R1, Qwen3-Thinking); "answer" when it wrote a closed one (thinking switched
        off: the output thinks only if it opens a tag itself, and a request's constraint applies from the
        start); None when the family's rule decides, as it does when no tag follows the prompt's last
        `turn_token_id`."""
        for token in reversed(prompt_token_ids):
            if token == self.turn_token_id:
                return None  # tags before it belong to earlier turns
            if token == self.end_token_id:
                return "answer"
            if token == self.start_token_id:
                return "thinking"
        return None

    def split(self, text: str, opening: Optional[str] = None) -> tuple[Optional[str], str]:
        """(the thinking, None when there is none; the answer) of a finished output that began as
        `opening` says (`ReasoningParser.opening`)."""
        stream = self.stream(opening)
        thinking, answer = stream.push(text, True)
        return (thinking if stream.thought else None), answer

    def stream(self, opening: Optional[str] = None) -> "ReasoningStream":
        """A splitter for one streamed output that began as `opening` says."""
        return ReasoningStream(self, opening)


class ReasoningStream:
    """Splits a streamed output as it grows into (thinking, answer) deltas. Text that may still turn out
    to be a tag is held back, so a stream cut inside `<think>` or `</think>` never sends a piece of one.

    Invariant: `text[:sent]` has been sent (as thinking, answer, or a tag that is sent as neither), and the
    phase only moves forward: start -> thinking -> answer."""

    def __init__(self, parser: ReasoningParser, opening: Optional[str]) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0
        self.phase = "thinking" if opening == "thinking" else "start"
        self.closed = opening == "answer"  # the prompt closed the thinking: only an opening tag starts one
        self.thought = opening == "thinking"  # whether the output had a thinking section at all

    def push(self, delta: str, finished: bool) -> tuple[str, str]:
        """(thinking, answer) to send now, given the output's next `delta` of text; `finished` on the last."""
        self.text += delta
        if self.phase == "start":
            if START.startswith(self.text) and not finished:
                return "", ""  # may still become the opening tag
            if self.text.startswith(START):
                self.sent, self.phase = len(START), "thinking"
            else:  # no opening tag: deepseek_r1 thinks anyway (its template opened the tag), qwen3 answers
                self.phase = "thinking" if self.parser.name == "deepseek_r1" and not self.closed else "answer"
            self.thought = self.phase == "thinking"
        thinking = ""
        if self.phase == "thinking":
            end = self.text.find(END, self.sent)
            if end < 0:
                stop = len(self.text) if finished else len(self.text) - partial_stop_suffix(self.text[self.sent:], [END])
                thinking, self.sent = self.text[self.sent:stop], max(self.sent, stop)
                return thinking, ""
            thinking, self.sent, self.phase = self.text[self.sent:end], end + len(END), "answer"
        answer, self.sent = self.text[self.sent:], len(self.text)
        return thinking, answer


PARSER_NAMES = ("deepseek_r1", "qwen3", "glm45")
TURN_TAGS = {"glm45": "<|assistant|>"}  # families whose prompt tags count only after this token


def reasoning_parser(name: Optional[str], tokenizer: Any) -> Optional[ReasoningParser]:
    """The parser `--reasoning-parser NAME` asks for (None for none); ValueError for an unknown name or a
    tokenizer in which the tags are not single tokens."""
    if name is None:
        return None
    if name not in PARSER_NAMES:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(PARSER_NAMES)}, got {name!r}")
    ids = []
    for tag in (START, END) + ((TURN_TAGS[name],) if name in TURN_TAGS else ()):
        encoded = tokenizer.encode(tag, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"--reasoning-parser {name} needs {tag!r} to be one token of this model's tokenizer; "
                             f"it is {len(encoded)} tokens here (this model does not write reasoning in tags)")
        ids.append(encoded[0])
    return ReasoningParser(name, *ids)
