"""The OpenAI Responses request body (POST /v1/responses), strictly: an unknown field is a 400 naming it.

`input` items and `tools` are read one by one (`input_items`, `function_tools`), so a hosted tool, a file
or audio part or an item of an unknown type is a 400 that names it and says it is not supported, rather
than a list of every union member pydantic tried. `input_image` parts become chat `image_url` parts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from tokenmill.server.protocol import _Body, _Strict

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"
TOOL_CHOICES = '"auto", "none", "required" or {"type": "function", "name": ...}'
UNSUPPORTED_PARTS = {"input_file": "file", "input_audio": "audio"}


class TextPart(_Strict):
    """A text part of a message item's content (`input_text`, or `output_text` of an earlier answer)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: Optional[list[Any]] = None  # an earlier answer's, sent back as the SDK received it
    logprobs: Optional[list[Any]] = None


class ImagePart(_Strict):
    """`{"type": "input_image", "image_url": ..., "detail": ...}`: an image by URL (a data:image/...;base64 URL,
    file:// or http(s)://, read as chat's image_url parts are); uploaded files (`file_id`) are refused."""

    type: Literal["input_image"]
    image_url: Optional[str] = None
    detail: Optional[Literal["auto", "low", "high"]] = None
    file_id: Optional[str] = None

    @model_validator(mode="after")
    def _by_url(self) -> "ImagePart":
        if self.file_id is not None:
            raise ValueError("file_id is not supported by this server, which stores no files: give image_url")
        if self.image_url is None:
            raise ValueError("an input_image needs an image_url")
        return self

    def chat_part(self) -> dict[str, Any]:
        """The chat `image_url` part of the same image."""
        image_url = {"url": self.image_url, **({"detail": self.detail} if self.detail is not None else {})}
        return {"type": "image_url", "image_url": image_url}


ContentPart = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]


def chat_content(content: Union[str, list[Any]]) -> Union[str, list[dict[str, Any]]]:
    """Content as chat takes it: text joined when no part is an image (the prompt of a text-only conversation
    is as it always was), else chat parts in order (`text`, `image_url`)."""
    if isinstance(content, str):
        return content
    if not any(isinstance(part, ImagePart) for part in content):
        return "".join(part.text for part in content)
    return [part.chat_part() if isinstance(part, ImagePart) else {"type": "text", "text": part.text}
            for part in content]


class MessageItem(_Strict):
    """A message of the conversation (the SDK's EasyInputMessage leaves `type` out)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[ContentPart]]
    id: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None


class FunctionCallItem(_Strict):
    """A call the model made earlier: `call_id` ties it to its function_call_output."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None


class FunctionCallOutputItem(_Strict):
    """What a call returned: text, or input_text and input_image parts."""

    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[ContentPart]]
    id: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None


class ReasoningItem(_Strict):
    """An earlier turn's reasoning: accepted, and left out of the prompt."""

    type: Literal["reasoning"]
    id: Optional[str] = None
    summary: list[Any] = []
    content: Optional[list[Any]] = None
    encrypted_content: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None


InputItem = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem]
ITEM_TYPES: dict[str, type[BaseModel]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                          "function_call_output": FunctionCallOutputItem,
                                          "reasoning": ReasoningItem}


class FunctionTool(_Strict):
    """`tools[i]`: a function the model may call (the only tool type this server runs)."""

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class FunctionChoice(_Strict):
    """`tool_choice: {"type": "function", "name": ...}`: that function must be called."""

    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    """`text.format`: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None
    description: Optional[str] = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> "TextFormat":
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("text.format of type json_schema needs a schema")
        return self

    def response_format(self) -> dict[str, Any]:
        """The chat request's `response_format` for this format."""
        if self.type != "json_schema":
            return {"type": self.type}
        schema = {"name": self.name or "response", "schema": self.schema_, "strict": self.strict,
                  "description": self.description}
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


class TextConfig(_Strict):
    """`text`: the output's format (and a verbosity hint, accepted)."""

    format: Optional[TextFormat] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None


class ReasoningConfig(_Strict):
    """`reasoning`: accepted; how much a model thinks is up to its chat template (chat_template_kwargs)."""

    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None
    generate_summary: Optional[Literal["auto", "concise", "detailed"]] = None


class ResponsesRequest(_Body):
    """POST /v1/responses: OpenAI's fields this server honours, and tokenmill's sampling extensions."""

    model: Optional[str] = None
    input: Union[str, list[InputItem], None] = None
    instructions: Optional[str] = None
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Union[Literal["auto", "none", "required"], FunctionChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: Optional[bool] = False
    store: Optional[bool] = True
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    truncation: Optional[Literal["disabled", "auto"]] = None
    include: Optional[list[str]] = None
    service_tier: Optional[Literal["auto", "default", "flex", "scale", "priority"]] = None
    background: Optional[bool] = None
    # tokenmill's (and vLLM's) sampling extensions, as on chat completions
    seed: Optional[int] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    stop: Union[None, str, list[str]] = None
    ignore_eos: Optional[bool] = None
    min_tokens: Optional[int] = None
    cache_salt: Optional[str] = None
    priority: Optional[int] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    guided_json: Union[None, str, dict[str, Any]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    truncate_prompt_tokens: Optional[int] = None
    vllm_xargs: Optional[dict[str, Any]] = None

    @field_validator("input", mode="before")
    @classmethod
    def _input_items(cls, value: Any) -> Any:
        return value if value is None or isinstance(value, str) else input_items(value)

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        return value if value is None else function_tools(value)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") != "function":
            raise ValueError(f"tool_choice of type {value.get('type')!r} is not supported by this server: give "
                             f"{TOOL_CHOICES}")
        if isinstance(value, str) and value not in ("auto", "none", "required"):
            raise ValueError(f"tool_choice {value!r} is not one of {TOOL_CHOICES}")
        return value

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, value: Optional[dict[str, str]]) -> Optional[dict[str, str]]:
        if value is None:
            return None
        if len(value) > MAX_METADATA_PAIRS:
            raise ValueError(f"metadata may have at most {MAX_METADATA_PAIRS} pairs, got {len(value)}")
        for key, text in value.items():
            if len(key) > MAX_METADATA_KEY_CHARS:
                raise ValueError(f"metadata keys may have at most {MAX_METADATA_KEY_CHARS} characters; "
                                 f"{key[:20]!r}... has {len(key)}")
            if len(text) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"metadata values may have at most {MAX_METADATA_VALUE_CHARS} characters; "
                                 f"the value of {key!r} has {len(text)}")
        return value

    @field_validator("truncation")
    @classmethod
    def _no_truncation(cls, value: Optional[str]) -> Optional[str]:
        if value == "auto":
            raise ValueError("truncation 'auto' is not supported by this server: a prompt longer than the model "
                             "takes is refused; leave truncation unset or 'disabled'")
        return value

    @field_validator("background")
    @classmethod
    def _in_the_foreground(cls, value: Optional[bool]) -> Optional[bool]:
        if value:
            raise ValueError("background responses are not supported by this server: leave background unset")
        return value


def input_items(value: Any) -> list[InputItem]:
    """`input` as a list of items; ValueError naming the first item this server cannot read, and why."""
    if not isinstance(value, list):
        raise ValueError("input must be a string or a list of items")
    return [_item(index, raw) for index, raw in enumerate(value)]


def _item(index: int, raw: Any) -> InputItem:
    where = f"input.{index}"
    if not isinstance(raw, dict):
        raise ValueError(f"'{where}' must be an object (an input item)")
    kind = raw.get("type", "message" if "role" in raw else None)
    if kind is None:
        raise ValueError(f"'{where}' needs a type (or a role, for a message)")
    model = ITEM_TYPES.get(kind)
    if model is None:
        raise ValueError(f"'{where}': input items of type {kind!r} are not supported by this server (only "
                         f"{', '.join(ITEM_TYPES)})")
    field = "output" if kind == "function_call_output" else "content"
    parts = raw.get(field)
    for part_index, part in enumerate(parts if isinstance(parts, list) else []):
        unsupported = UNSUPPORTED_PARTS.get(part.get("type")) if isinstance(part, dict) else None
        if unsupported is not None:
            raise ValueError(f"'{where}.{field}.{part_index}': {unsupported} inputs ({part['type']}) are not "
                             "supported by this server, which reads text and images")
        if isinstance(part, dict) and part.get("type") == "input_image":  # its own errors, not the union's
            _validated(ImagePart, part, f"{where}.{field}.{part_index}")
    return _validated(model, raw, where)


def function_tools(value: Any) -> list[FunctionTool]:
    """`tools` as function tools; ValueError naming a hosted tool (web_search, file_search, ...) as
    unsupported."""
    if not isinstance(value, list):
        raise ValueError("tools must be a list")
    tools = []
    for index, raw in enumerate(value):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind != "function":
            raise ValueError(f"'tools.{index}': tools of type {kind!r} are not supported by this server (only "
                             "function tools)")
        tools.append(_validated(FunctionTool, raw, f"tools.{index}"))
    return tools


def _validated(model: type[BaseModel], raw: dict[str, Any], where: str) -> Any:
    """`raw` as `model`; a ValueError naming the first bad field below `where`."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join([where, *(str(part) for part in error["loc"])])
        if error["type"] == "extra_forbidden":
            raise ValueError(f"'{field}' is not supported by this server") from None
        if error["type"] == "missing":
            raise ValueError(f"'{field}' is required") from None
        raise ValueError(f"'{field}': {str(error['msg']).removeprefix('Value error, ')}") from None
