"""Whether two tokenizers are the same for a user: class, the whole backend (vocabulary, merges, normalizer,
pre-tokenizer, post-processor, decoder, added tokens), special tokens, chat template, what `save_pretrained`
writes, and the ids and text of varied strings encoded and decoded."""

from __future__ import annotations

import json
from pathlib import Path

# unicode of several scripts, emoji, runs of spaces, tabs and newlines, leading and trailing blanks, code, digits
VARIED_TEXTS = [
    "Hello world", " leading space", "trailing space ", "   three leading, two inner  spaces",
    "tabs\tand\t\ttabs", "new\nline\n\n\nthree", " \n \t mixed blanks \r\n", "",
    "Grüße, café, naïve, façade — “quotes” ‘single’ …", "日本語のテキストと中文字符", "한국어 문장입니다.",
    "مرحبا بالعالم", "Здравствуй, мир!", "emoji 😀🎉👍🏽 and 👨‍👩‍👧", "zero\u200bwidth and\u00a0nbsp",
    "def add(a, b):\n    return a + b  # sum\n\nprint(add(1, 2))",
    "if (x >= 10 && y != '\\n') { z[i++] = 0x1F; }",
    "3.14159 265358979 1,000,000 2024-06-01", "<html><body class=\"x\">&amp;</body></html>",
]


def special_token_texts(tokenizer) -> list[str]:
    """Strings with the tokenizer's special and added tokens written inside text."""
    added = [token.content for token in tokenizer.added_tokens_decoder.values()][:40]
    named = [token for token in (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token)
             if token]
    return [f"a{token}b {token} c" for token in named + added] + ["".join(named + added[:8]) + " end"]


def saved_files(tokenizer, folder: Path) -> dict[str, object]:
    """What `save_pretrained` writes (each json file parsed, other files as text)."""
    tokenizer.save_pretrained(str(folder))
    return {path.name: json.loads(path.read_text()) if path.suffix == ".json" else path.read_text()
            for path in sorted(folder.iterdir())}


def assert_same_tokenizer(ours, reference, scratch: Path, messages: list[dict] | None = None) -> None:
    """Assert `ours` behaves and saves exactly as `reference` (see the module docstring); `scratch` an empty folder."""
    assert type(ours) is type(reference)
    assert ours.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    assert ours.get_vocab() == reference.get_vocab()
    assert {i: repr(t) for i, t in ours.added_tokens_decoder.items()} == \
        {i: repr(t) for i, t in reference.added_tokens_decoder.items()}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token", "bos_token_id", "eos_token_id", "pad_token_id",
                 "unk_token_id", "all_special_tokens", "all_special_ids", "chat_template"):
        assert getattr(ours, name) == getattr(reference, name), name
    for text in VARIED_TEXTS + special_token_texts(reference):
        for add_special_tokens in (True, False):
            ids = reference.encode(text, add_special_tokens=add_special_tokens)
            assert ours.encode(text, add_special_tokens=add_special_tokens) == ids, text
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    if messages is not None and reference.chat_template:
        for tokenize in (False, True):
            assert ours.apply_chat_template(messages, tokenize=tokenize, add_generation_prompt=True) == \
                reference.apply_chat_template(messages, tokenize=tokenize, add_generation_prompt=True)
    assert saved_files(ours, scratch / "ours") == saved_files(reference, scratch / "reference")
