"""The OpenAI request bodies we accept, strictly: an unknown or unsupported field is a 400 naming it."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tokenmill.engine.beam_search import BeamSearchParams
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.json_text import MAX_NESTING
from tokenmill.structured.spec import StructuredOutput


_SURROGATE = re.compile("[\ud800-\udfff]")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Body(_Strict):
    """A whole request body: its text must be Unicode (no lone UTF-16 surrogates) and it nests at most
    MAX_NESTING levels (deeper JSON schemas would overflow the recursion of json.dumps and xgrammar)."""

    @model_validator(mode="before")
    @classmethod
    def _unicode_text(cls, data: Any) -> Any:
        check_body(data)
        return data


class StreamOptions(_Strict):
    """`stream_options`: only include_usage is supported."""

    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """`response_format.json_schema`: a named schema."""

    name: str = "response"
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Strict):
    """`response_format`: text (no constraint), json_object, or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class _SamplingFields(_Body):
    """Fields shared by completions and chat completions (OpenAI's and vLLM's extensions)."""

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[None, str, list[str]] = None
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # extensions
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    priority: int = 0
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    response_format: Optional[ResponseFormat] = None
    guided_json: Union[None, str, dict[str, Any]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    cache_salt: Optional[str] = None
    # SGLang's extensions, which sglang-router and vllm-router put in every request they forward:
    # accepted at the values that change nothing here, refused by name at any other
    no_stop_trim: bool = False
    return_hidden_states: bool = False
    # beam search (vLLM's fields; engine/beam_search.py): `best_of` beams (default n), the n best returned
    use_beam_search: bool = False
    best_of: Optional[int] = Field(None, ge=1, le=10)
    length_penalty: float = 1.0
    early_stopping: Union[bool, Literal["never"]] = False
    kv_transfer_params: Optional[dict[str, Any]] = None  # prefill/decode disaggregation (docs/scale-out.md)
    # vLLM's request controls (sampling/logits_processors.py)
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    truncate_prompt_tokens: Optional[int] = Field(None, ge=-1)  # keep the prompt's last k tokens (-1: max_model_len)
    vllm_xargs: Optional[dict[str, Any]] = None  # arguments for third-party logits processors (extra_args)

    def truncated(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's token ids as truncate_prompt_tokens keeps them: the last k (vLLM's left truncation)."""
        if self.truncate_prompt_tokens is None:
            return token_ids
        keep = max_model_len if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens
        if keep == 0:
            raise ValueError("truncate_prompt_tokens must be -1 or >= 1, got 0")
        return token_ids[-keep:]

    @model_validator(mode="after")
    def _router_fields_change_nothing(self) -> "_SamplingFields":
        for name in ("no_stop_trim", "return_hidden_states", "continue_final_message"):
            if getattr(self, name, False):
                raise ValueError(f"'{name}': true is not supported by this server")
        return self

    def structured_output(self) -> Optional[StructuredOutput]:
        """The output constraint the request asks for, if any (ValueError when it asks for two, or a
        json_schema format comes without a schema)."""
        asked = {name: getattr(self, name) for name in ("guided_json", "guided_regex", "guided_choice",
                                                          "guided_grammar") if getattr(self, name) is not None}
        if self.response_format is not None and self.response_format.type != "text":
            asked["response_format"] = self.response_format
        if len(asked) > 1:
            raise ValueError(f"only one output constraint may be given, got {', '.join(sorted(asked))}")
        if "guided_json" in asked:
            return StructuredOutput.json_schema(self.guided_json)
        if "guided_regex" in asked:
            return StructuredOutput.regex(self.guided_regex)
        if "guided_choice" in asked:
            return StructuredOutput.choice(self.guided_choice)
        if "guided_grammar" in asked:
            return StructuredOutput.grammar(self.guided_grammar)
        if "response_format" in asked:
            if self.response_format.type == "json_object":
                return StructuredOutput("json_object")
            if self.response_format.json_schema is None or self.response_format.json_schema.schema_ is None:
                raise ValueError("response_format of type json_schema needs json_schema.schema")
            return StructuredOutput.json_schema(self.response_format.json_schema.schema_)
        return None

    def sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int],
                        prompt_logprobs: Optional[int] = None) -> SamplingParams:
        """The engine's SamplingParams (raises ValueError naming a bad field)."""
        if not self.use_beam_search:
            self.check_no_beam_fields()
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (the model's context length) or >= 1, got 0")
        bias = None
        if self.logit_bias:
            try:
                bias = {int(token): float(value) for token, value in self.logit_bias.items()}
            except ValueError:
                raise ValueError("logit_bias keys must be token ids (integers as strings)") from None
            if len(bias) != len(self.logit_bias):
                raise ValueError("logit_bias names a token id twice")
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, max_tokens=max_tokens,
            min_tokens=self.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, logit_bias=bias,
            structured_output=self.structured_output(), cache_salt=self.cache_salt, output_kind="delta",
            kv_transfer_params=self.kv_transfer_params, allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words, extra_args=self.vllm_xargs,
        )

    def beam_search_params(self, max_tokens: int) -> BeamSearchParams:
        """The beam search this body asks for (use_beam_search); ValueError naming every field it sets that
        beam search cannot honour (sampling controls, penalties, stop conditions, constraints, streaming)."""
        defaults = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                    "repetition_penalty": 1.0, "seed": None, "stop": None, "stop_token_ids": None, "min_tokens": 0,
                    "logit_bias": None, "stream": False, "logprobs": None, "echo": False, "top_logprobs": None,
                    "kv_transfer_params": None, "allowed_token_ids": None, "bad_words": None, "vllm_xargs": None}
        refused = [name for name, default in defaults.items()
                   if hasattr(self, name) and getattr(self, name) not in (default, [], {})]
        if self.logprobs is False:  # chat's logprobs: false is the default
            refused = [name for name in refused if name != "logprobs"]
        if self.structured_output() is not None:
            refused.append("response_format/guided_*")
        if refused:
            raise ValueError(f"beam search cannot honour {', '.join(refused)}: leave them unset with use_beam_search")
        width = self.best_of if self.best_of is not None else self.n
        if self.n > width:
            raise ValueError(f"n ({self.n}) must be <= best_of ({width}), the number of beams")
        return BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                                temperature=self.temperature,
                                length_penalty=self.length_penalty, early_stopping=self.early_stopping)

    def check_no_beam_fields(self) -> None:
        """ValueError naming the beam-search fields set without use_beam_search (they would change nothing)."""
        set_fields = [name for name, default in (("best_of", None), ("length_penalty", 1.0), ("early_stopping", False))
                      if getattr(self, name) != default and not (name == "best_of" and self.best_of == self.n)]
        if set_fields:
            raise ValueError(f"{', '.join(set_fields)} apply to beam search only: set use_beam_search, or leave "
                             "them unset")

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: Optional[Union[str, list[str], list[int], list[list[int]]]] = None
    # vLLM's (--enable-prompt-embeds): base64 of a torch.save'd [tokens, hidden] tensor, or a list of them
    prompt_embeds: Optional[Union[str, list[str]]] = None
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False


class TextPart(_Strict):
    """A text part of a message's content list."""

    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    """An image part's `image_url`: where the image is (a data:image/...;base64 URL, file:// or http(s)://;
    multimodal/media.py reads it) and OpenAI's `detail` hint."""

    url: str
    detail: Optional[Literal["auto", "low", "high"]] = None


class ImagePart(_Strict):
    """An image part of a message's content list: `{"type": "image_url", "image_url": {"url": ...}}`."""

    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]
IMAGE_ROLES = ("user", "tool")


class FunctionCall(_Strict):
    """A call's function: its name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(_Strict):
    """One tool call of an assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Strict):
    """A function the model may call: a name, what it does, and a JSON schema of its arguments."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(_Strict):
    """`tools[i]`: only functions exist."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Strict):
    """The function a named tool_choice forces."""

    name: str


class NamedToolChoice(_Strict):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`."""

    type: Literal["function"] = "function"
    function: NamedFunction


class ChatMessage(_Strict):
    """One message of a conversation (tool messages answer an earlier tool call by its id)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None  # an earlier turn's thinking, for templates that show it

    @model_validator(mode="after")
    def _images_from_users_and_tools(self) -> "ChatMessage":
        if self.role not in IMAGE_ROLES and self.image_urls():
            raise ValueError(f"image_url parts are taken in user and tool messages only, not in {self.role} messages")
        return self

    def text(self) -> str:
        """The message content as plain text: its text parts, joined (image parts are left out; `image_urls`
        lists them)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def template_content(self) -> Union[str, list[dict[str, str]]]:
        """The content as chat templates take it: plain text (`text`), or, for a message with images, its
        parts in order as {"type": "image"} and {"type": "text", "text": ...} (the templates of
        vision-language models write each image's placeholder where its part is)."""
        if not self.image_urls():
            return self.text()
        return [{"type": "image"} if isinstance(part, ImagePart) else {"type": "text", "text": part.text}
                for part in self.content]

    def image_urls(self) -> list[str]:
        """The URLs of the message's image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if isinstance(part, ImagePart)]


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None  # more template variables (enable_thinking, ...)
    # SGLang's, sent by the routers too: include_reasoning false drops the thinking (--reasoning-parser)
    continue_final_message: bool = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    include_reasoning: bool = True

    @model_validator(mode="after")
    def _template_kwargs_are_variables(self) -> "ChatCompletionRequest":
        taken = sorted(set(self.chat_template_kwargs or {}) & TEMPLATE_ARGUMENTS)
        if taken:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}: the request's own fields do")
        return self


# what the server itself passes a chat template; chat_template_kwargs add variables, never replace these
TEMPLATE_ARGUMENTS = frozenset({"messages", "conversation", "tools", "documents", "chat_template", "tokenize",
                                "add_generation_prompt", "continue_final_message", "return_dict", "tokenizer",
                                "return_assistant_tokens_mask", "padding", "truncation", "max_length",
                                "return_tensors", "tokenizer_kwargs"})


class TokenizeRequest(_Body):
    """POST /tokenize: a prompt, or chat messages rendered through the template."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    """POST /detokenize."""

    model: Optional[str] = None
    tokens: list[int]


def error_body(message: str, type_: str, param: Optional[str] = None, code: Any = None) -> dict[str, Any]:
    """The OpenAI error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def check_body(value: Any) -> None:
    """Raise ValueError when a parsed JSON body nests deeper than MAX_NESTING levels or holds a string
    with a lone UTF-16 surrogate (valid JSON escapes, but not Unicode text: no tokenizer can encode them),
    naming where ('messages.0.content'). Walks without recursion, so any depth is safe to check."""
    stack: list[tuple[str, Any, int]] = [("", value, 0)]
    while stack:
        path, item, depth = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise ValueError(f"'{_shown(path)}' holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                                 f"escape), which is not Unicode text")
            continue
        if not isinstance(item, (dict, list)) or (isinstance(item, list) and all(isinstance(x, int) for x in item)):
            continue  # numbers, and token-id lists: nothing to check
        if depth >= MAX_NESTING:
            raise ValueError(f"'{_shown(path)}' is nested more than {MAX_NESTING} levels deep")
        if isinstance(item, dict):
            for key, child in item.items():
                stack.append((f"{path}.{key}" if path else str(key), key, depth + 1))
                stack.append((f"{path}.{key}" if path else str(key), child, depth + 1))
        else:
            stack.extend((f"{path}.{i}" if path else str(i), child, depth + 1) for i, child in enumerate(item))


def _shown(path: str) -> str:
    """A path as an error message may show it: surrogates escaped, at most 80 characters."""
    text = path.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= 80 else text[:37] + "..." + text[-40:]
