"""structured/schema_checks.py: JSON schemas no finite value satisfies are found before compiling, and
recursive schemas that can finish are not."""

from __future__ import annotations

import pytest

from tokenmill.structured.schema_checks import unsatisfiable

DEFS = {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}


@pytest.mark.parametrize("schema, refs", [
    ({"$ref": "#/$defs/a", "$defs": DEFS}, "#/$defs/a, #/$defs/b"),
    ({"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"], "$defs": DEFS},
     "#/$defs/a, #/$defs/b"),
    ({"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}, "#"),
    ({"type": "array", "minItems": 1, "items": {"$ref": "#"}}, "#"),
    ({"anyOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}], "$defs": DEFS}, "#/$defs/a, #/$defs/b"),
    ({"allOf": [{"type": "object"}, {"$ref": "#"}]}, "#"),
])
def test_ref_cycles_with_no_way_out_are_named(schema, refs):
    assert unsatisfiable(schema) == (f"no finite JSON value satisfies it: $ref {refs} can only be finished through "
                                     f"{'itself' if ',' not in refs else 'one another'} (a cycle with no way out)")


@pytest.mark.parametrize("schema", [
    True, {}, {"type": "string"},
    # recursive, but each can stop: empty children, an optional or nullable next, a branch without the $ref
    {"type": "object", "properties": {"name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}}},
     "required": ["name", "children"]},
    {"type": "object", "properties": {"next": {"$ref": "#"}}},
    {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["next"]},
    {"type": ["null", "object"], "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
    {"$ref": "#/$defs/expr", "$defs": {"expr": {"anyOf": [{"type": "number"}, {
        "type": "object", "properties": {"left": {"$ref": "#/$defs/expr"}, "right": {"$ref": "#/$defs/expr"}},
        "required": ["left", "right"]}]}}},
    {"type": "array", "minItems": 2, "prefixItems": [{"type": "string"}, {"type": "string"}], "items": {"$ref": "#"}},
])
def test_schemas_that_can_finish_pass(schema):
    assert unsatisfiable(schema) is None


def test_a_contradiction_is_not_called_a_cycle():
    assert unsatisfiable({"$ref": "#/$defs/a", "$defs": {"a": False}}) == \
        "no finite JSON value satisfies it (a required part admits nothing)"
    assert unsatisfiable({"type": "object", "properties": {"x": {"enum": []}}, "required": ["x"]}) == \
        "no finite JSON value satisfies it (a required part admits nothing)"


def test_refs_it_cannot_follow_and_deep_schemas_are_refused():
    with pytest.raises(RuntimeError, match="only references within the schema"):
        unsatisfiable({"$ref": "https://example.com/schema.json"})
    with pytest.raises(RuntimeError, match="points at nothing"):
        unsatisfiable({"$ref": "#/$defs/missing"})
    deep: dict = {}
    for _ in range(300):
        deep = {"type": "array", "items": deep}
    with pytest.raises(RuntimeError, match="nested more than 200 levels deep"):
        unsatisfiable(deep)
