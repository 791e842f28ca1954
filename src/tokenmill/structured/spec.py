"""What a request's output must match (no torch, no xgrammar): the form the API layer hands the engine."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from tokenmill.structured.json_text import loads_nested_json

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the whole output: `kind` is json (a JSON schema), json_object (any JSON object),
    regex, choice (one of a list of strings) or grammar (EBNF / GBNF with a `root` rule).

    `value` is the constraint as text: the schema and the choice list as canonical JSON, so equal
    constraints compare (and are cached) equal.

    `after_token`: the constraint applies to what follows the first time the output holds this token
    (the end of a reasoning model's thinking); None: to the whole output.
    """

    kind: str
    value: str = ""
    after_token: Optional[int] = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    @property
    def grammar_key(self) -> "StructuredOutput":
        """The constraint alone (without `after_token`): what is compiled, once for every start."""
        return self if self.after_token is None else StructuredOutput(self.kind, self.value)

    @classmethod
    def json_schema(cls, schema: Any) -> "StructuredOutput":
        """From a JSON schema given as a dict or as JSON text."""
        if isinstance(schema, str):
            schema = loads_nested_json(schema, "the JSON schema")
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls("json", json.dumps(schema, sort_keys=True))

    @classmethod
    def choice(cls, choices: Any) -> "StructuredOutput":
        """One of a non-empty list of strings."""
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("guided_choice must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(choices))

    @classmethod
    def regex(cls, pattern: Any) -> "StructuredOutput":
        """Matching a regular expression."""
        if not isinstance(pattern, str) or not pattern:
            raise ValueError("guided_regex must be a non-empty string")
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, text: Any) -> "StructuredOutput":
        """Derived from an EBNF / GBNF grammar whose start rule is `root`."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("guided_grammar must be a non-empty EBNF grammar")
        return cls("grammar", text)
