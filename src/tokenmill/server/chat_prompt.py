"""Chat prompts as token ids in which text from the messages never becomes a control token."""

from __future__ import annotations

import re
from typing import Any, Optional

# Private-use characters frame the stand-in for a message's content while the template renders.
_OPEN, _CLOSE = "\ue000", "\ue001"


def chat_prompt_ids(tokenizer: Any, chat_template: str, conversation: list[dict], tools: Optional[list],
                    add_generation_prompt: bool, template_kwargs: Optional[dict[str, Any]] = None
                    ) -> tuple[str, list[int]]:
    """The prompt text the template makes of `conversation` and its token ids, where text that came
    from message contents never becomes a special (control) token: a user who types '<|im_start|>system'
    gets those characters as plain text, not a forged turn.

    When no content holds a special token's text (nearly always), this is exactly the template's text
    tokenised whole. Otherwise the template renders with a stand-in for each such content; the pieces
    the template wrote are tokenised with special tokens recognised and the contents with special tokens
    split. A template that changes content as it renders it (so the stand-in cannot be found once, or the
    contents put back do not give the template's own text) raises ValueError: such content cannot be
    rendered safely, and it is refused rather than risk a forged control token.
    `template_kwargs` are more variables for the template (a request's chat_template_kwargs, such as
    enable_thinking).
    """
    def render(messages: list[dict]) -> str:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, chat_template=chat_template,
                                             add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))

    text = render(conversation)
    specials = special_token_texts(tokenizer)
    texts = list(_message_texts(conversation))
    affected = [(i, j, t) for i, j, t in texts if any(s in t for s in specials)]
    if not affected:
        return text, tokenizer(text, add_special_tokens=False).input_ids
    if any(_OPEN in t or _CLOSE in t for _, _, t in texts):
        raise ValueError("message content holds both special-token text and private-use characters "
                         "U+E000/U+E001; it cannot be rendered safely")
    contents: dict[str, str] = {}
    stand_ins = [dict(m) for m in conversation]
    for n, (i, j, content) in enumerate(affected):
        stand_in = f"{_OPEN}{n}{_CLOSE}"
        contents[stand_in] = content
        if j is None:
            stand_ins[i]["content"] = stand_in
        else:  # a text part of a list content (a message with images): the message gets its own list
            if stand_ins[i]["content"] is conversation[i]["content"]:
                stand_ins[i]["content"] = list(conversation[i]["content"])
            stand_ins[i]["content"][j] = {**stand_ins[i]["content"][j], "text": stand_in}
    pieces = re.split(f"({_OPEN}\\d+{_CLOSE})", render(stand_ins))
    if sorted(pieces[1::2]) != sorted(contents) or "".join(contents.get(p, p) for p in pieces) != text:
        raise ValueError("this chat template changes message content as it renders it, so content that holds "
                         "special-token text cannot be rendered safely")
    ids: list[int] = []
    for index, piece in enumerate(pieces):
        if index % 2:
            ids += tokenizer(contents[piece], add_special_tokens=False, split_special_tokens=True).input_ids
        elif piece:
            ids += tokenizer(piece, add_special_tokens=False).input_ids
    return text, ids


def _message_texts(conversation: list[dict]):
    """(message index, part index or None, text) of every text the messages hold: a string content, or the
    text parts of a list content (a message with images)."""
    for i, message in enumerate(conversation):
        content = message.get("content")
        if isinstance(content, str):
            yield i, None, content
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    yield i, j, part["text"]


def special_token_texts(tokenizer: Any) -> list[str]:
    """The text of every special token the tokenizer recognises in input (its control tokens)."""
    cached = getattr(tokenizer, "_tokenmill_special_texts", None)
    if cached is None:
        cached = sorted({token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
                        | set(tokenizer.all_special_tokens))
        tokenizer._tokenmill_special_texts = cached
    return cached
