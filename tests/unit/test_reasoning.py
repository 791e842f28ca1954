"""Reasoning parsers: thinking split from the answer, whole and streamed at every cut."""

from __future__ import annotations

import pytest

from tokenmill.server.reasoning import ReasoningParser, reasoning_parser

R1, QWEN3 = ReasoningParser("deepseek_r1", 7, 8), ReasoningParser("qwen3", 7, 8)
GLM = ReasoningParser("glm45", 7, 8, turn_token_id=9)  # 9: <|assistant|>
CASES = [  # parser, opening, output, (thinking, answer)
    (QWEN3, None, "<think>\nLet me see.\n</think>\n\nParis.", ("\nLet me see.\n", "\n\nParis.")),
    (QWEN3, None, "Paris.", (None, "Paris.")),
    (QWEN3, None, "<think>cut off mid-thought", ("cut off mid-thought", "")),
    (QWEN3, None, "<thin", (None, "<thin")),
    (QWEN3, None, "a </think> b", (None, "a </think> b")),
    (QWEN3, "answer", "<think>x</think>y", ("x", "y")),
    (QWEN3, "answer", "x</think>y", (None, "x</think>y")),
    (QWEN3, "thinking", "x</think>y", ("x", "y")),
    (R1, None, "plan</think>answer", ("plan", "answer")),
    (R1, None, "<think>plan</think>answer</think>", ("plan", "answer</think>")),
    (R1, None, "still thinking </thi", ("still thinking </thi", "")),
    (R1, "answer", "just an answer", (None, "just an answer")),
    (R1, "answer", "<think>a</think>b", ("a", "b")),
    (R1, None, "", ("", "")),
    (GLM, None, "<think>plan</think>answer", ("plan", "answer")),
    (GLM, None, "just an answer </think>", (None, "just an answer </think>")),
    (GLM, None, "<think>cut off", ("cut off", "")),
    (GLM, "answer", "<think></think>x", ("", "x")),
]


@pytest.mark.parametrize("parser, opening, text, expected", CASES)
def test_split_whole_and_streamed_at_every_cut(parser, opening, text, expected):
    assert parser.split(text, opening) == expected
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], list(text[:cut]) + [text[cut:]]):
            stream = parser.stream(opening)
            thinking = answer = ""
            for index, piece in enumerate(pieces):
                t, a = stream.push(piece, index == len(pieces) - 1)
                thinking, answer = thinking + t, answer + a
                assert "<think>" not in t + a or expected[1].count("<think>"), (cut, t, a)
            assert (thinking if stream.thought else None, answer) == expected, (cut, pieces)


def test_no_piece_of_a_tag_is_sent_while_it_may_still_complete():
    stream = QWEN3.stream()
    assert stream.push("<th", False) == ("", "")
    assert stream.push("ink>abc</th", False) == ("abc", "")
    assert stream.push("ink>\n\nok", False) == ("", "\n\nok")


def test_the_prompt_s_last_tag_says_how_the_output_begins():
    assert QWEN3.opening([1, 7, 5, 8, 3]) == "answer"  # thinking switched off: an empty think block
    assert R1.opening([1, 8, 2, 7, 4]) == "thinking"  # the template opened the tag
    assert R1.opening([1, 2, 3]) is None
    # GLM's template closes a think block in every earlier assistant turn: only tags after the last
    # <|assistant|> speak of the turn being generated
    assert GLM.opening([9, 7, 8, 5, 2, 9]) is None
    assert GLM.opening([9, 7, 8, 5, 2, 9, 7, 8]) == "answer"  # enable_thinking=False
    assert QWEN3.opening([9, 7, 8, 5, 2, 9]) == "answer"


class _Tokenizer:
    def __init__(self, vocab):
        self.vocab = vocab

    def encode(self, text, add_special_tokens=False):
        return [self.vocab[text]] if text in self.vocab else [0] * len(text)


def test_a_parser_needs_its_tags_as_single_tokens():
    parser = reasoning_parser("qwen3", _Tokenizer({"<think>": 11, "</think>": 12}))
    assert (parser.start_token_id, parser.end_token_id) == (11, 12)
    assert reasoning_parser(None, _Tokenizer({})) is None
    with pytest.raises(ValueError, match="'</think>' to be one token"):
        reasoning_parser("deepseek_r1", _Tokenizer({"<think>": 11}))
    glm = reasoning_parser("glm45", _Tokenizer({"<think>": 11, "</think>": 12, "<|assistant|>": 13}))
    assert (glm.start_token_id, glm.end_token_id, glm.turn_token_id) == (11, 12, 13)
    with pytest.raises(ValueError, match="'<\\|assistant\\|>' to be one token"):
        reasoning_parser("glm45", _Tokenizer({"<think>": 11, "</think>": 12}))
    with pytest.raises(ValueError, match="deepseek_r1, qwen3, glm45"):
        reasoning_parser("granite", _Tokenizer({}))
