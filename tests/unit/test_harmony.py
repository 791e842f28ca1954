"""GPT-OSS's harmony format (server/harmony.py): a chat request renders to the tokens openai-harmony renders for
the same conversation, and scripted outputs (token ids harmony encodes) read as thinking, answer and tool
calls, whole and streamed token by token alike.

harmony reads its vocabulary from the o200k_base.tiktoken that the bpe-openai package ships (no internet);
tests/e2e/test_harmony_server.py covers the file built from a model's own tokenizer; the tests here of that
build's refusals run on stand-in tokenizers. Cost: under a second."""

from __future__ import annotations

import json

import pytest

from helpers.harmony_models import o200k_file
from tokenmill.server.harmony import Harmony, HarmonyParsing, harmony_for
from tokenmill.server.protocol import ChatMessage, Tool
from tokenmill.server.tool_calls import ToolMode

WEATHER = Tool.model_validate({"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})


@pytest.fixture(scope="module")
def harmony(tmp_path_factory, monkeypatch_module):
    import openai_harmony as h  # not at collection: every pytest-xdist worker collects every file

    folder = tmp_path_factory.mktemp("tiktoken")
    (folder / "o200k_base.tiktoken").write_bytes(o200k_file())
    monkeypatch_module.setenv("TIKTOKEN_ENCODINGS_BASE", str(folder))
    return Harmony(h.load_harmony_encoding(h.HarmonyEncodingName.HARMONY_GPT_OSS))


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_a_conversation_renders_as_harmony_renders_it(harmony):
    import openai_harmony as h

    messages = [ChatMessage(role="system", content="Be brief."),
                ChatMessage(role="user", content="Weather in Paris?"),
                ChatMessage.model_validate({
                    "role": "assistant", "content": None, "reasoning_content": "I should call the tool.",
                    "tool_calls": [{"id": "call_1", "type": "function",
                                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}),
                ChatMessage(role="tool", tool_call_id="call_1", content='{"celsius": 20}')]
    ours = harmony.prompt_ids(messages, ToolMode([WEATHER], "auto"), {"reasoning_effort": "high"})
    developer = h.DeveloperContent.new().with_instructions("Be brief.").with_function_tools([h.ToolDescription.new(
        "get_weather", "The weather in a city.", parameters=WEATHER.function.parameters)])
    expected = harmony.encoding.render_conversation_for_completion(h.Conversation.from_messages([
        h.Message.from_role_and_content(h.Role.SYSTEM, h.SystemContent.new().with_reasoning_effort(h.ReasoningEffort.HIGH)),
        h.Message.from_role_and_content(h.Role.DEVELOPER, developer),
        h.Message.from_role_and_content(h.Role.USER, "Weather in Paris?"),
        h.Message.from_role_and_content(h.Role.ASSISTANT, "I should call the tool.").with_channel("analysis"),
        h.Message.from_role_and_content(h.Role.ASSISTANT, '{"city": "Paris"}').with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"),
        h.Message.from_author_and_content(h.Author.new(h.Role.TOOL, "functions.get_weather"), '{"celsius": 20}')
        .with_channel("commentary").with_recipient("assistant")]), h.Role.ASSISTANT)
    assert ours == list(expected)
    text = harmony.encoding.decode_utf8(ours)
    assert "Reasoning: high" in text and "type get_weather" in text and text.endswith("<|start|>assistant")


def test_a_tool_result_must_name_its_function(harmony):
    with pytest.raises(ValueError, match="tool_call_id"):
        harmony.prompt_ids([ChatMessage(role="tool", tool_call_id="nowhere", content="1")])


def output(harmony, text: str) -> list[int]:
    return harmony.encoding.encode(text, allowed_special="all")


def read_both_ways(harmony, ids, names=("get_weather",)):
    """The whole reading, and the streamed one (token by token) put back together; they must agree."""
    parsing = HarmonyParsing(harmony, frozenset(names))
    whole = parsing.whole(ids)
    stream = parsing.stream()
    thinking, text, calls = "", "", []
    for i, token in enumerate(ids):
        t, x, c = stream.push([token], i == len(ids) - 1)
        thinking, text, calls = thinking + t, text + x, calls + c
    assert [c.index for c in calls] == list(range(len(calls))) and all(c.id for c in calls)
    assert ((thinking or None), text, [(c.name, c.arguments) for c in calls]) == \
        (whole[0], whole[1], [(c.name, c.arguments) for c in whole[2]])
    return whole


def test_analysis_is_thinking_and_final_is_the_answer(harmony):
    ids = output(harmony, "<|channel|>analysis<|message|>Easy: 4.<|end|><|start|>assistant<|channel|>final"
                          "<|message|>2 + 2 = 4.<|return|>")
    assert read_both_ways(harmony, ids) == ("Easy: 4.", "2 + 2 = 4.", [])


def test_a_commentary_call_to_an_offered_function_is_a_tool_call(harmony):
    ids = output(harmony, "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>"
                          "commentary to=functions.get_weather <|constrain|>json<|message|>"
                          '{"city":"Paris"}<|call|>')
    thinking, text, calls = read_both_ways(harmony, ids)
    assert (thinking, text) == ("Need the weather.", "")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_calls_to_unoffered_functions_are_text_and_unfinished_calls_are_dropped(harmony):
    # as with every tool parser, a call to a function the request did not offer stays text
    call = '<|channel|>commentary to=functions.get_weather<|message|>{"city":"Paris"}'
    assert read_both_ways(harmony, output(harmony, call + "<|call|>"), names=()) == (None, '{"city":"Paris"}', [])
    assert read_both_ways(harmony, output(harmony, call)) == (None, "", [])  # cut off by max_tokens


def test_output_off_the_format_is_answer_text(harmony):
    ids = output(harmony, "<|channel|>final<|message|>Hi<|end|>") + output(harmony, "<|message|>plain words")
    thinking, text, calls = read_both_ways(harmony, ids)
    assert (thinking, calls) == (None, [])
    assert text.startswith("Hi") and text.endswith("plain words")


def test_harmony_parsers_fit_gpt_oss_only():
    with pytest.raises(ValueError, match="openai_gptoss"):
        harmony_for("LlamaForCausalLM", None, "openai_gptoss", "auto")
    with pytest.raises(ValueError, match="must be openai_gptoss or unset"):
        harmony_for("GptOssForCausalLM", None, "qwen3", "auto")
    with pytest.raises(ValueError, match="must be openai or auto"):
        harmony_for("GptOssForCausalLM", None, None, "hermes")
    assert harmony_for("LlamaForCausalLM", None, None, "hermes") is None


class StandInTokenizer:
    """A tokenizer's two methods the vocabulary build reads, over the given tokens."""

    def __init__(self, tokens: list[str]):
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.tokens[i] for i in ids]


def test_the_vocabulary_is_built_only_from_gpt_oss_tokenizers(tmp_path, monkeypatch):
    from tokenmill.server.harmony_vocab import O200K_TOKENS, ensure_vocab_file

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE")
    with pytest.raises(ValueError, match="fewer than o200k's 199998"):
        ensure_vocab_file(StandInTokenizer(["a"] * 50_000))
    # a space stands for itself in a SentencePiece-style vocabulary; byte-level BPE writes it as "Ġ"
    with pytest.raises(ValueError, match=r"token 7 of this one \('a b'\) is not byte-level"):
        ensure_vocab_file(StandInTokenizer(["a"] * 7 + ["a b"] + ["a"] * O200K_TOKENS))
    with pytest.raises(ValueError, match="this model's tokenizer has other tokens"):
        ensure_vocab_file(StandInTokenizer(["Ġa"] * O200K_TOKENS))
    assert not (tmp_path / "harmony" / "o200k_base.tiktoken").exists()


def test_a_vocabulary_folder_the_user_names_is_used_as_it_is(tmp_path, monkeypatch):
    from tokenmill.server.harmony_vocab import ensure_vocab_file

    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(tmp_path / "mine"))
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    assert ensure_vocab_file(StandInTokenizer([])) == tmp_path / "mine"  # never read, so never refused
    assert not (tmp_path / "cache").exists()
