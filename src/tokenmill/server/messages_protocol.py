"""The Anthropic Messages API's request bodies (`POST /v1/messages`, `/v1/messages/count_tokens`), strictly:
an unknown field is a 400 naming it, in Anthropic's error shape."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import Field, model_validator

from tokenmill.server.protocol import _Body, _Strict


class CacheControlled(_Strict):
    """A block that may carry `cache_control`: accepted, and changes nothing (prefix caching is automatic)."""

    cache_control: Optional[dict[str, Any]] = None


class TextBlock(CacheControlled):
    """`{"type": "text", "text": ...}`."""

    type: Literal["text"]
    text: str
    citations: Optional[list[dict[str, Any]]] = None


class Base64Source(_Strict):
    """An image given inline: `{"type": "base64", "media_type": "image/png", "data": ...}`."""

    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class URLSource(_Strict):
    """An image given by URL: `{"type": "url", "url": ...}` (read as chat's image_url parts are)."""

    type: Literal["url"]
    url: str


class ImageBlock(CacheControlled):
    """`{"type": "image", "source": ...}`: an image, in a user turn or a tool result."""

    type: Literal["image"]
    source: Annotated[Union[Base64Source, URLSource], Field(discriminator="type")]

    def url(self) -> str:
        """The image as a chat image_url part's URL: a base64 source as a data URL."""
        if isinstance(self.source, Base64Source):
            return f"data:{self.source.media_type};base64,{self.source.data}"
        return self.source.url


class UnsupportedBlock(CacheControlled):
    """A document, search result or container upload block: refused by this server with a 400 naming it."""

    type: Literal["document", "search_result", "container_upload"]
    source: Optional[dict[str, Any]] = None
    title: Optional[str] = None
    context: Optional[str] = None
    citations: Optional[Any] = None


class ToolUseBlock(CacheControlled):
    """An assistant's call: `{"type": "tool_use", "id", "name", "input": {...}}`."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    caller: Optional[dict[str, Any]] = None  # the SDK's own blocks carry these two, sent back as they came
    toolset_name: Optional[str] = None


class ToolResultBlock(CacheControlled):
    """A user's answer to a call: `{"type": "tool_result", "tool_use_id", "content": str | [text blocks]}`."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[Annotated[Union[TextBlock, ImageBlock, UnsupportedBlock], Field(discriminator="type")]],
                   None] = None
    is_error: Optional[bool] = None


class ThinkingBlock(CacheControlled):
    """An assistant's earlier thinking: `{"type": "thinking", "thinking", "signature"}`."""

    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


class RedactedThinkingBlock(CacheControlled):
    """`{"type": "redacted_thinking", "data"}`: opaque, dropped from the prompt."""

    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[Union[TextBlock, ImageBlock, UnsupportedBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock,
                        RedactedThinkingBlock], Field(discriminator="type")]


def block_text(block: Any) -> str:
    """A text block's text; ValueError naming any other kind where only text is taken."""
    if isinstance(block, TextBlock):
        return block.text
    if isinstance(block, ImageBlock):
        raise ValueError("image blocks are taken in user turns and tool results only")
    raise ValueError(f"{block.type} blocks are not supported by this server")


class Message(_Strict):
    """One turn: `role` user or assistant, content a string or a list of blocks."""

    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]


class ToolDefinition(CacheControlled):
    """A client tool: a name, what it does and a JSON schema of its input. Anthropic's server tools (with a
    versioned `type` such as web_search_20250305) are refused by name."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Optional[str] = None
    input_schema: dict[str, Any]
    type: Optional[str] = None

    @model_validator(mode="after")
    def _client_tools_only(self) -> "ToolDefinition":
        if self.type not in (None, "custom"):
            raise ValueError(f"tool type {self.type!r} is an Anthropic server tool, which this server does not run; "
                             "give client tools (name, description, input_schema)")
        return self


class ToolChoice(_Strict):
    """`tool_choice`: auto, any (a call is required), tool (this `name`), none."""

    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None

    @model_validator(mode="after")
    def _named_when_tool(self) -> "ToolChoice":
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice of type 'tool' needs a name, and only it takes one")
        return self


class Thinking(_Strict):
    """`thinking`: enabled (with a token budget) or disabled; mapped to the chat template's enable_thinking."""

    type: Literal["enabled", "disabled"]
    budget_tokens: Optional[int] = Field(None, ge=1)


class Metadata(_Strict):
    """`metadata`: only `user_id`."""

    user_id: Optional[str] = Field(None, max_length=256)


class MessagesRequest(_Body):
    """POST /v1/messages. `temperature`, `top_p` and `top_k` default to the model's generation config."""

    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: Union[str, list[TextBlock], None] = None
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=1)
    tools: Optional[list[ToolDefinition]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None
    metadata: Optional[Metadata] = None
    service_tier: Optional[Literal["auto", "standard_only"]] = None
    # tokenmill's and vLLM's extensions, as on chat
    cache_salt: Optional[str] = None
    seed: Optional[int] = None
    priority: int = 0
    chat_template_kwargs: Optional[dict[str, Any]] = None
    logit_bias: Optional[dict[str, float]] = None
    guided_json: Union[None, str, dict[str, Any]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    truncate_prompt_tokens: Optional[int] = None
    vllm_xargs: Optional[dict[str, Any]] = None

    EXTENSIONS: ClassVar[tuple[str, ...]] = ("cache_salt", "seed", "priority", "logit_bias", "guided_json", "guided_regex", "guided_choice",
                  "guided_grammar", "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "vllm_xargs")


class CountTokensRequest(_Body):
    """POST /v1/messages/count_tokens: what a Messages request's prompt would be, without generating."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    tools: Optional[list[ToolDefinition]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape, its `type` from the HTTP status."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 499: "invalid_request_error",
               503: "overloaded_error"}
