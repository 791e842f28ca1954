"""JSON schemas that no finite JSON value satisfies, found before they are compiled.

xgrammar compiles a schema whose `$ref`s form a cycle with no way out (`a -> b -> a`, or a required
property behind one) into a grammar that admits nothing, and generation then fails at its first token.
`unsatisfiable` finds them: a subschema can finish (is *productive*) when some finite value satisfies its
structure, computed as a least fixpoint over the schema's `$ref` targets (a `$ref` starts as unproductive
and becomes productive once its target is shown to be), so recursive schemas that can stop (a tree whose
`children` may be empty) pass and pure cycles do not.

The analysis follows the keywords that decide whether a value can be finished: `$ref` (to `#` and
`#/...` pointers), `anyOf`/`oneOf` (one productive branch), `allOf` (every branch), `type` (objects need
their `required` properties, arrays with `minItems` > 0 their items), `enum`/`const`, and `false`. Other
keywords (bounds, patterns) are left to xgrammar, which refuses contradictory ones itself.
"""

from __future__ import annotations

from typing import Any, Optional

_MAX_DEPTH = 200  # schemas nested deeper are refused: the walk is recursive


def unsatisfiable(schema: Any) -> Optional[str]:
    """Why no finite JSON value satisfies `schema` (a parsed JSON schema), or None when one may."""
    refs: dict[str, bool] = {}
    targets: dict[str, Any] = {}
    _collect_refs(schema, schema, targets, 0)
    while True:  # least fixpoint: productivity only grows, so this ends within len(targets) + 1 passes
        changed = False
        for ref, target in targets.items():
            if not refs.get(ref, False) and _productive(target, refs, 0):
                refs[ref] = True
                changed = True
        if not changed:
            break
    if _productive(schema, refs, 0):
        return None
    # the greatest fixpoint takes a $ref as finishable unless its target contradicts itself: what it holds
    # and the least does not is what only cycles stop
    hopeful = dict.fromkeys(targets, True)
    while True:
        dropped = [ref for ref, target in targets.items() if hopeful[ref] and not _productive(target, hopeful, 0)]
        if not dropped:
            break
        hopeful.update(dict.fromkeys(dropped, False))
    stuck = sorted(ref for ref in targets if hopeful[ref] and not refs.get(ref, False))
    if stuck and _productive(schema, hopeful, 0):
        through = "itself" if len(stuck) == 1 else "one another"
        return (f"no finite JSON value satisfies it: $ref {', '.join(stuck)} can only be finished through "
                f"{through} (a cycle with no way out)")
    return "no finite JSON value satisfies it (a required part admits nothing)"


def _resolve(root: Any, ref: str) -> Any:
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        raise RuntimeError(f"$ref {ref!r} is not supported: only references within the schema (#/...)")
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise RuntimeError(f"$ref {ref!r} points at nothing in the schema")
    return node


def _collect_refs(node: Any, root: Any, targets: dict[str, Any], depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise RuntimeError(f"the schema is nested more than {_MAX_DEPTH} levels deep")
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref not in targets:
            targets[ref] = _resolve(root, ref)
        for value in node.values():
            _collect_refs(value, root, targets, depth + 1)
    elif isinstance(node, list):
        for value in node:
            _collect_refs(value, root, targets, depth + 1)


def _productive(node: Any, refs: dict[str, bool], depth: int) -> bool:
    """Whether some finite value satisfies `node`, given which $refs are known productive so far."""
    if depth > _MAX_DEPTH:
        raise RuntimeError(f"the schema is nested more than {_MAX_DEPTH} levels deep")
    if node is False:
        return False
    if not isinstance(node, dict):
        return True
    deeper = depth + 1
    ref = node.get("$ref")
    if isinstance(ref, str) and not refs.get(ref, False):
        return False
    if "const" in node:
        return True
    if isinstance(node.get("enum"), list):
        return bool(node["enum"])
    if isinstance(node.get("allOf"), list) and not all(_productive(s, refs, deeper) for s in node["allOf"]):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and not any(_productive(s, refs, deeper) for s in node[key]):
            return False
    kinds = node.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if not isinstance(kinds, list):
        kinds = ["object"] if "properties" in node or "required" in node else (
            ["array"] if "items" in node or "prefixItems" in node else None)
    if kinds is None:
        return True
    return any(_kind_productive(kind, node, refs, deeper) for kind in kinds)


def _kind_productive(kind: Any, node: dict, refs: dict[str, bool], depth: int) -> bool:
    if kind == "object":
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = node.get("required") if isinstance(node.get("required"), list) else []
        extra = node.get("additionalProperties", True)
        return all(_productive(properties[name] if name in properties else extra, refs, depth)
                   for name in required if isinstance(name, str))
    if kind == "array":
        least = node.get("minItems", 0)
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        if not isinstance(least, int) or least <= 0:
            return True
        if not all(_productive(item, refs, depth) for item in prefix[:least]):
            return False
        return least <= len(prefix) or _productive(node.get("items", True), refs, depth)
    return True
