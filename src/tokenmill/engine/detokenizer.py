"""Incremental detokenisation that never emits half a character."""

from __future__ import annotations

from typing import Any, Callable, Optional

_PREFIX_CONTEXT = 5  # prompt tokens decoded as context so the first output token's spacing is right


def rust_decode(tokenizer: Any) -> Optional[Callable[..., str]]:
    """The Rust tokenizer's own `decode(ids, skip_special_tokens)` where transformers' decode of `tokenizer`
    (with clean_up_tokenization_spaces=False) is exactly that call: a fast tokenizer whose class keeps
    the base decode. Else None. It skips transformers' per-call argument conversion, which costs more
    than the decode of a few tokens (two decodes per generated token)."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    if (backend is None or not isinstance(tokenizer, PreTrainedTokenizerFast)
            or cls.decode is not PreTrainedTokenizerFast.decode or cls._decode is not PreTrainedTokenizerFast._decode):
        return None
    return backend.decode


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a short window [prefix_offset, len) and emits only what the newest tokens added beyond
    decoding [prefix_offset, read_offset). A delta ending in U+FFFD (an incomplete UTF-8 sequence
    from byte-fallback or multi-byte tokens) is held back until the following tokens complete it.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.rust_decode = rust_decode(tokenizer)
        context = list(prompt_token_ids[-_PREFIX_CONTEXT:])
        self.ids = context
        self.prefix_offset = 0
        self.read_offset = len(context)

    def _decode(self, ids: list[int]) -> str:
        if self.rust_decode is not None:
            return self.rust_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full_text[len(prefix_text):]
        return ""
