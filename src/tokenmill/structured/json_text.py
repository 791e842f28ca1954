"""JSON text from requests or models, parsed only when it nests no deeper than a request body may:
Python's parser recurses once per level, so 50,000 brackets would end in a RecursionError."""

from __future__ import annotations

import json
import re
from typing import Any

MAX_NESTING = 100  # levels of arrays and objects a request body, or JSON text inside one, may nest

JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def bracket_depth(text: str, strings: re.Pattern[str], opening: str, closing: str) -> int:
    """How deep the brackets of `text` nest (`opening[i]` closed by any of `closing`), not counting those
    inside what `strings` matches; found without parsing, where a parser would recurse once per level."""
    depth = deepest = 0
    for bracket in re.findall(f"[{re.escape(opening + closing)}]", strings.sub("", text)):
        depth += 1 if bracket in opening else -1
        deepest = max(deepest, depth)
    return deepest


def json_text_depth(text: str) -> int:
    """How deep the arrays and objects of JSON text nest (brackets inside strings do not count), found
    without parsing it."""
    return bracket_depth(text, JSON_STRING, "[{", "]}")


def loads_nested_json(text: str, what: str) -> Any:
    """json.loads of `text`, nested at most MAX_NESTING levels; ValueError naming `what` when it nests
    deeper or is not JSON."""
    if json_text_depth(text) > MAX_NESTING:
        raise ValueError(f"{what} is JSON nested more than {MAX_NESTING} levels deep")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not valid JSON ({exc}): {text[:80]!r}") from None
